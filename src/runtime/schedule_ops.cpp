// torch.ops.sharc.* operators that sharc's compile backend places in FX graphs
// as its passes decide (the eager path never uses them):
//
//   start_gather(shards, group, params, dtype, graph_kind) -> token
//       Non-blocking all-gather of `params` in `dtype` (one collective for a
//       bucket; the shards are cast first when `dtype` is smaller). The
//       shards are inputs only so that compilers see the dependence.
//       `graph_kind` (0 forward, 1 backward) notes the gather in the order
//       of compiled graphs (cross-graph prefetch); -1 does not.
//   wait_gather(token, group, params, dtype) -> fulls
//       Blocks until gathered, takes one hold per parameter and returns the
//       true-shape full tensors in `dtype`, aliases of the runtime's buffers.
//   release(full, after, group, param) -> ()
//       Drops the hold (Runtime::release, ReleaseMode::kFree); the last one
//       frees the buffer's bytes in place, so references a compiler keeps
//       until its graph ends hold no memory.
//       `after` (the last user's outputs) ties the release to that use.
//   start_reduce_scatter(grads, group, params) -> token
//       Non-blocking reduce-scatter of several gradients in one collective.
//       The token is a one-element int64 tensor on the gradients' device
//       that names the reduction by its address (never read back).
//   wait_reduce_scatter(token, group, params) -> shard grads
//       Waits for the reduction of `token`; each parameter's flat shard
//       gradient, averaged. A token waited on already is an error.
//   start_replicate_all_reduce(token, group, params) -> token
//       Hybrid sharding: waits the reduce-scatter of `token` and starts the
//       all-reduce of its shard sums over the replicate group; the token it
//       returns names the same reduction, for its wait_reduce_scatter.
//   prefetch_next_graph(shards, after, group, graph_kind, key, budget) -> ()
//       The graph's prefetch point: starts the first gather of the graph
//       that followed this one last time, within `budget` bytes gathered
//       (Runtime::prefetch_next_graph). `key` names this graph (its last
//       gather's parameters, whose `shards` give the op its device);
//       `after` orders it after those values.
//
// Each op calls the Runtime method of its name. start_gather, release,
// start_reduce_scatter, start_replicate_all_reduce and prefetch_next_graph are registered as side-effecting in Python
// (sharc/_compile/ops.py) so neither FX nor Inductor drops them.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "sharc/core/error.h"
#include "sharc/runtime/runtime_table.h"

namespace sharc {
namespace {

at::Tensor start_gather_kernel(at::TensorList shards, const std::string& group,
                               c10::IntArrayRef params, c10::ScalarType dtype,
                               int64_t graph_kind) {
  auto runtime = RuntimeTable::instance().get(group);
  SHARC_CHECK(shards.size() == params.size() && !params.empty(), "sharc: start_gather got ",
              shards.size(), " shards for ", params.size(), " parameters");
  for (size_t i = 0; i < params.size(); ++i) runtime->check_shard(params[i], shards[i]);
  if (graph_kind >= 0) {
    runtime->start_graph_gather(graph_kind, params.vec(), dtype);
  } else {
    runtime->start_gather(params.vec(), dtype);
  }
  return at::empty({0}, shards[0].options());
}

at::Tensor start_gather_meta(at::TensorList shards, const std::string& group,
                             c10::IntArrayRef params, c10::ScalarType dtype,
                             int64_t graph_kind) {
  return at::empty({0}, shards[0].options().device(c10::kMeta));
}

std::vector<at::Tensor> wait_gather_kernel(const at::Tensor& token, const std::string& group,
                                           c10::IntArrayRef params, c10::ScalarType dtype) {
  std::vector<at::Tensor> fulls = RuntimeTable::instance().get(group)->wait_gather(params.vec());
  for (const at::Tensor& full : fulls) {
    SHARC_CHECK(full.scalar_type() == dtype, "sharc: a compiled graph waited for a ", dtype,
                " gather and got ", full.scalar_type(), "; this is a sharc bug");
  }
  return fulls;
}

std::vector<at::Tensor> wait_gather_meta(const at::Tensor& token, const std::string& group,
                                         c10::IntArrayRef params, c10::ScalarType dtype) {
  auto runtime = RuntimeTable::instance().get(group);
  std::vector<at::Tensor> fulls;
  for (int64_t id : params) fulls.push_back(runtime->meta_full(id, dtype));
  return fulls;
}

void release_kernel(const at::Tensor& full, at::TensorList after, const std::string& group,
                    int64_t param) {
  RuntimeTable::instance().get(group)->release(param, ReleaseMode::kFree);
}

void release_meta(const at::Tensor& full, at::TensorList after, const std::string& group,
                  int64_t param) {}

// The token tensor lives on the gradients' device (a compiler's fake tensors
// give an op's outputs its inputs' device) and names the reduction by its
// address, never by its value (Runtime::token_tensor).
at::Tensor start_reduce_scatter_kernel(at::TensorList grads, const std::string& group,
                                       c10::IntArrayRef params) {
  SHARC_CHECK(!grads.empty(), "sharc: start_reduce_scatter got no gradients");
  auto runtime = RuntimeTable::instance().get(group);
  const int64_t token = runtime->start_reduce_scatter(params.vec(), grads.vec());
  return runtime->token_tensor(token, grads[0].options());
}

at::Tensor start_reduce_scatter_meta(at::TensorList grads, const std::string& group,
                                     c10::IntArrayRef params) {
  return at::empty({1}, grads[0].options().dtype(at::kLong).device(c10::kMeta));
}

std::vector<at::Tensor> wait_reduce_scatter_kernel(const at::Tensor& token,
                                                   const std::string& group,
                                                   c10::IntArrayRef params) {
  auto runtime = RuntimeTable::instance().get(group);
  std::vector<at::Tensor> shards = runtime->wait_reduce_scatter_in_graph(runtime->take_token(token));
  SHARC_CHECK(shards.size() == params.size(), "sharc: the reduce-scatter of this token serves ",
              shards.size(), " parameters, not ", params.size(), "; this is a sharc bug");
  return shards;
}

std::vector<at::Tensor> wait_reduce_scatter_meta(const at::Tensor& token,
                                                 const std::string& group,
                                                 c10::IntArrayRef params) {
  auto runtime = RuntimeTable::instance().get(group);
  std::vector<at::Tensor> shards;
  for (int64_t id : params) {
    const int64_t numel = runtime->layout(id).shard_numel();
    shards.push_back(at::empty({numel}, token.options().dtype(runtime->spec(id).grad_dtype)));
  }
  return shards;
}

// Hybrid sharding: the reduction's token comes in and a new token tensor
// for the same reduction goes out, so the wait that follows depends on this
// op and a compiler cannot move it ahead.
at::Tensor start_replicate_all_reduce_kernel(const at::Tensor& token, const std::string& group,
                                             c10::IntArrayRef params) {
  auto runtime = RuntimeTable::instance().get(group);
  const int64_t id = runtime->take_token(token);
  runtime->start_replicate_all_reduce(id);
  return runtime->token_tensor(id, token.options());
}

at::Tensor start_replicate_all_reduce_meta(const at::Tensor& token, const std::string& group,
                                           c10::IntArrayRef params) {
  return at::empty({1}, token.options());
}

void prefetch_next_graph_kernel(at::TensorList shards, at::TensorList after,
                                const std::string& group, int64_t graph_kind,
                                c10::IntArrayRef key, int64_t budget) {
  RuntimeTable::instance().get(group)->prefetch_next_graph(graph_kind, key.vec(), budget);
}

void prefetch_next_graph_meta(at::TensorList shards, at::TensorList after,
                              const std::string& group, int64_t graph_kind,
                              c10::IntArrayRef key, int64_t budget) {}

}  // namespace
}  // namespace sharc

TORCH_LIBRARY_FRAGMENT(sharc, m) {
  m.def("start_gather(Tensor[] shards, str group, int[] params, ScalarType dtype, "
        "int graph_kind=-1) -> Tensor");
  m.def("wait_gather(Tensor token, str group, int[] params, ScalarType dtype) -> Tensor[]");
  m.def("release(Tensor full, Tensor[] after, str group, int param) -> ()");
  m.def("start_reduce_scatter(Tensor[] grads, str group, int[] params) -> Tensor");
  m.def("wait_reduce_scatter(Tensor token, str group, int[] params) -> Tensor[]");
  m.def("start_replicate_all_reduce(Tensor token, str group, int[] params) -> Tensor");
  m.def("prefetch_next_graph(Tensor[] shards, Tensor[] after, str group, int graph_kind, "
        "int[] key, int budget) -> ()");
}

#define SHARC_SCHEDULE_KERNELS(suffix)                                      \
  m.impl("start_gather", sharc::start_gather_##suffix);                    \
  m.impl("wait_gather", sharc::wait_gather_##suffix);                      \
  m.impl("release", sharc::release_##suffix);                              \
  m.impl("start_reduce_scatter", sharc::start_reduce_scatter_##suffix);   \
  m.impl("wait_reduce_scatter", sharc::wait_reduce_scatter_##suffix);      \
  m.impl("start_replicate_all_reduce", sharc::start_replicate_all_reduce_##suffix); \
  m.impl("prefetch_next_graph", sharc::prefetch_next_graph_##suffix);

TORCH_LIBRARY_IMPL(sharc, CPU, m) { SHARC_SCHEDULE_KERNELS(kernel) }
TORCH_LIBRARY_IMPL(sharc, CUDA, m) { SHARC_SCHEDULE_KERNELS(kernel) }
TORCH_LIBRARY_IMPL(sharc, Meta, m) { SHARC_SCHEDULE_KERNELS(meta) }
