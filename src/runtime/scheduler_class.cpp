// torch.classes.sharc.Scheduler: runs sharc's pass pipeline (sharc/compiler/pipeline.h)
// over the IR text the Python FX bridge produces, and returns the schedule.
//
//   schedule_nodes(ir_text, gather_bucket_bytes=, reduce_bucket_bytes=,
//                  disabled_passes=, trace=)
//     -> (scheduled IR text,
//         nodes: [(kind, outputs, operands, params)],
//         passes: [(pass, rewrites, skipped)],
//         trace: [(pass, "before" | "after", IR text)],
//         params: [(id, dtype it is gathered in, "" if unknown)])
//   with every list a list (value names without '%', parameter ids as ints).

#include <string>
#include <tuple>
#include <vector>

#include <torch/custom_class.h>
#include <torch/library.h>

#include "sharc/core/error.h"
#include "sharc/compiler/ir.h"
#include "sharc/compiler/pipeline.h"

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
using ParamTuple = std::tuple<int64_t, std::string>;
using Scheduled = std::tuple<std::string, std::vector<NodeTuple>, std::vector<PassTuple>,
                             std::vector<Step>, std::vector<ParamTuple>>;

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

// Throws sharc::Error on bad IR, an unknown pass name or a violated rule.
Scheduled schedule_nodes(std::string ir_text, int64_t gather_bucket_bytes,
                         int64_t reduce_bucket_bytes, std::vector<std::string> disabled_passes,
                         bool trace) {
  const Run run = run_pipeline(
      ir_text, {gather_bucket_bytes, reduce_bucket_bytes, std::move(disabled_passes)}, trace);
  std::vector<NodeTuple> nodes;
  for (const ir::Node& n : run.graph.nodes) nodes.push_back(to_tuple(n));
  std::vector<PassTuple> passes;
  for (const ir::PassRecord& r : run.passes) passes.emplace_back(r.name, r.rewrites, r.skipped);
  // The dtype each parameter is gathered in (cast_before_gather may narrow it).
  std::vector<ParamTuple> params;
  for (const auto& [id, p] : run.graph.params) params.emplace_back(id, p.dtype.value_or(""));
  return {ir::print(run.graph), nodes, passes, run.steps, params};
}

class Scheduler : public torch::CustomClassHolder {};

}  // namespace
}  // namespace sharc

TORCH_LIBRARY_FRAGMENT(sharc, m) {
  const sharc::ir::PipelineOptions defaults;
  m.class_<sharc::Scheduler>("Scheduler")
      .def_static("schedule_nodes", &sharc::schedule_nodes,
                  "Runs the pass pipeline; returns (IR text, nodes, passes, trace, params)",
                  {torch::arg("ir_text"),
                   torch::arg("gather_bucket_bytes") = defaults.gather_bucket_bytes,
                   torch::arg("reduce_bucket_bytes") = defaults.reduce_bucket_bytes,
                   torch::arg("disabled_passes") = c10::List<std::string>(),
                   torch::arg("trace") = false})
      .def_static("pass_names", &sharc::ir::pipeline_pass_names);
}
