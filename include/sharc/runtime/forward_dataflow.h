#pragma once
// Whether a compiled forward graph continues the forward pass the graphs
// before it make (cross-graph prefetch follows an order within a pass only:
// [Note: cross-graph prefetch]).
//
// [Note: forward dataflow]
// A graph continues the pass when it reads what a forward graph of the pass
// returned: the very tensor (the graph break handed it on untouched), or,
// where eager code between graphs computed on it (a residual add, a
// router's dispatch to experts at a graph break), a tensor whose autograd
// history reaches such an output. Any graph of the pass counts, not only
// the last: experts called one after the other each read the router's
// output, never each other's. The search walks the history back from the
// inputs, nearest nodes first, and stops at nodes older than the pass's
// first graph (autograd numbers the nodes a thread makes in order), so it
// visits only what the pass made and needs no bound: a bound would cut the
// search at a point that depends on how much eager work a rank did (routing
// that differs by rank), and the ranks must decide alike. Without autograd
// history (no_grad, inference) only the very tensor counts. A backward
// that ended since the pass's last graph begins a new pass: the next step's
// graphs do not follow the last step's, even where a tensor carried over
// between steps links them.

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}

namespace sharc {

class ForwardDataflow {
 public:
  /// A forward graph is about to read `inputs`; `backward_ends` is the
  /// runtime's count of backward passes ended so far. Returns whether it
  /// continues the pass (see [Note: forward dataflow]); if not, a new pass
  /// begins with it.
  bool begin_graph(const std::vector<at::Tensor>& inputs, int64_t backward_ends);
  /// The forward graph that ran has returned `outputs`.
  void graph_returned(const std::vector<at::Tensor>& outputs);

 private:
  bool continues(const std::vector<at::Tensor>& inputs, int64_t backward_ends) const;
  bool reaches_outputs(const std::vector<at::Tensor>& inputs) const;

  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> outputs_;  ///< of the pass's graphs
  /// Their autograd nodes, by address and sequence number: not held (the
  /// history must die with the user's tensors), so only ever compared with
  /// nodes reached alive from an input.
  std::vector<std::pair<const torch::autograd::Node*, uint64_t>> output_nodes_;
  uint64_t oldest_output_node_ = UINT64_MAX;  ///< the lowest sequence number among them
  int64_t backward_ends_ = -1;  ///< when the pass began; -1: none yet
};

}  // namespace sharc
