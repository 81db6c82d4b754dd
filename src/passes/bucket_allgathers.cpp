#include "sharc/passes.h"

namespace sharc::ir {
namespace {

bool is_comm_prologue(const Node& n) {
  return n.kind == NodeKind::Gather || n.kind == NodeKind::Wait;
}

class BucketAllGathers : public Pass {
 public:
  explicit BucketAllGathers(int64_t bucket_bytes) : bucket_bytes_(bucket_bytes) {}

  std::string name() const override { return "bucket_allgathers"; }

  int64_t run(Graph& graph) override {
    int64_t rewrites = 0;
    std::vector<Node> out;
    size_t i = 0;
    while (i < graph.nodes.size()) {
      if (!is_comm_prologue(graph.nodes[i])) {
        out.push_back(std::move(graph.nodes[i++]));
        continue;
      }
      size_t end = i;
      while (end < graph.nodes.size() && is_comm_prologue(graph.nodes[end])) ++end;
      rewrites += fuse_run(graph, i, end, out);
      i = end;
    }
    graph.nodes = std::move(out);
    return rewrites;
  }

 private:
  struct Pair {
    Node gather;
    Node wait;
  };

  // Pairs each gather in [begin, end) with its wait; anything unpaired (a
  // gather waited later, a wait of an earlier gather) is left as it is.
  static std::vector<Pair> pair_up(Graph& graph, size_t begin, size_t end,
                                   std::vector<Node>& unpaired) {
    std::vector<Pair> pairs;
    std::vector<bool> used(end - begin, false);
    for (size_t g = begin; g < end; ++g) {
      Node& gather = graph.nodes[g];
      if (gather.kind != NodeKind::Gather || gather.outputs.size() != 1) continue;
      for (size_t w = g + 1; w < end; ++w) {
        Node& wait = graph.nodes[w];
        if (!used[w - begin] && wait.kind == NodeKind::Wait && !wait.operands.empty() &&
            wait.operands[0].value == gather.outputs[0]) {
          used[g - begin] = used[w - begin] = true;
          pairs.push_back({std::move(gather), std::move(wait)});
          break;
        }
      }
    }
    for (size_t k = begin; k < end; ++k) {
      if (!used[k - begin]) unpaired.push_back(std::move(graph.nodes[k]));
    }
    return pairs;
  }

  int64_t bytes_of(const Graph& graph, const Node& gather) const {
    int64_t total = 0;
    for (int64_t p : gather.params) total += graph.params.at(p).bytes;
    return total;
  }

  int64_t fuse_run(Graph& graph, size_t begin, size_t end, std::vector<Node>& out) const {
    std::vector<Node> unpaired;
    std::vector<Pair> pairs = pair_up(graph, begin, end, unpaired);
    for (Node& n : unpaired) out.push_back(std::move(n));
    int64_t rewrites = 0;
    size_t k = 0;
    while (k < pairs.size()) {
      Pair bucket = std::move(pairs[k++]);
      int64_t bytes = bytes_of(graph, bucket.gather);
      while (k < pairs.size() && bytes + bytes_of(graph, pairs[k].gather) <= bucket_bytes_) {
        bytes += bytes_of(graph, pairs[k].gather);
        append(bucket, pairs[k++]);
        ++rewrites;
      }
      out.push_back(std::move(bucket.gather));
      out.push_back(std::move(bucket.wait));
    }
    return rewrites;
  }

  static void append(Pair& bucket, Pair& next) {
    for (int64_t p : next.gather.params) bucket.gather.params.push_back(p);
    for (std::string& v : next.wait.outputs) bucket.wait.outputs.push_back(std::move(v));
  }

  int64_t bucket_bytes_;
};

}  // namespace

std::unique_ptr<Pass> make_bucket_allgathers(int64_t bucket_bytes) {
  return std::make_unique<BucketAllGathers>(bucket_bytes);
}

}  // namespace sharc::ir
