#include <map>
#include <optional>
#include <set>
#include <string>

#include "sharc/compiler/dtype.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// How a graph reads one parameter before gathers are inserted.
struct ParamReads {
  std::vector<size_t> readers;  ///< nodes with the parameter among their operands, in order
  bool pinned = false;          ///< saved as an input, an output, or gathered already
};

// Gathering fp32 and casting the result to bf16 moves twice the bytes that
// casting the shard and gathering bf16 does; both give the same values (a
// cast is element-wise, and a gather only concatenates shards). So a
// parameter whose every read is such a cast is gathered in the cast's dtype.
class CastBeforeGather : public Pass {
 public:
  std::string name() const override { return "cast_before_gather"; }

  // It sees a parameter's reads only while they are direct (`@k` operands).
  Contract contract() const override { return {{}, {}, {}, {Rule::GathersInserted}}; }

  int64_t run(Graph& graph, Analyses&) override {
    const std::map<int64_t, ParamReads> reads = find_reads(graph);
    const std::set<std::string> kept = kept_values(graph);
    std::map<std::string, int64_t> replaced;  // a removed cast's output -> its parameter
    std::set<size_t> removed;
    for (auto& [id, param] : graph.params) {
      const auto r = reads.find(id);
      if (r == reads.end()) continue;
      const std::optional<std::string> to = fused_dtype(graph, param, r->second, kept);
      if (!to) continue;
      narrow(param, *to);
      for (size_t i : r->second.readers) {
        removed.insert(i);
        replaced[graph.nodes[i].outputs[0]] = id;
      }
    }
    if (removed.empty()) return 0;
    remove_casts(graph, removed, replaced);
    return static_cast<int64_t>(removed.size());
  }

 private:
  static std::map<int64_t, ParamReads> find_reads(const Graph& graph) {
    std::map<int64_t, ParamReads> reads;
    for (size_t i = 0; i < graph.nodes.size(); ++i) {
      const Node& n = graph.nodes[i];
      for (const Operand& o : n.operands) {
        if (!o.is_param()) continue;
        ParamReads& r = reads[*o.param];
        if (n.kind == NodeKind::Output) r.pinned = true;
        if (r.readers.empty() || r.readers.back() != i) r.readers.push_back(i);
      }
      // A full parameter saved by forward, or one this graph gathers itself.
      if (n.kind == NodeKind::Input || n.kind == NodeKind::Gather) {
        for (int64_t p : n.params) reads[p].pinned = true;
      }
    }
    return reads;
  }

  // Values read by anything but a compute or a release: a graph output (a
  // gathered value must never leave the graph) or a gradient being reduced.
  // A cast producing one of them stays.
  static std::set<std::string> kept_values(const Graph& graph) {
    std::set<std::string> kept;
    for (const Node& n : graph.nodes) {
      if (n.kind == NodeKind::Compute || n.kind == NodeKind::Release) continue;
      for (const Operand& o : n.operands) {
        if (!o.is_param()) kept.insert(o.value);
      }
    }
    return kept;
  }

  // The dtype to gather `param` in, if every read of it is a cast of it
  // alone to one floating dtype of smaller elements; otherwise some read
  // needs the full value and nothing changes.
  static std::optional<std::string> fused_dtype(const Graph& graph, const Param& param,
                                                const ParamReads& reads,
                                                const std::set<std::string>& kept) {
    if (reads.pinned || reads.readers.empty() || !param.dtype) return std::nullopt;
    const std::optional<std::string> to = graph.nodes[reads.readers.front()].cast;
    if (!to || !narrows(*param.dtype, *to, param.bytes)) return std::nullopt;
    for (size_t i : reads.readers) {
      if (!is_plain_cast(graph.nodes[i], *to, kept)) return std::nullopt;
    }
    return to;
  }

  // `n` reads the parameter; is that read a cast of it alone to `to`?
  static bool is_plain_cast(const Node& n, const std::string& to,
                            const std::set<std::string>& kept) {
    return n.kind == NodeKind::Compute && n.cast == to && n.operands.size() == 1 &&
           n.outputs.size() == 1 && !n.grad_of && !kept.count(n.outputs[0]);
  }

  // Whether `to` is a known floating dtype of smaller elements than `from`,
  // and `bytes` a whole number of `from` elements (so the new size is exact).
  static bool narrows(const std::string& from, const std::string& to, int64_t bytes) {
    const std::optional<DtypeInfo> f = dtype_info(from), t = dtype_info(to);
    return f && t && f->floating && t->floating && t->element_bytes < f->element_bytes &&
           bytes >= 0 && bytes % f->element_bytes == 0;
  }

  static void narrow(Param& param, const std::string& to) {
    const int64_t elements = param.bytes / dtype_info(*param.dtype)->element_bytes;
    param.bytes = elements * dtype_info(to)->element_bytes;
    param.dtype = to;
  }

  // Drops the removed casts; what read a cast's output reads the parameter,
  // now gathered in the cast's dtype, directly. A release that waited for a
  // removed cast stops listing it (a release waits for values, and the cast
  // read nothing but the parameter, so no use of a gathered value went
  // through it).
  static void remove_casts(Graph& graph, const std::set<size_t>& removed,
                           const std::map<std::string, int64_t>& replaced) {
    std::vector<Node> out;
    for (size_t i = 0; i < graph.nodes.size(); ++i) {
      if (removed.count(i)) continue;
      Node& n = graph.nodes[i];
      std::vector<Operand> operands;
      for (Operand& o : n.operands) {
        const auto r = o.is_param() ? replaced.end() : replaced.find(o.value);
        if (r == replaced.end()) {
          operands.push_back(std::move(o));
        } else if (n.kind != NodeKind::Release) {
          operands.push_back(Operand::of_param(r->second));
        }
      }
      n.operands = std::move(operands);
      out.push_back(std::move(n));
    }
    graph.nodes = std::move(out);
  }
};

}  // namespace

std::unique_ptr<Pass> make_cast_before_gather() { return std::make_unique<CastBeforeGather>(); }

}  // namespace sharc::ir
