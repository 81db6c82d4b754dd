// torch.classes.sharc.Scheduler: runs a pass pipeline (sharc/compiler/pipeline.h,
// pipeline_text.h) over the IR text the Python FX bridge produces.
//
//   Scheduler.run(ir_text, pipeline, facts, trace=False) -> Schedule
//     pipeline: the pipeline as text; "" runs the shipping pipeline. Each
//       pass's arguments not written are taken from the shipping pipeline
//       for these facts.
//     facts: a ScheduleFacts, what the schedule is built from:
//       memory_budget_bytes: int | None (None: no cap)
//       budget_is_default: bool (a budget below the graph's smallest
//         feasible one is raised to it instead of refused: the default
//         rule's budget, not a user's)
//       collective_costs: [] (not measured) or the runtime's four numbers
//         (Runtime::collective_costs)
//       keep_for_backward: bool (a forward graph whose backward reads
//         parameters again: selective unsharding may keep them)
//       keep_candidates: [IR ids] | None (None: every parameter)
//       replicas: int (hybrid sharding's replicate group size; 1: flat)
//   A Schedule's fields (read-only):
//     ir: the scheduled IR text
//     pipeline: the pipeline that ran, every argument written out (running it
//       again on the same IR gives the same schedule: sharc-opt replays it)
//     nodes: [(kind, outputs, operands, params)], value names without '%'
//     passes: [(pass, skipped, {statistic: count})], "rewrites" among them
//     trace: [(pass, "before" | "after", IR text)] when traced
//     params: [(id, dtype it is gathered in ("" if unknown), kept)]
//     budget: the memory budget the schedule was held to, or None
//
//   Scheduler.pass_names() -> the shipping pipeline's passes, in order
//   Scheduler.normalize_pipeline(text) -> the text parsed and printed again
//     (a bad text raises, naming what is wrong)
//   Scheduler.peak_gathered_bytes(ir_text) -> the most parameter bytes the
//     schedule holds gathered at once (sharc/compiler/memory.h)
//   Scheduler.largest_gathered_param_bytes(ir_text, pipeline) -> the largest
//     parameter the graph reads, in the dtype the pipeline gathers it in
//     (pipeline.h, largest_gathered_param)
//   Scheduler.predict(ir_text, collective_costs) -> (end_us, exposed_us,
//     compute_us): the timeline model's run of a schedule
//     (sharc/compiler/timeline.h)
//   Scheduler.inter_host_bytes(param_bytes, hosts, per_host, hybrid) -> the
//     bytes a host sends to the others per step, and
//   Scheduler.predict_step_us(compute_us, inter_host_bytes, link_bits_per_s)
//     -> a step's time when that link is the bottleneck
//     (sharc/core/collective_cost.h)

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <torch/custom_class.h>
#include <torch/library.h>

#include "sharc/core/error.h"
#include "sharc/compiler/ir.h"
#include "sharc/compiler/memory.h"
#include "sharc/compiler/pipeline.h"
#include "sharc/compiler/timeline.h"

namespace sharc {
namespace {

using Step = std::tuple<std::string, std::string, std::string>;  // pass, when, IR

// One pipeline run: the scheduled graph, what each pass did, and the IR
// before and after each pass when traced.
struct Run {
  ir::Graph graph;
  std::vector<ir::PassRecord> passes;
  std::vector<Step> steps;
};

Run run_pipeline(const std::string& ir_text, const ir::PipelineSpec& pipeline, bool trace) {
  Run run{ir::parse(ir_text), {}, {}};
  ir::PassManager manager = ir::build_pipeline(pipeline);
  if (trace) {
    manager.set_printer([&run](const std::string& pass, const std::string& when,
                               const std::string& text) {
      run.steps.emplace_back(pass, when, text);
    });
  }
  run.passes = manager.run(run.graph);
  return run;
}

// ---------------------------------------------------------------- Schedule

using NodeTuple = std::tuple<std::string, std::vector<std::string>, std::vector<std::string>,
                             std::vector<int64_t>>;
using PassTuple = std::tuple<std::string, bool, c10::Dict<std::string, int64_t>>;
using ParamTuple = std::tuple<int64_t, std::string, bool>;

// (kind, outputs, operands, params). A scheduled graph reads no parameter
// directly (the final rules forbid it), so every operand is a value name.
NodeTuple to_tuple(const ir::Node& n) {
  std::vector<std::string> operands;
  for (const ir::Operand& o : n.operands) {
    SHARC_CHECK(!o.is_param(), "sharc: scheduled ", ir::to_string(n.kind),
                " node reads parameter @", *o.param, " directly");
    operands.push_back(o.value);
  }
  return {ir::to_string(n.kind), n.outputs, operands, n.params};
}

struct ScheduleFacts : torch::CustomClassHolder {
  std::optional<int64_t> memory_budget_bytes;
  bool budget_is_default = false;
  std::vector<double> collective_costs;
  bool keep_for_backward = false;
  std::optional<std::vector<int64_t>> keep_candidates;
  int64_t replicas = 1;

  ir::PipelineOptions options() const {
    SHARC_CHECK(collective_costs.empty() || collective_costs.size() == 4,
                "sharc: collective_costs takes 4 numbers (all-gather latency, all-gather time "
                "per byte, reduce-scatter latency, reduce-scatter time per byte), got ",
                collective_costs.size());
    SHARC_CHECK(!memory_budget_bytes || *memory_budget_bytes >= 0,
                "sharc: memory_budget_bytes must be None or at least 0, got ",
                *memory_budget_bytes);
    ir::PipelineOptions o;
    o.memory_budget_bytes = memory_budget_bytes;
    if (!collective_costs.empty()) {
      o.gather_cost = CollectiveCost{collective_costs[0], collective_costs[1]};
      o.reduce_cost = CollectiveCost{collective_costs[2], collective_costs[3]};
    }
    o.keep_for_backward = keep_for_backward;
    SHARC_CHECK(replicas >= 1, "sharc: replicas must be at least 1, got ", replicas);
    o.replicas = replicas;
    if (keep_candidates) {
      o.keep_candidates = std::set<int64_t>(keep_candidates->begin(), keep_candidates->end());
    }
    return o;
  }
};

struct Schedule : torch::CustomClassHolder {
  std::string ir;
  std::string pipeline;
  std::vector<NodeTuple> nodes;
  std::vector<PassTuple> passes;
  std::vector<Step> trace;
  std::vector<ParamTuple> params;
  std::optional<int64_t> budget;
};

// The pipeline to run: `text` (or the shipping one) with the arguments it
// leaves out taken from the facts.
ir::PipelineSpec pipeline_for(const std::string& text, const ir::Graph& graph,
                              const ScheduleFacts& facts) {
  ir::PipelineOptions options = facts.options();
  if (facts.budget_is_default && options.memory_budget_bytes) {
    // A default budget (not the user's) never makes a graph uncompilable.
    options.memory_budget_bytes =
        std::max(*options.memory_budget_bytes, ir::smallest_feasible_budget(graph));
  }
  if (text.find_first_not_of(" \t\n") == std::string::npos) {
    return ir::shipping_pipeline(options);
  }
  return ir::complete_pipeline(ir::parse_pipeline(text), options);
}

std::optional<int64_t> pipeline_budget(const ir::PipelineSpec& pipeline) {
  for (const ir::PassSpec& spec : pipeline) {
    if (spec.name != "check_memory_budget" || !spec.enabled) continue;
    auto it = spec.args.find("budget");
    if (it != spec.args.end() && it->second != "none") return std::stoll(it->second);
  }
  return std::nullopt;
}

// Throws sharc::Error on bad IR or pipeline text, an unknown pass or
// argument, or a violated rule.
c10::intrusive_ptr<Schedule> run(std::string ir_text, std::string pipeline_text,
                                 c10::intrusive_ptr<ScheduleFacts> facts, bool trace) {
  const ir::PipelineSpec pipeline = pipeline_for(pipeline_text, ir::parse(ir_text), *facts);
  const Run run = run_pipeline(ir_text, pipeline, trace);
  auto schedule = c10::make_intrusive<Schedule>();
  schedule->ir = ir::print(run.graph);
  schedule->pipeline = ir::print_pipeline(pipeline);
  for (const ir::Node& n : run.graph.nodes) schedule->nodes.push_back(to_tuple(n));
  for (const ir::PassRecord& r : run.passes) {
    c10::Dict<std::string, int64_t> stats;
    for (const auto& [key, value] : r.stats) stats.insert(key, value);
    schedule->passes.emplace_back(r.name, r.skipped, std::move(stats));
  }
  schedule->trace = run.steps;
  // The dtype each parameter is gathered in (cast_before_gather may narrow it).
  for (const auto& [id, p] : run.graph.params) {
    schedule->params.emplace_back(id, p.dtype.value_or(""), p.kept);
  }
  schedule->budget = pipeline_budget(pipeline);
  return schedule;
}

std::string normalize_pipeline(std::string text) {
  const ir::PipelineSpec pipeline = ir::parse_pipeline(text);
  // The names and arguments exist (those left out filled in as they will be).
  for (const ir::PassSpec& spec : ir::complete_pipeline(pipeline, {})) ir::make_pass(spec);
  return ir::print_pipeline(pipeline);
}

int64_t largest_gathered_param_bytes(std::string ir_text, std::string pipeline_text) {
  const bool shipping = pipeline_text.find_first_not_of(" \t\n") == std::string::npos;
  return ir::largest_gathered_param(
      ir::parse(ir_text),
      shipping ? ir::shipping_pipeline({}) : ir::parse_pipeline(pipeline_text));
}

int64_t peak_gathered_bytes(std::string ir_text) {
  return ir::peak_gathered(ir::parse(ir_text)).bytes;
}

int64_t inter_host_bytes(int64_t param_bytes, int64_t hosts, int64_t per_host, bool hybrid) {
  return inter_host_bytes_per_step(param_bytes, hosts, per_host, hybrid);
}

double step_us(double compute_us, int64_t bytes, double link_bits_per_s) {
  return predict_step_us(compute_us, bytes, link_bits_per_s);
}

std::tuple<double, double, double> predict(std::string ir_text,
                                           std::vector<double> collective_costs) {
  ScheduleFacts facts;
  facts.collective_costs = std::move(collective_costs);
  const ir::PipelineOptions options = facts.options();
  const ir::Graph graph = ir::parse(ir_text);
  const ir::Timeline line = ir::predict(graph, {options.gather_cost, options.reduce_cost});
  double compute = 0.0;
  for (const ir::Node& n : graph.nodes) {
    if (n.kind == ir::NodeKind::Compute) compute += std::max(0.0, n.cost.value_or(0.0));
  }
  return {line.end_us, line.exposed_us, compute};
}

class Scheduler : public torch::CustomClassHolder {};

}  // namespace
}  // namespace sharc

// Static methods with named (and defaulted) arguments where torch's
// custom classes take them (2.13); without the names on older releases
// (2.11, the GPU machines' torch), where Python then passes every argument
// by position, as sharc's own callers do.
template <typename Class, typename Func>
auto def_static_named(Class& cls, const std::string& name, Func func, const std::string& doc,
                      std::initializer_list<torch::arg> args, int)
    -> decltype(cls.def_static(name, func, doc, args), void()) {
  cls.def_static(name, func, doc, args);
}
template <typename Class, typename Func>
void def_static_named(Class& cls, const std::string& name, Func func, const std::string& doc,
                      std::initializer_list<torch::arg>, long) {
  cls.def_static(name, func, doc);
}
template <typename Class, typename Func>
void def_static_named(Class& cls, const std::string& name, Func func, const std::string& doc,
                      std::initializer_list<torch::arg> args) {
  def_static_named(cls, name, func, doc, args, 0);
}

TORCH_LIBRARY_FRAGMENT(sharc, m) {
  using sharc::Schedule;
  using sharc::ScheduleFacts;
  m.class_<ScheduleFacts>("ScheduleFacts")
      .def(torch::init<>())
      .def_readwrite("memory_budget_bytes", &ScheduleFacts::memory_budget_bytes)
      .def_readwrite("budget_is_default", &ScheduleFacts::budget_is_default)
      .def_readwrite("collective_costs", &ScheduleFacts::collective_costs)
      .def_readwrite("keep_for_backward", &ScheduleFacts::keep_for_backward)
      .def_readwrite("keep_candidates", &ScheduleFacts::keep_candidates)
      .def_readwrite("replicas", &ScheduleFacts::replicas);
  m.class_<Schedule>("Schedule")
      .def_readonly("ir", &Schedule::ir)
      .def_readonly("pipeline", &Schedule::pipeline)
      .def_readonly("nodes", &Schedule::nodes)
      .def_readonly("passes", &Schedule::passes)
      .def_readonly("trace", &Schedule::trace)
      .def_readonly("params", &Schedule::params)
      .def_readonly("budget", &Schedule::budget);
  auto scheduler = m.class_<sharc::Scheduler>("Scheduler");
  def_static_named(scheduler, "run", &sharc::run,
                   "Runs a pass pipeline over IR text; returns a Schedule",
                   {torch::arg("ir_text"), torch::arg("pipeline"), torch::arg("facts"),
                    torch::arg("trace") = false});
  scheduler.def_static("pass_names", &sharc::ir::pipeline_pass_names);
  def_static_named(scheduler, "normalize_pipeline", &sharc::normalize_pipeline,
                   "A pipeline's text parsed, checked and printed again", {torch::arg("text")});
  def_static_named(scheduler, "peak_gathered_bytes", &sharc::peak_gathered_bytes,
                   "The most parameter bytes an IR schedule holds gathered at once",
                   {torch::arg("ir_text")});
  def_static_named(scheduler, "largest_gathered_param_bytes",
                   &sharc::largest_gathered_param_bytes,
                   "The largest parameter an IR graph reads, in the dtype the pipeline "
                   "gathers it in",
                   {torch::arg("ir_text"), torch::arg("pipeline") = std::string()});
  scheduler.def_static("inter_host_bytes", &sharc::inter_host_bytes,
                       "Bytes a host sends to the other hosts per step (collective_cost.h)");
  scheduler.def_static("predict_step_us", &sharc::step_us,
                       "A step's time with the link between hosts as the bottleneck");
  def_static_named(scheduler, "predict", &sharc::predict,
                   "The timeline model's run of a schedule: (end_us, exposed_us, compute_us)",
                   {torch::arg("ir_text"),
                    torch::arg("collective_costs") = c10::List<double>()});
}
