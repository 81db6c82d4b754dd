// torch.classes.sharc.Scheduler: runs sharc's pass pipeline (sharc/pipeline.h)
// over the IR text the Python FX bridge produces, and returns the schedule.

#include <string>
#include <tuple>
#include <vector>

#include <torch/custom_class.h>
#include <torch/library.h>

#include "sharc/ir.h"
#include "sharc/pipeline.h"

namespace sharc {
namespace {

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ",") + item;
  return out;
}

// One scheduled node as the bridge reads it: [kind, outputs, operands,
// params], lists comma-separated; operands are "%value" or "@param".
std::vector<std::string> encode(const ir::Node& n) {
  std::vector<std::string> operands, params;
  for (const ir::Operand& o : n.operands) {
    operands.push_back(o.is_param() ? "@" + std::to_string(*o.param) : "%" + o.value);
  }
  for (int64_t p : n.params) params.push_back(std::to_string(p));
  return {ir::to_string(n.kind), join(n.outputs), join(operands), join(params)};
}

using Schedule = std::tuple<std::string, std::vector<std::vector<std::string>>,
                            std::vector<std::string>>;

// Returns (scheduled IR text, its nodes encoded as above, and when `trace` is
// set one "pass\nbefore|after\nIR" entry per printed step). Throws
// sharc::Error on bad IR or a violated rule.
Schedule schedule(std::string ir_text, int64_t gather_bucket_bytes, int64_t reduce_bucket_bytes,
                  std::vector<std::string> disabled, bool trace) {
  ir::Graph graph = ir::parse(ir_text);
  ir::PassManager manager =
      ir::make_pipeline({gather_bucket_bytes, reduce_bucket_bytes, std::move(disabled)});
  std::vector<std::string> steps;
  if (trace) {
    manager.set_printer([&steps](const std::string& pass, const std::string& when,
                                 const std::string& text) {
      steps.push_back(pass + "\n" + when + "\n" + text);
    });
  }
  manager.run(graph);
  std::vector<std::vector<std::string>> nodes;
  for (const ir::Node& n : graph.nodes) nodes.push_back(encode(n));
  return {ir::print(graph), nodes, steps};
}

class Scheduler : public torch::CustomClassHolder {};

}  // namespace
}  // namespace sharc

TORCH_LIBRARY_FRAGMENT(sharc, m) {
  m.class_<sharc::Scheduler>("Scheduler").def_static("schedule", &sharc::schedule)
      .def_static("pass_names", &sharc::ir::pipeline_pass_names);
}
