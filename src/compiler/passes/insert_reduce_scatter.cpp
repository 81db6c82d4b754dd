#include <cstddef>

#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

class InsertReduceScatter : public Pass {
 public:
  explicit InsertReduceScatter(int64_t bucket_bytes) : bucket_bytes_(bucket_bytes) {}

  std::string name() const override { return "insert_reduce_scatter"; }

  int64_t run(Graph& graph, Analyses&) override {
    int64_t buckets = 0;
    std::vector<Node> out;
    Bucket bucket;
    for (Node& n : graph.nodes) {
      const bool is_grad = n.kind == NodeKind::Compute && n.grad_of && n.outputs.size() == 1;
      const int64_t bytes = is_grad ? n.bytes : 0;
      if (is_grad && !bucket.node.params.empty() && bucket.bytes + bytes > bucket_bytes_) {
        flush(out, bucket, buckets);
      }
      out.push_back(std::move(n));
      if (!is_grad) continue;
      const Node& producer = out.back();
      bucket.node.params.push_back(*producer.grad_of);
      bucket.node.operands.push_back(Operand::of_value(producer.outputs[0]));
      bucket.bytes += bytes;
      bucket.insert_at = out.size();  // right after this producer
      if (bucket.bytes >= bucket_bytes_) flush(out, bucket, buckets);
    }
    flush(out, bucket, buckets);
    graph.nodes = std::move(out);
    return buckets;
  }

  Contract contract() const override { return {{}, {Rule::GradientsReduced}, {}}; }

 private:
  struct Bucket {
    Bucket() { node.kind = NodeKind::ReduceScatter; }
    Node node;
    int64_t bytes = 0;
    size_t insert_at = 0;  ///< position right after the last member's producer
  };

  // The bucket's reduce_scatter goes in, its token named after its first
  // parameter (each gradient is reduced once, so the name is unique).
  static void flush(std::vector<Node>& out, Bucket& bucket, int64_t& buckets) {
    if (bucket.node.params.empty()) return;
    bucket.node.outputs = {"sharc_reduce_" + std::to_string(bucket.node.params[0])};
    out.insert(out.begin() + static_cast<std::ptrdiff_t>(bucket.insert_at),
               std::move(bucket.node));
    bucket = Bucket();
    ++buckets;
  }

  int64_t bucket_bytes_;
};

}  // namespace

std::unique_ptr<Pass> make_insert_reduce_scatter(int64_t bucket_bytes) {
  return std::make_unique<InsertReduceScatter>(bucket_bytes);
}

}  // namespace sharc::ir
