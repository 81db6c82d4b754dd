#include <map>
#include <optional>
#include <set>
#include <string>

#include "sharc/compiler/memory.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// A gather immediately followed by its wait, as insert_gather_release emits.
bool is_gather_pair(const Graph& graph, size_t i) {
  if (i + 1 >= graph.nodes.size()) return false;
  const Node& gather = graph.nodes[i];
  const Node& wait = graph.nodes[i + 1];
  return gather.kind == NodeKind::Gather && gather.outputs.size() == 1 &&
         wait.kind == NodeKind::Wait && wait.operands.size() == 1 &&
         wait.operands[0].value == gather.outputs[0];
}

class BucketAllGathers : public Pass {
  int64_t cap_used_ = 0;
  int64_t buckets_ = 0;

 public:
  BucketAllGathers(int64_t bucket_bytes, std::optional<int64_t> budget)
      : bucket_bytes_(bucket_bytes), budget_(budget) {}

  std::string name() const override { return "bucket_allgathers"; }

  // Only adjacent gather/wait pairs are fused; on a graph whose gathers were
  // moved away from their waits it would quietly bucket nothing.
  Contract contract() const override { return {{Rule::WaitsFollowGathers}, {}, {}}; }

  // Walks the gathers in program order. Each one joins the open bucket of its
  // dtype if it fits (moving it up to the bucket's position: a gather reads
  // nothing but its shards, so it may run earlier, at the cost of its bytes
  // living longer), otherwise it opens the next bucket of its dtype. One
  // bucket per dtype stays open because one collective carries one dtype,
  // and under autocast a block's gathers alternate between dtypes (a
  // LayerNorm's fp32 weights, then a Linear's weights cast to bf16 before
  // the gather): with a single open bucket each change of dtype closed it,
  // four collectives per transformer block where two carry the same bytes.
  // Under a memory budget, the cap halves until the bucketed schedule fits
  // (a bucket keeps its later members, and a staging buffer, alive early).
  int64_t run(Graph& graph, Analyses&) override {
    for (int64_t cap = bucket_bytes_;; cap /= 2) {
      Graph bucketed = graph;
      const int64_t rewrites = bucket(bucketed, cap);
      if (!budget_ || rewrites == 0 || peak_gathered(bucketed).bytes <= *budget_) {
        graph = std::move(bucketed);
        cap_used_ = cap;
        buckets_ = 0;
        for (const Node& n : graph.nodes) buckets_ += n.kind == NodeKind::Gather;
        return rewrites;
      }
    }
  }

  // The cap the budget left (bucket_bytes halved until the schedule fit)
  // and the gathers (collectives) the graph issues.
  std::map<std::string, int64_t> statistics() const override {
    return {{"cap_bytes", cap_used_}, {"buckets", buckets_}};
  }

 private:
  int64_t bucket(Graph& graph, int64_t cap) const {
    int64_t rewrites = 0;
    std::vector<Node> out;
    std::map<std::optional<std::string>, Bucket> open;  ///< by dtype (unset: unknown)
    for (size_t i = 0; i < graph.nodes.size(); ++i) {
      if (!is_gather_pair(graph, i)) {
        Node& n = graph.nodes[i];
        if (n.kind == NodeKind::Gather || n.kind == NodeKind::Wait) open.clear();
        out.push_back(std::move(n));
        continue;
      }
      Node& gather = graph.nodes[i];
      Node& wait = graph.nodes[++i];
      const int64_t bytes = bytes_of(graph, gather);
      const std::optional<std::string> dtype = dtype_of(graph, gather);
      Bucket& bucket = open[dtype];
      if (bucket.fits(gather, bytes, cap)) {
        bucket.join(out, gather, wait, bytes);
        ++rewrites;
        continue;
      }
      bucket = Bucket{out.size(), bytes, {gather.params.begin(), gather.params.end()}, true};
      out.push_back(std::move(gather));
      out.push_back(std::move(wait));
    }
    graph.nodes = std::move(out);
    return rewrites;
  }

  struct Bucket {
    size_t gather_at = 0;  ///< index in the output; its wait follows
    int64_t bytes = 0;
    std::set<int64_t> params;
    bool active = false;

    bool fits(const Node& gather, int64_t more, int64_t cap) const {
      if (!active || bytes + more > cap) return false;
      // A parameter gathered again after its release opens a new bucket.
      for (int64_t p : gather.params) {
        if (params.count(p)) return false;
      }
      return true;
    }

    void join(std::vector<Node>& out, Node& gather, Node& wait, int64_t more) {
      Node& bucket_gather = out[gather_at];
      Node& bucket_wait = out[gather_at + 1];
      for (int64_t p : gather.params) {
        bucket_gather.params.push_back(p);
        params.insert(p);
      }
      for (std::string& v : wait.outputs) bucket_wait.outputs.push_back(std::move(v));
      bytes += more;
    }
  };

  static int64_t bytes_of(const Graph& graph, const Node& gather) {
    int64_t total = 0;
    for (int64_t p : gather.params) total += graph.params.at(p).bytes;
    return total;
  }

  // A gather's parameters share one dtype (the verifier checks it).
  static std::optional<std::string> dtype_of(const Graph& graph, const Node& gather) {
    if (gather.params.empty()) return std::nullopt;
    return graph.params.at(gather.params[0]).dtype;
  }

  int64_t bucket_bytes_;
  std::optional<int64_t> budget_;
};

}  // namespace

std::unique_ptr<Pass> make_bucket_allgathers(int64_t bucket_bytes,
                                             std::optional<int64_t> budget_bytes) {
  return std::make_unique<BucketAllGathers>(bucket_bytes, budget_bytes);
}

}  // namespace sharc::ir
