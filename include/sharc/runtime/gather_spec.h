#pragma once
// How one sharded parameter travels, as named tensors and the dtype of each:
//
//   master shard (the user's nn.Parameter, e.g. float32)
//     --cast--> gather input        in gather_dtype (e.g. bfloat16)
//     --all-gather--> padded buffer in gather_dtype, world_size shards long
//     --view--> full parameter      the true shape forward computes with
//
//   full gradient (its uses summed in the wider of gather_dtype and reduce_dtype)
//     --cast--> reduce input        in reduce_dtype
//     --reduce-scatter--> shard gradient
//     --cast--> delivered gradient  in grad_dtype (accumulated into shard.grad)
//
// Casting the shard before the gather sends and holds the smaller dtype's
// bytes; casting is element-wise, so the result equals gather-then-cast bit
// for bit. Each dtype defaults to the master shard's.

#include <string>

#include <c10/core/ScalarType.h>

namespace sharc {

struct GatherSpec {
  c10::ScalarType gather_dtype;  ///< the dtype forward reads the parameter in
  c10::ScalarType reduce_dtype;  ///< the dtype its gradient is summed over ranks in
  c10::ScalarType grad_dtype;    ///< the dtype its shard gradient is delivered in

  /// Everything in the master shard's dtype: no mixed precision.
  static GatherSpec of(c10::ScalarType master) { return {master, master, master}; }

  /// Throws sharc::Error naming `name` unless the spec suits a master shard of
  /// dtype `master`: integer and bool parameters are gathered in their own
  /// dtype; floating ones in a floating dtype no wider than the master, with
  /// gradients reduced and delivered in floating dtypes.
  void check(c10::ScalarType master, const std::string& name) const;
};

}  // namespace sharc
