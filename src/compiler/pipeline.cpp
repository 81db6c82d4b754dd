#include "sharc/compiler/pipeline.h"

#include <algorithm>
#include <string>

#include "sharc/compiler/pipeline_text.h"

#include "sharc/compiler/passes.h"

namespace sharc::ir {

namespace {

// The size at which a collective's latency is a tenth of its transfer time
// (fusing more saves little), within [smallest, largest]; `unmeasured`
// without a cost, or with one that took no time at all. A cost whose time
// did not grow with the bytes (a link too fast for the sizes timed, as on
// one GPU, where every probe took its launch latency) is all latency: the
// largest bucket. Taking it as unmeasured gave that GPU 64 KiB buckets, a
// collective per parameter, in some runs and 64 MiB in others.
int64_t latency_a_tenth(const std::optional<CollectiveCost>& cost, int64_t smallest,
                        int64_t largest, int64_t unmeasured) {
  if (!cost || (cost->us_per_byte <= 0 && cost->latency_us <= 0)) return unmeasured;
  if (cost->us_per_byte <= 0) return largest;
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

namespace {

void set_int(PassSpec& spec, const std::string& key, std::optional<int64_t> value) {
  spec.args[key] = value ? std::to_string(*value) : "none";
}

void set_cost(PassSpec& spec, const std::string& prefix, const std::optional<CollectiveCost>& c) {
  spec.args[prefix + "_latency_us"] = c ? format_number(c->latency_us) : "none";
  spec.args[prefix + "_us_per_byte"] = c ? format_number(c->us_per_byte) : "none";
}

std::string id_list(const std::optional<std::set<int64_t>>& ids) {
  if (!ids) return "all";
  if (ids->empty()) return "none";
  std::string out;
  for (int64_t id : *ids) out += (out.empty() ? "" : ":") + std::to_string(id);
  return out;
}

}  // namespace

PipelineSpec shipping_pipeline(const PipelineOptions& options) {
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
  const std::optional<int64_t> budget = options.memory_budget_bytes;
  PipelineSpec p = {{"regather_in_backward"},  {"cast_before_gather"},
                    {"check_memory_budget"},   {"keep_gathered_params"},
                    {"insert_gather_release"}, {"bucket_allgathers"},
                    {"prefetch_gathers"},      {"insert_reduce_scatter"},
                    {"prefetch_by_cost"},      {"place_reduce_waits"},
                    {"insert_replicate_all_reduce"},
                    {"mark_graph_prefetch"},   {"annotate_collective_costs"}};
  set_int(p[2], "budget", budget);
  set_int(p[3], "budget", budget);
  set_cost(p[3], "gather", options.keep_for_backward ? options.gather_cost : std::nullopt);
  p[3].args["candidates"] = id_list(options.keep_candidates);
  set_int(p[5], "bytes",
          options.gather_bucket_bytes.value_or(auto_gather_bucket_bytes(options.gather_cost)));
  set_int(p[5], "budget", budget);
  set_int(p[6], "budget", budget);
  set_int(p[7], "bytes",
          options.reduce_bucket_bytes.value_or(auto_reduce_bucket_bytes(options.reduce_cost)));
  set_cost(p[8], "gather", options.gather_cost);
  set_cost(p[8], "reduce", options.reduce_cost);
  set_int(p[8], "budget", budget);
  set_int(p[10], "replicas", options.replicas);
  set_int(p[11], "budget", budget);
  set_cost(p[12], "gather", options.gather_cost);
  set_cost(p[12], "reduce", options.reduce_cost);
  for (PassSpec& spec : p) {
    for (const std::string& off : options.disabled_passes) {
      if (spec.name == off) spec.enabled = false;
    }
  }
  for (const std::string& off : options.disabled_passes) {  // names no pass: say so
    bool known = false;
    for (const PassSpec& spec : p) known = known || spec.name == off;
    if (!known) make_pass({off});
  }
  return p;
}

PipelineSpec complete_pipeline(const PipelineSpec& given, const PipelineOptions& options) {
  const PipelineSpec shipping = shipping_pipeline(options);
  PipelineSpec out = given;
  for (PassSpec& spec : out) {
    for (const PassSpec& ship : shipping) {
      if (ship.name != spec.name) continue;
      for (const auto& [key, value] : ship.args) spec.args.emplace(key, value);
    }
  }
  return out;
}

PassManager build_pipeline(const PipelineSpec& pipeline) {
  VerifyOptions final_rules = VerifyOptions::complete();
  for (const PassSpec& spec : pipeline) {
    // Hybrid sharding: a finished schedule all-reduces every reduction over
    // the replicate group, whether or not the pass that does it is on.
    auto replicas = spec.args.find("replicas");
    if (spec.name == "insert_replicate_all_reduce" && replicas != spec.args.end() &&
        std::stoll(replicas->second) > 1) {
      final_rules.require(Rule::ReplicasReduced);
    }
    if (spec.name != "check_memory_budget" || !spec.enabled) continue;
    auto budget = spec.args.find("budget");
    if (budget != spec.args.end() && budget->second != "none") {
      final_rules.cap_gathered(std::stoll(budget->second));
    }
  }
  PassManager manager(VerifyOptions::structural(), final_rules);
  for (const PassSpec& spec : pipeline) manager.add(make_pass(spec));
  for (const PassSpec& spec : pipeline) {
    if (!spec.enabled) manager.disable(spec.name);
  }
  return manager;
}

PassManager make_pipeline(const PipelineOptions& options) {
  return build_pipeline(shipping_pipeline(options));
}

namespace {

// `graph` reading its parameters the way the pipeline will gather them:
// regather_in_backward's direct reads, narrowed by cast_before_gather
// unless `narrow` is false.
Graph as_gathered(const Graph& graph, bool narrow) {
  Graph read = graph;
  make_regather_in_backward()->run(read);
  if (narrow) make_cast_before_gather()->run(read);
  return read;
}

}  // namespace

int64_t smallest_feasible_budget(const Graph& graph) {
  return plain_schedule_peak(as_gathered(graph, true)).bytes;
}

int64_t largest_gathered_param(const Graph& graph, const PipelineSpec& pipeline) {
  const bool narrow = std::any_of(pipeline.begin(), pipeline.end(), [](const PassSpec& s) {
    return s.name == "cast_before_gather" && s.enabled;
  });
  const Graph read = as_gathered(graph, narrow);
  int64_t largest = 0;
  for (const Node& n : read.nodes) {
    for (const Operand& o : n.operands) {
      if (o.is_param()) largest = std::max(largest, read.params.at(*o.param).bytes);
    }
  }
  return largest;
}

std::vector<std::string> pipeline_pass_names() { return make_pipeline({}).pass_names(); }

}  // namespace sharc::ir
