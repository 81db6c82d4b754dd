#include "sharc/runtime/collective_headers.h"

#include <cmath>

#include <ATen/ATen.h>

namespace sharc {

int64_t header_elements(c10::ScalarType dtype) {
  const int64_t size = static_cast<int64_t>(c10::elementSize(dtype));
  return (kHeaderBytes + size - 1) / size;
}

namespace {

// A host tensor to copy into `target`'s device: pinned there, so that the
// copy is queued on the stream instead of making the host wait for it (a
// copy from pageable memory waits for everything queued before it).
at::Tensor host_staging(at::IntArrayRef sizes, at::ScalarType dtype, const at::Tensor& target) {
  return at::empty(sizes, at::TensorOptions(dtype).pinned_memory(!target.is_cpu()));
}

}  // namespace

void write_header(at::Tensor tail, const CollectiveHeader& header) {
  const auto words = header.words();
  at::Tensor host = host_staging({CollectiveHeader::kWords}, at::kLong, tail);
  std::copy(words.begin(), words.end(), host.mutable_data_ptr<int64_t>());
  // Bytes, not values: any dtype carries them, and all-gathers move bytes.
  at::Tensor bytes = tail.view(at::kByte).narrow(0, 0, kHeaderBytes);
  bytes.copy_(host.view(at::kByte), /*non_blocking=*/!tail.is_cpu());
}

at::Tensor header_rows(const at::Tensor& gathered, int64_t world) {
  const int64_t elements = header_elements(gathered.scalar_type());
  at::Tensor tails = gathered.view({world, -1}).narrow(1, gathered.numel() / world - elements,
                                                       elements);
  return tails.contiguous().view(at::kByte).view({world, -1}).narrow(1, 0, kHeaderBytes);
}

std::vector<CollectiveHeader> read_headers(const at::Tensor& gathered, int64_t world) {
  return parse_headers(header_rows(gathered, world).to(at::kCPU));
}

std::vector<CollectiveHeader> parse_headers(const at::Tensor& rows) {
  at::Tensor host = rows.contiguous();
  const int64_t world = host.size(0);
  std::vector<CollectiveHeader> headers;
  for (int64_t r = 0; r < world; ++r) {
    int64_t words[CollectiveHeader::kWords];
    std::memcpy(words, host[r].const_data_ptr<uint8_t>(), kHeaderBytes);
    headers.push_back(CollectiveHeader::from_words(words));
  }
  return headers;
}

at::Tensor exchange_header_rows(Communicator& comm, const CollectiveHeader& mine,
                                c10::Device device) {
  const int64_t world = comm.world_size();
  const auto words = mine.words();
  at::Tensor here =
      at::tensor(c10::ArrayRef<int64_t>(words.data(), words.size()), at::kLong).to(device);
  at::Tensor all = at::empty({world * CollectiveHeader::kWords}, here.options());
  wait_and_release(comm.all_gather(all, here));
  return all.view({world, CollectiveHeader::kWords}).cpu();
}

std::vector<CollectiveHeader> headers_of_rows(const at::Tensor& rows) {
  std::vector<CollectiveHeader> headers;
  for (int64_t r = 0; r < rows.size(0); ++r) {
    headers.push_back(CollectiveHeader::from_words(rows[r].const_data_ptr<int64_t>()));
  }
  return headers;
}

void write_header_bits(at::Tensor columns, const CollectiveHeader& header) {
  const auto bits = header.bits();
  at::Tensor values = at::empty(columns.sizes(), at::kFloat);
  float* out = values.mutable_data_ptr<float>();
  for (int64_t r = 0; r < columns.size(0); ++r) {
    for (int i = 0; i < CollectiveHeader::kBits; ++i) *out++ = bits[i];
  }
  // Every row and the cast made on the host, into pinned memory: one queued
  // copy reaches the device.
  at::Tensor host = host_staging(columns.sizes(), columns.scalar_type(), columns);
  host.copy_(values);
  columns.copy_(host, /*non_blocking=*/!columns.is_cpu());
}

std::vector<int64_t> read_header_bits(const at::Tensor& summed) {
  return parse_header_bits(summed.to(at::kCPU));
}

std::vector<int64_t> parse_header_bits(const at::Tensor& sums) {
  at::Tensor host = sums.to(at::kDouble).contiguous();
  const double* in = host.const_data_ptr<double>();
  std::vector<int64_t> counts;
  for (int64_t i = 0; i < host.numel(); ++i) counts.push_back(std::llround(in[i]));
  return counts;
}

}  // namespace sharc
