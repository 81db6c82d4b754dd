#pragma once
// The last step of a reduce-scatter on the host: the W rows that arrived
// summed, averaged, and written where the shard gradient goes.

#include <ATen/core/Tensor.h>

namespace sharc {

/// out[j] = (rows[0][j] + ... + rows[R-1][j]) / divisor, in one pass over
/// `rows` ([R, n]) into `out` ([n], overwritten). On the host, for a
/// floating `out` of the rows' dtype, summed in the dtype's arithmetic type
/// (float for the 16-bit types) and rounded once; elsewhere ATen's sum,
/// division and copy (a cast where the dtypes differ).
void sum_rows_divided(at::Tensor& out, const at::Tensor& rows, int64_t divisor);

}  // namespace sharc
