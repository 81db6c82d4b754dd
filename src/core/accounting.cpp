#include "sharc/core/accounting.h"

#include <algorithm>

#include "sharc/core/error.h"

namespace sharc {

void MemoryAccounting::add_shard(int64_t bytes) {
  SHARC_CHECK(bytes >= 0, "shard bytes cannot be negative (", bytes, ")");
  stats_.shard_bytes += bytes;
}

void MemoryAccounting::remove_shard(int64_t bytes) {
  SHARC_CHECK(bytes >= 0 && bytes <= stats_.shard_bytes, "sharc accounting: removing ", bytes,
              " shard bytes but only ", stats_.shard_bytes, " are held");
  stats_.shard_bytes -= bytes;
}

void MemoryAccounting::on_gathered(int64_t bytes) {
  SHARC_CHECK(bytes >= 0, "gathered bytes cannot be negative (", bytes, ")");
  stats_.gathered_bytes += bytes;
  stats_.peak_gathered_bytes =
      std::max(stats_.peak_gathered_bytes, stats_.gathered_bytes);
}

void MemoryAccounting::on_freed(int64_t bytes) {
  SHARC_CHECK(bytes >= 0 && bytes <= stats_.gathered_bytes,
              "sharc accounting: freeing ", bytes, " bytes but only ",
              stats_.gathered_bytes, " are gathered");
  stats_.gathered_bytes -= bytes;
}

void MemoryAccounting::on_allgather_sent(int64_t bytes) {
  stats_.allgather_bytes += bytes;
  ++stats_.allgather_calls;
}

void MemoryAccounting::on_reduce_scatter_sent(int64_t bytes) {
  stats_.reduce_scatter_bytes += bytes;
  ++stats_.reduce_scatter_calls;
}

void MemoryAccounting::on_unreduced(int64_t bytes) {
  SHARC_CHECK(stats_.unreduced_grad_bytes + bytes >= 0, "freeing ", -bytes,
              " unreduced gradient bytes, but only ", stats_.unreduced_grad_bytes, " are held");
  stats_.unreduced_grad_bytes += bytes;
}

void MemoryAccounting::on_gather_wait(int64_t ns) { stats_.gather_wait_ns += ns; }

void MemoryAccounting::on_reduce_wait(int64_t ns) { stats_.reduce_wait_ns += ns; }

void MemoryAccounting::on_graph_prefetch() { ++stats_.graph_prefetch_calls; }
void MemoryAccounting::on_late_reduction() { ++stats_.late_reductions; }
void MemoryAccounting::on_late_grad_in_place() { ++stats_.late_grads_in_place; }

void MemoryAccounting::on_header_sent(int64_t bytes) { stats_.header_sent_bytes += bytes; }

void MemoryAccounting::on_agreement_call() { ++stats_.agreement_calls; }

void MemoryAccounting::reset() {
  stats_.gather_wait_ns = 0;
  stats_.reduce_wait_ns = 0;
  stats_.allgather_bytes = 0;
  stats_.reduce_scatter_bytes = 0;
  stats_.allgather_calls = 0;
  stats_.reduce_scatter_calls = 0;
  stats_.graph_prefetch_calls = 0;
  stats_.late_reductions = 0;
  stats_.late_grads_in_place = 0;
  stats_.header_sent_bytes = 0;
  stats_.agreement_calls = 0;
  stats_.peak_gathered_bytes = stats_.gathered_bytes;
}

}  // namespace sharc
