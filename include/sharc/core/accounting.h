#pragma once
// Exact byte accounting for one runtime (one process group on one rank).
//
// Figures are bytes of tensor storage that the runtime owns or moves, counted
// when it allocates, frees or communicates; nothing is sampled or estimated.
// Communication volume is what this rank sends under a ring algorithm,
// (W - 1) * shard bytes per collective for both all-gather and
// reduce-scatter: the lower bound any algorithm needs, and what the
// communicator's CPU reduce-scatter (an all-to-all) sends.

#include <cstdint>

namespace sharc {

struct MemoryStats {
  int64_t shard_bytes = 0;           ///< this rank's parameter shards
  int64_t gathered_bytes = 0;        ///< full buffers alive now
  int64_t peak_gathered_bytes = 0;   ///< max of gathered_bytes since reset
  int64_t allgather_bytes = 0;       ///< sent by all-gathers since reset
  int64_t reduce_scatter_bytes = 0;  ///< sent by reduce-scatters since reset
  int64_t allgather_calls = 0;       ///< all-gather collectives since reset
  int64_t reduce_scatter_calls = 0;  ///< reduce-scatter collectives since reset
  /// Full gradients held back from reduction (no_sync micro-batches).
  int64_t unreduced_grad_bytes = 0;
  /// Host time blocked waiting for all-gathers / reduce-scatters to finish
  /// since reset: the communication the schedule did not hide. (On CUDA a
  /// wait only orders streams, so this measures host blocking only.)
  int64_t gather_wait_ns = 0;
  int64_t reduce_wait_ns = 0;
  /// Gathers started at the end of a compiled graph for the next one
  /// (cross-graph prefetch) since reset.
  int64_t graph_prefetch_calls = 0;
  /// Reductions compiled backward graphs left in flight behind them, waited
  /// later (see wait_reduce_scatter_in_graph), since reset.
  int64_t late_reductions = 0;
  /// Of their shard gradients, those written straight into the .grad the
  /// engine made of the zeros handed out ([Note: late gradients written in
  /// place]) rather than added into it, since reset.
  int64_t late_grads_in_place = 0;
  /// Collective headers sent since reset (see [Note: collective
  /// agreement]), beside the data counted above.
  int64_t header_sent_bytes = 0;
  /// Collectives issued to agree since reset beyond the schedule's own: header
  /// exchanges (nothing alike expected yet, or verify_schedule) and decoys.
  int64_t agreement_calls = 0;
};

class MemoryAccounting {
 public:
  void add_shard(int64_t bytes);
  void remove_shard(int64_t bytes);  ///< a retired parameter's shard
  void on_gathered(int64_t bytes);
  /// Throws sharc::Error if more bytes are freed than are gathered.
  void on_freed(int64_t bytes);
  void on_allgather_sent(int64_t bytes);
  void on_reduce_scatter_sent(int64_t bytes);
  /// Full gradients kept unreduced grow or shrink by `bytes`.
  void on_unreduced(int64_t bytes);
  void on_gather_wait(int64_t ns);
  void on_reduce_wait(int64_t ns);
  void on_graph_prefetch();
  void on_late_reduction();
  void on_late_grad_in_place();
  void on_header_sent(int64_t bytes);
  void on_agreement_call();
  /// Zeroes the communication counters and sets the peak to the current level.
  void reset();

  const MemoryStats& stats() const { return stats_; }

 private:
  MemoryStats stats_;
};

}  // namespace sharc
