// See [Note: forward dataflow] in sharc/runtime/forward_dataflow.h.

#include "sharc/runtime/forward_dataflow.h"

#include <algorithm>
#include <deque>
#include <unordered_set>

#include <torch/csrc/autograd/function.h>

namespace sharc {

bool ForwardDataflow::begin_graph(const std::vector<at::Tensor>& inputs,
                                  int64_t backward_ends) {
  if (continues(inputs, backward_ends)) return true;
  outputs_.clear();
  output_nodes_.clear();
  oldest_output_node_ = UINT64_MAX;
  backward_ends_ = backward_ends;
  return false;
}

void ForwardDataflow::graph_returned(const std::vector<at::Tensor>& outputs) {
  for (const at::Tensor& output : outputs) {
    if (!output.defined()) continue;
    outputs_.emplace_back(output.getIntrusivePtr());
    const torch::autograd::Node* node = output.grad_fn().get();
    // A graph's outputs mostly share one node (its backward): kept once.
    if (node != nullptr &&
        (output_nodes_.empty() || output_nodes_.back().first != node)) {
      output_nodes_.emplace_back(node, node->sequence_nr());
      oldest_output_node_ = std::min(oldest_output_node_, node->sequence_nr());
    }
  }
}

bool ForwardDataflow::continues(const std::vector<at::Tensor>& inputs,
                                int64_t backward_ends) const {
  if (backward_ends != backward_ends_) return false;  // a new step, or no pass yet
  for (const at::Tensor& input : inputs) {
    if (!input.defined()) continue;
    for (const auto& output : outputs_) {
      if (output.lock().get() == input.unsafeGetTensorImpl()) return true;
    }
  }
  return reaches_outputs(inputs);
}

bool ForwardDataflow::reaches_outputs(const std::vector<at::Tensor>& inputs) const {
  if (output_nodes_.empty()) return false;
  std::deque<torch::autograd::Node*> frontier;
  std::unordered_set<const torch::autograd::Node*> seen;
  auto visit = [&](torch::autograd::Node* node) {
    // Older than the pass's first output: made before the pass, so no path
    // to its outputs goes through it.
    if (node != nullptr && node->sequence_nr() >= oldest_output_node_ &&
        seen.insert(node).second) {
      frontier.push_back(node);
    }
  };
  for (const at::Tensor& input : inputs) {
    if (input.defined()) visit(input.grad_fn().get());
  }
  while (!frontier.empty()) {
    torch::autograd::Node* node = frontier.front();
    frontier.pop_front();
    // A node found alive from an input is a recorded one only if its
    // number matches too: the address alone may be a freed node's, reused.
    const std::pair<const torch::autograd::Node*, uint64_t> found{node, node->sequence_nr()};
    if (std::find(output_nodes_.begin(), output_nodes_.end(), found) != output_nodes_.end()) {
      return true;
    }
    for (const torch::autograd::Edge& edge : node->next_edges()) visit(edge.function.get());
  }
  return false;
}

}  // namespace sharc
