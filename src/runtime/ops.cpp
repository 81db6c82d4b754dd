// torch.ops.sharc.*: schemas, device kernels, meta kernels and autograd, side
// by side.
//
//   gather(shard, shape, group, param) -> full
//       Blocking all-gather of one parameter in its gather dtype (the shard
//       cast first, see GatherSpec); takes one hold on its buffer and returns
//       the true-shape full tensor (an alias of the runtime's buffer). Its
//       gradient is reduced asynchronously, in buckets (eager_reduction.h).
//   all_gather(shard, shape, group, param) -> full
//       The functional form captured by torch.compile, in the master dtype:
//       the full tensor is a copy of its own, so any compiler may treat it as
//       an ordinary value (a cast that follows is a compute node the
//       cast_before_gather pass may fold into the gather).
//       sharc's backend replaces it with start_gather / wait_gather / release
//       (schedule_ops.cpp) placed by its passes. Gradient: reduce_scatter.
//   reduce_scatter(grad, group, param) -> shard_grad
//       Sum over the group in the reduce dtype, divided by the world size,
//       this rank's flat slice in the grad dtype.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "sharc/runtime/runtime_table.h"

namespace sharc {
namespace {

at::Tensor gather_kernel(const at::Tensor& shard, c10::IntArrayRef shape,
                         const std::string& group, int64_t param) {
  (void)shape;
  auto runtime = RuntimeTable::instance().get(group);
  runtime->check_shard(param, shard);  // the runtime gathers its registered shard
  // A forward read: the eager prefetch may start this module's group and
  // the next (see [Note: eager prefetch]).
  runtime->eager_prefetch().on_forward_gather(param);
  return runtime->gather(param);
}

at::Tensor all_gather_kernel(const at::Tensor& shard, c10::IntArrayRef shape,
                             const std::string& group, int64_t param) {
  auto runtime = RuntimeTable::instance().get(group);
  runtime->check_shard(param, shard);
  return runtime->read_full(param);
}

at::Tensor gather_meta(const at::Tensor& shard, c10::IntArrayRef shape,
                       const std::string& group, int64_t param) {
  const GatherSpec spec = RuntimeTable::instance().get(group)->spec(param);
  return at::empty(shape, shard.options().device(c10::kMeta).dtype(spec.gather_dtype));
}

at::Tensor all_gather_meta(const at::Tensor& shard, c10::IntArrayRef shape,
                           const std::string& group, int64_t param) {
  return at::empty(shape, shard.options().device(c10::kMeta));
}

at::Tensor reduce_scatter_kernel(const at::Tensor& grad, const std::string& group,
                                 int64_t param) {
  return RuntimeTable::instance().get(group)->reduce_scatter(param, grad);
}

at::Tensor reduce_scatter_meta(const at::Tensor& grad, const std::string& group,
                               int64_t param) {
  auto runtime = RuntimeTable::instance().get(group);
  return at::empty({runtime->layout(param).shard_numel()},
                   grad.options().device(c10::kMeta).dtype(runtime->spec(param).grad_dtype));
}

at::Tensor call_reduce_scatter(const at::Tensor& grad, const std::string& group,
                               int64_t param) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("sharc::reduce_scatter", "")
                       .typed<decltype(reduce_scatter_kernel)>();
  return op.call(grad, group, param);
}

// d(full)/d(shard) for both gathers: the full gradient, summed over ranks and
// averaged, lands in the owning rank's shard; autograd accumulates it into
// shard.grad. `OpName` names the forward operator to call below autograd.
template <const char* OpName>
class GatherFunction : public torch::autograd::Function<GatherFunction<OpName>> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx,
                            const at::Tensor& shard, c10::IntArrayRef shape,
                            const std::string& group, int64_t param) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["param"] = param;
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow(OpName, "")
                         .typed<decltype(gather_kernel)>();
    return op.call(shard, shape, group, param);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const std::string group = ctx->saved_data["group"].toStringRef();
    const int64_t param = ctx->saved_data["param"].toInt();
    // A sparse gradient (nn.Embedding(sparse=True)) is reduced dense: the
    // shard and its optimizer state are dense.
    const at::Tensor& grad = grads[0];
    at::Tensor shard_grad =
        call_reduce_scatter(grad.defined() && grad.is_sparse() ? grad.to_dense() : grad, group,
                            param);
    return {shard_grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

constexpr char kGather[] = "sharc::gather";
constexpr char kAllGather[] = "sharc::all_gather";

// A gathered value a compiled graph returns to its caller (escaping.py): a
// copy with storage of its own, an op no compiler pass may fold away.
at::Tensor escaping_copy(const at::Tensor& full) {
  return full.clone(at::MemoryFormat::Contiguous);
}

// The autograd engine casts every gradient reaching the gathered value to
// its input metadata's grad_dtype (by default the value's own dtype) before
// summing the value's uses and calling backward(). For a bf16 value that
// rounds an fp32 gradient (a custom autograd.Function's), although the
// reduction and the shard's grad_dtype are fp32; plain torch casts to the
// leaf's grad_dtype instead. So the uses are summed in the wider of the
// gathered dtype and the reduce dtype, which the reduction casts to anyway.
void sum_gradients_in_reduce_dtype(const at::Tensor& full, c10::ScalarType reduce) {
  const auto& node = full.grad_fn();
  if (!node) return;  // frozen: no gradient
  node->mutable_input_metadata(full.output_nr())
      .set_grad_dtype(c10::promoteTypes(full.scalar_type(), reduce));
}

at::Tensor all_gather_autograd(const at::Tensor& shard, c10::IntArrayRef shape,
                               const std::string& group, int64_t param) {
  at::Tensor full = GatherFunction<kAllGather>::apply(shard, shape, group, param);
  if (full.grad_fn()) {
    sum_gradients_in_reduce_dtype(full,
                                  RuntimeTable::instance().get(group)->spec(param).reduce_dtype);
  }
  return full;
}

// The eager gather: its gradient is reduced asynchronously, in buckets,
// and reaches the shard through a wait node (see [Note: eager reduction]).
at::Tensor gather_autograd(const at::Tensor& shard, c10::IntArrayRef shape,
                           const std::string& group, int64_t param) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kGather, "")
                       .typed<decltype(gather_kernel)>();
  at::Tensor full;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    full = op.call(shard, shape, group, param);
  }
  if (at::GradMode::is_enabled() && shard.requires_grad()) {
    auto runtime = RuntimeTable::instance().get(group);
    const c10::ScalarType reduce = runtime->spec(param).reduce_dtype;
    runtime->eager_reduction().connect(full, shard, param, reduce, runtime);
    sum_gradients_in_reduce_dtype(full, reduce);
  }
  return full;
}

}  // namespace
}  // namespace sharc

TORCH_LIBRARY(sharc, m) {
  m.def("gather(Tensor shard, int[] shape, str group, int param) -> Tensor");
  m.def("all_gather(Tensor shard, int[] shape, str group, int param) -> Tensor");
  m.def("reduce_scatter(Tensor grad, str group, int param) -> Tensor");
  m.def("escaping_copy(Tensor full) -> Tensor");
}

TORCH_LIBRARY_IMPL(sharc, CompositeExplicitAutograd, m) {
  m.impl("escaping_copy", sharc::escaping_copy);
}

TORCH_LIBRARY_IMPL(sharc, CPU, m) {
  m.impl("gather", sharc::gather_kernel);
  m.impl("all_gather", sharc::all_gather_kernel);
  m.impl("reduce_scatter", sharc::reduce_scatter_kernel);
}

TORCH_LIBRARY_IMPL(sharc, CUDA, m) {
  m.impl("gather", sharc::gather_kernel);
  m.impl("all_gather", sharc::all_gather_kernel);
  m.impl("reduce_scatter", sharc::reduce_scatter_kernel);
}

TORCH_LIBRARY_IMPL(sharc, Meta, m) {
  m.impl("gather", sharc::gather_meta);
  m.impl("all_gather", sharc::all_gather_meta);
  m.impl("reduce_scatter", sharc::reduce_scatter_meta);
}

TORCH_LIBRARY_IMPL(sharc, Autograd, m) {
  m.impl("gather", sharc::gather_autograd);
  m.impl("all_gather", sharc::all_gather_autograd);
}
