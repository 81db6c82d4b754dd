#include "sharc/compiler/pipeline.h"

#include <algorithm>

#include "sharc/compiler/passes.h"

namespace sharc::ir {

namespace {

// The size at which a collective's latency is a tenth of its transfer time
// (fusing more saves little), within [smallest, largest]; `unmeasured`
// without a cost.
int64_t latency_a_tenth(const std::optional<CollectiveCost>& cost, int64_t smallest,
                        int64_t largest, int64_t unmeasured) {
  if (!cost || cost->us_per_byte <= 0) return unmeasured;
  const double bytes = 9.0 * cost->latency_us / cost->us_per_byte;
  return std::clamp<int64_t>(static_cast<int64_t>(std::min(bytes, 1e18)), smallest, largest);
}

}  // namespace

int64_t auto_gather_bucket_bytes(const std::optional<CollectiveCost>& gather_cost) {
  return latency_a_tenth(gather_cost, 64 << 10, 64 << 20, 64 << 10);
}

int64_t auto_reduce_bucket_bytes(const std::optional<CollectiveCost>& reduce_cost) {
  return latency_a_tenth(reduce_cost, 1 << 20, 64 << 20, 4 << 20);
}

PassManager make_pipeline(const PipelineOptions& options) {
  VerifyOptions final_rules = VerifyOptions::complete();
  if (options.memory_budget_bytes) final_rules.cap_gathered(*options.memory_budget_bytes);
  PassManager manager(VerifyOptions::structural(), final_rules);
  const std::optional<int64_t> budget = options.memory_budget_bytes;
  const int64_t bucket_cap =
      options.gather_bucket_bytes.value_or(auto_gather_bucket_bytes(options.gather_cost));
  // Re-gather comes first so the saved parameters it turns into direct reads
  // get their gathers from insertion; casting before the gather looks at
  // direct reads only, so it runs after re-gather (whose reads it sees) and
  // before insertion (which gathers in the dtype it chose); the budget is
  // checked, and parameters kept within it, on those dtypes' bytes, before
  // insertion serves the direct reads they look at; bucketing needs
  // each gather still next to its wait, which prefetching undoes, so it runs
  // before prefetching. Prefetching by cost comes once every reduction is
  // in: it must see every collective, whose order it keeps (one bucket
  // ahead, the order prefetch_gathers and insert_reduce_scatter fix, is the
  // same on every rank; the compute costs it reads are not). Waits on
  // reductions are placed once every reduction is in, since each goes
  // right after the next one starts.
  manager.add(make_regather_in_backward())
      .add(make_cast_before_gather())
      .add(make_check_memory_budget(budget))
      .add(make_keep_gathered_params(budget, options.keep_for_backward
                                                 ? options.gather_cost
                                                 : std::optional<CollectiveCost>(),
                                     options.keep_candidates))
      .add(make_insert_gather_release())
      .add(make_bucket_allgathers(bucket_cap, budget))
      .add(make_prefetch_gathers(budget))
      .add(make_insert_reduce_scatter(
          options.reduce_bucket_bytes.value_or(auto_reduce_bucket_bytes(options.reduce_cost))))
      .add(make_prefetch_by_cost({options.gather_cost, options.reduce_cost}, budget))
      .add(make_place_reduce_waits())
      .add(make_mark_graph_prefetch(budget))
      .add(make_annotate_collective_costs(options.gather_cost, options.reduce_cost));
  for (const std::string& name : options.disabled_passes) manager.disable(name);
  return manager;
}

int64_t smallest_feasible_budget(const Graph& graph) {
  Graph read = graph;
  make_regather_in_backward()->run(read);
  make_cast_before_gather()->run(read);
  return plain_schedule_peak(read).bytes;
}

std::vector<std::string> pipeline_pass_names() { return make_pipeline({}).pass_names(); }

}  // namespace sharc::ir
