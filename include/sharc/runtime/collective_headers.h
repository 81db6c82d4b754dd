#pragma once
// Collective headers (see [Note: collective agreement] in
// sharc/core/collective_agreement.h) written into and read out of the
// tensors a collective sends and delivers.
//
// An all-gather delivers each rank's bytes as they were sent, so its header
// travels exactly: kHeaderBytes at the end of what each rank sends, in
// whatever dtype that is. A reduction sums what the ranks send, so its
// header travels as CollectiveHeader::kBits columns of 0 or 1 at the end of
// every rank's row, and arrives as the number of ranks that set each bit.

#include <vector>

#include <ATen/core/Tensor.h>

#include "sharc/core/collective_agreement.h"
#include "sharc/runtime/communicator.h"

namespace sharc {

/// Bytes of an exact header.
constexpr int64_t kHeaderBytes = CollectiveHeader::kWords * 8;

/// Elements of `dtype` that hold an exact header (at least kHeaderBytes).
int64_t header_elements(c10::ScalarType dtype);

/// Writes `header` into `tail` (header_elements(dtype) elements, contiguous).
void write_header(at::Tensor tail, const CollectiveHeader& header);

/// The header bytes (world x kHeaderBytes, on `gathered`'s device) in the
/// last header_elements(dtype) of each of `world` rows of `gathered` (flat,
/// world * row elements).
at::Tensor header_rows(const at::Tensor& gathered, int64_t world);

/// The headers in header_rows() read back to the host (waits for them).
std::vector<CollectiveHeader> read_headers(const at::Tensor& gathered, int64_t world);

/// The headers in `rows`, header_rows() on the host.
std::vector<CollectiveHeader> parse_headers(const at::Tensor& rows);

/// Every rank's header, exchanged in one small all-gather on `device`
/// (blocking): world_size x CollectiveHeader::kWords words on the host.
at::Tensor exchange_header_rows(Communicator& comm, const CollectiveHeader& mine,
                                c10::Device device);

/// The headers in exchange_header_rows()' rows.
std::vector<CollectiveHeader> headers_of_rows(const at::Tensor& rows);

/// Writes `header`'s bits into `columns` (rows x kBits), every row alike.
void write_header_bits(at::Tensor columns, const CollectiveHeader& header);

/// Per-bit counts of ranks from `summed` (kBits elements, the sum of every
/// rank's bits). Reads back to the host (waits for them).
std::vector<int64_t> read_header_bits(const at::Tensor& summed);

/// As read_header_bits(), from the sums already on the host.
std::vector<int64_t> parse_header_bits(const at::Tensor& sums);

}  // namespace sharc
