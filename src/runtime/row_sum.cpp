#include "sharc/runtime/row_sum.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "sharc/core/error.h"

namespace sharc {
namespace {

// Elements per block: the accumulators stay in registers or L1, and each
// row is read as a contiguous run the compiler vectorizes.
constexpr int64_t kBlock = 512;
// Elements per thread's share, where ATen runs more than one.
constexpr int64_t kGrain = 32768;

template <typename scalar_t>
void sum_rows_kernel(scalar_t* out, const scalar_t* rows, int64_t row_stride, int64_t count,
                     int64_t n, int64_t divisor) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t by = static_cast<acc_t>(divisor);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    acc_t acc[kBlock];
    for (int64_t start = begin; start < end; start += kBlock) {
      const int64_t len = std::min(kBlock, end - start);
      const scalar_t* first = rows + start;
      for (int64_t k = 0; k < len; ++k) acc[k] = static_cast<acc_t>(first[k]);
      for (int64_t r = 1; r < count; ++r) {
        const scalar_t* row = rows + r * row_stride + start;
        for (int64_t k = 0; k < len; ++k) acc[k] += static_cast<acc_t>(row[k]);
      }
      scalar_t* dst = out + start;
      for (int64_t k = 0; k < len; ++k) dst[k] = static_cast<scalar_t>(acc[k] / by);
    }
  });
}

}  // namespace

void sum_rows_divided(at::Tensor& out, const at::Tensor& rows, int64_t divisor) {
  SHARC_CHECK(rows.dim() == 2 && out.dim() == 1 && rows.size(1) == out.size(0),
              "sharc: summing rows of shape ", rows.sizes(), " into ", out.sizes());
  const bool direct = out.is_cpu() && rows.is_cpu() && out.scalar_type() == rows.scalar_type() &&
                      at::isFloatingType(out.scalar_type()) && out.is_contiguous() &&
                      rows.size(1) > 0 && rows.stride(1) == 1 && rows.size(0) > 0;
  if (!direct) {
    if (out.numel() > 0) out.copy_(rows.sum(0).div_(divisor));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sharc_sum_rows",
                                  [&] {
                                    sum_rows_kernel<scalar_t>(
                                        out.data_ptr<scalar_t>(), rows.const_data_ptr<scalar_t>(),
                                        rows.stride(0), rows.size(0), rows.size(1), divisor);
                                  });
}

}  // namespace sharc
