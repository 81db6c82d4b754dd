// torch.classes.sharc.Scheduler: runs sharc's pass pipeline (sharc/compiler/pipeline.h)
// over the IR text the Python FX bridge produces, and returns the schedule.
//
//   schedule_nodes(ir_text, gather_bucket_bytes=, reduce_bucket_bytes=,
//                  disabled_passes=, trace=, memory_budget_bytes=,
//                  collective_costs=, keep_for_backward=, raise_budget_to_feasible=,
//                  keep_candidates=)
//     -> (scheduled IR text,
//         nodes: [(kind, outputs, operands, params)],
//         passes: [(pass, rewrites, skipped)],
//         trace: [(pass, "before" | "after", IR text)],
//         params: [(id, dtype it is gathered in ("" if unknown), kept)],
//         budget: the memory budget the schedule was held to (-1: none))
//   with every list a list (value names without '%', parameter ids as ints).
//   gather_bucket_bytes, reduce_bucket_bytes and memory_budget_bytes take -1
//   for "unset" (chosen by the scheduler; no cap); collective_costs is [] (not measured) or the
//   runtime's four numbers (Runtime::collective_costs). With
//   raise_budget_to_feasible (a default budget, not the user's), a budget
//   below the graph's smallest feasible one is raised to it instead of
//   refused. keep_candidates (IR ids; None: all) limits what selective
//   unsharding may keep to what the backward reads again.
//
//   peak_gathered_bytes(ir_text) -> the most parameter bytes the schedule
//   holds gathered at once (sharc/compiler/memory.h).
//
//   predict(ir_text, collective_costs) -> (end_us, exposed_us, compute_us):
//   the timeline model's run of a schedule (sharc/compiler/timeline.h):
//   when it ends, the time held in waits, and the compute costs' sum.

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

Run run_pipeline(const std::string& ir_text, const ir::PipelineOptions& options, bool trace) {
  Run run{ir::parse(ir_text), {}, {}};
  ir::PassManager manager = ir::make_pipeline(options);
  if (trace) {
    manager.set_printer([&run](const std::string& pass, const std::string& when,
                               const std::string& text) {
      run.steps.emplace_back(pass, when, text);
    });
  }
  run.passes = manager.run(run.graph);
  return run;
}

// ---------------------------------------------------------- schedule_nodes

using NodeTuple = std::tuple<std::string, std::vector<std::string>, std::vector<std::string>,
                             std::vector<int64_t>>;
using PassTuple = std::tuple<std::string, int64_t, bool>;
using ParamTuple = std::tuple<int64_t, std::string, bool>;
using Scheduled = std::tuple<std::string, std::vector<NodeTuple>, std::vector<PassTuple>,
                             std::vector<Step>, std::vector<ParamTuple>, int64_t>;

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

std::optional<int64_t> unless_negative(int64_t value) {
  return value < 0 ? std::nullopt : std::optional<int64_t>(value);
}

ir::PipelineOptions pipeline_options(int64_t gather_bucket_bytes, int64_t reduce_bucket_bytes,
                                     std::vector<std::string> disabled_passes,
                                     int64_t memory_budget_bytes,
                                     const std::vector<double>& collective_costs,
                                     bool keep_for_backward,
                                     const std::optional<std::vector<int64_t>>& keep_candidates) {
  SHARC_CHECK(collective_costs.empty() || collective_costs.size() == 4,
              "sharc: collective_costs takes 4 numbers (all-gather latency, all-gather time "
              "per byte, reduce-scatter latency, reduce-scatter time per byte), got ",
              collective_costs.size());
  ir::PipelineOptions options;
  options.gather_bucket_bytes = unless_negative(gather_bucket_bytes);
  options.reduce_bucket_bytes = unless_negative(reduce_bucket_bytes);
  options.disabled_passes = std::move(disabled_passes);
  options.memory_budget_bytes = unless_negative(memory_budget_bytes);
  if (!collective_costs.empty()) {
    options.gather_cost = CollectiveCost{collective_costs[0], collective_costs[1]};
    options.reduce_cost = CollectiveCost{collective_costs[2], collective_costs[3]};
  }
  options.keep_for_backward = keep_for_backward;
  if (keep_candidates) {
    options.keep_candidates = std::set<int64_t>(keep_candidates->begin(), keep_candidates->end());
  }
  return options;
}

// Throws sharc::Error on bad IR, an unknown pass name or a violated rule.
Scheduled schedule_nodes(std::string ir_text, int64_t gather_bucket_bytes,
                         int64_t reduce_bucket_bytes, std::vector<std::string> disabled_passes,
                         bool trace, int64_t memory_budget_bytes,
                         std::vector<double> collective_costs, bool keep_for_backward,
                         bool raise_budget_to_feasible,
                         std::optional<std::vector<int64_t>> keep_candidates) {
  ir::PipelineOptions options =
      pipeline_options(gather_bucket_bytes, reduce_bucket_bytes, std::move(disabled_passes),
                       memory_budget_bytes, collective_costs, keep_for_backward,
                       keep_candidates);
  if (raise_budget_to_feasible && options.memory_budget_bytes) {
    // A default budget (not the user's) never makes a graph uncompilable.
    options.memory_budget_bytes = std::max(
        *options.memory_budget_bytes, ir::smallest_feasible_budget(ir::parse(ir_text)));
  }
  const Run run = run_pipeline(ir_text, options, trace);
  std::vector<NodeTuple> nodes;
  for (const ir::Node& n : run.graph.nodes) nodes.push_back(to_tuple(n));
  std::vector<PassTuple> passes;
  for (const ir::PassRecord& r : run.passes) passes.emplace_back(r.name, r.rewrites, r.skipped);
  // The dtype each parameter is gathered in (cast_before_gather may narrow it).
  std::vector<ParamTuple> params;
  for (const auto& [id, p] : run.graph.params) {
    params.emplace_back(id, p.dtype.value_or(""), p.kept);
  }
  return {ir::print(run.graph), nodes, passes, run.steps, params,
          options.memory_budget_bytes.value_or(-1)};
}

int64_t peak_gathered_bytes(std::string ir_text) {
  return ir::peak_gathered(ir::parse(ir_text)).bytes;
}

std::tuple<double, double, double> predict(std::string ir_text,
                                           std::vector<double> collective_costs) {
  const ir::PipelineOptions options =
      pipeline_options(-1, -1, {}, -1, collective_costs, false, std::nullopt);
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

TORCH_LIBRARY_FRAGMENT(sharc, m) {
  const sharc::ir::PipelineOptions defaults;
  m.class_<sharc::Scheduler>("Scheduler")
      .def_static("schedule_nodes", &sharc::schedule_nodes,
                  "Runs the pass pipeline; returns (IR text, nodes, passes, trace, params, budget)",
                  {torch::arg("ir_text"),
                   torch::arg("gather_bucket_bytes") = -1,
                   torch::arg("reduce_bucket_bytes") = -1,
                   torch::arg("disabled_passes") = c10::List<std::string>(),
                   torch::arg("trace") = false,
                   torch::arg("memory_budget_bytes") = -1,
                   torch::arg("collective_costs") = c10::List<double>(),
                   torch::arg("keep_for_backward") = false,
                   torch::arg("raise_budget_to_feasible") = false,
                   torch::arg("keep_candidates") = c10::IValue()})
      .def_static("pass_names", &sharc::ir::pipeline_pass_names)
      .def_static("peak_gathered_bytes", &sharc::peak_gathered_bytes,
                  "The most parameter bytes an IR schedule holds gathered at once",
                  {torch::arg("ir_text")})
      .def_static("predict", &sharc::predict,
                  "The timeline model's run of a schedule: (end_us, exposed_us, compute_us)",
                  {torch::arg("ir_text"), torch::arg("collective_costs") = c10::List<double>()});
}
