#pragma once
// sharc's pass pipeline: the one place that decides which passes run, in
// which order and with which settings. torch.classes.sharc.Scheduler runs it
// over the bridge's graphs; the unit tests build the same pipeline, so what
// they pin is what ships.

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sharc/compiler/pass.h"
#include "sharc/compiler/pipeline_text.h"
#include "sharc/core/collective_cost.h"

namespace sharc::ir {

/// How the pipeline's passes are configured; the Python CompileConfig fields
/// of the same names are converted once into this struct.
struct PipelineOptions {
  /// bucket_allgathers' cap on the bytes one fused all-gather serves; unset:
  /// chosen from the measured all-gather cost (auto_gather_bucket_bytes).
  std::optional<int64_t> gather_bucket_bytes;
  /// insert_reduce_scatter's cap on the gradient bytes of one bucket; unset:
  /// chosen from the measured reduce-scatter cost (auto_reduce_bucket_bytes).
  std::optional<int64_t> reduce_bucket_bytes;
  /// Passes switched off by name.
  std::vector<std::string> disabled_passes;
  /// The most parameter bytes gathered at once (memory.h); unset: no cap.
  std::optional<int64_t> memory_budget_bytes;
  /// Measured collective costs; unset: not measured.
  std::optional<CollectiveCost> gather_cost;
  std::optional<CollectiveCost> reduce_cost;
  /// Whether selective unsharding may keep parameters gathered: for a
  /// forward graph whose backward will read them again.
  bool keep_for_backward = false;
  /// The parameters (IR ids) selective unsharding may keep: those the
  /// backward reads again; unset: every parameter the graph reads.
  std::optional<std::set<int64_t>> keep_candidates;
  /// Hybrid sharding: the replicate group's size (1: flat sharding), for
  /// insert_replicate_all_reduce.
  int64_t replicas = 1;
};

/// The gather bucket cap when none is set: with a measured cost, the size at
/// which the collective's latency is a tenth of its transfer time
/// (9 x latency / time per byte, so fusing more saves little), between
/// 64 KiB and 64 MiB; without one, 64 KiB.
int64_t auto_gather_bucket_bytes(const std::optional<CollectiveCost>& gather_cost);

/// The reduction bucket cap when none is set: the same rule over the
/// measured reduce-scatter cost, between 1 MiB (each reduction also costs a
/// pass over its gradients on this rank) and 64 MiB; without one, 4 MiB.
int64_t auto_reduce_bucket_bytes(const std::optional<CollectiveCost>& reduce_cost);

/// The shipping pipeline as text (pipeline_text.h), every pass's argument
/// written out: bucket caps chosen from the costs when unset, the budget,
/// the costs, the keep candidates; passes in `disabled_passes` switched off
/// (an unknown name throws sharc::Error listing the passes). Running it
/// (build_pipeline) schedules exactly as make_pipeline(options) does; it is
/// what a dumped schedule records, and what sharc-opt replays.
PipelineSpec shipping_pipeline(const PipelineOptions& options);

/// `given` with each pass's missing arguments taken from the shipping
/// pipeline for `options` (the measured facts): a pipeline written by hand
/// may name only what it changes (`bucket_allgathers{bytes=4096}`).
PipelineSpec complete_pipeline(const PipelineSpec& given, const PipelineOptions& options);

/// A PassManager running `pipeline`'s passes in its order, switched-off
/// ones listed but not run; its final rules cap the gathered bytes at
/// check_memory_budget's budget when it has one.
PassManager build_pipeline(const PipelineSpec& pipeline);

/// build_pipeline(shipping_pipeline(options)): sharc's passes in order: regather_in_backward,
/// cast_before_gather, check_memory_budget, keep_gathered_params,
/// insert_gather_release, bucket_allgathers, prefetch_gathers,
/// insert_reduce_scatter, prefetch_by_cost, place_reduce_waits,
/// insert_replicate_all_reduce, mark_graph_prefetch, annotate_collective_costs.
/// Its input rules are what the
/// bridge's graphs satisfy (structural only); its final rules are a
/// complete schedule's, within the memory budget when one is set.
/// Throws sharc::Error, listing the pass names, if a disabled pass is unknown.
PassManager make_pipeline(const PipelineOptions& options);

/// The smallest memory budget `graph` (as the bridge lowers it) can be
/// scheduled in: its plain schedule's peak, after the passes that fix which
/// parameters are read and in which dtype (regather_in_backward,
/// cast_before_gather).
int64_t smallest_feasible_budget(const Graph& graph);

/// The bytes of the largest parameter `graph` (as the bridge lowers it)
/// reads, in the dtype `pipeline` gathers it in: after regather_in_backward
/// and, when the pipeline runs it, cast_before_gather (a weight gathered in
/// bf16 counts half its fp32 bytes). 0 if it reads none. The unit of the
/// default memory budget on hosts (sharc/_compile/schedule.py), so that a
/// graph gathering narrower parameters is held to a budget as much smaller.
int64_t largest_gathered_param(const Graph& graph, const PipelineSpec& pipeline);

/// The pipeline's pass names, in the order they run.
std::vector<std::string> pipeline_pass_names();

}  // namespace sharc::ir
