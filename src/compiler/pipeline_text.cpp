#include "sharc/compiler/pipeline_text.h"

#include <cctype>
#include <charconv>
#include <functional>
#include <optional>
#include <set>

#include "sharc/compiler/passes.h"
#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

// Splits at `sep` outside braces.
std::vector<std::string> split_top(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  for (char c : text) {
    if (c == '{') ++depth;
    if (c == '}') --depth;
    SHARC_CHECK(depth >= 0 && depth <= 1, "sharc pipeline '", text,
                "': braces do not pair (one '{...}' per pass)");
    if (c == sep && depth == 0) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  SHARC_CHECK(depth == 0, "sharc pipeline '", text, "': a '{' is never closed");
  parts.push_back(cur);
  return parts;
}

bool is_name(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

PassSpec parse_pass(const std::string& item) {
  PassSpec spec;
  std::string text = trim(item);
  SHARC_CHECK(!text.empty(), "sharc pipeline: an empty pass (two commas in a row?)");
  if (text[0] == '-') {
    spec.enabled = false;
    text = trim(text.substr(1));
  }
  const size_t brace = text.find('{');
  spec.name = trim(text.substr(0, brace));
  SHARC_CHECK(is_name(spec.name), "sharc pipeline: '", spec.name, "' is not a pass name");
  if (brace == std::string::npos) return spec;
  SHARC_CHECK(text.back() == '}', "sharc pipeline: text after the arguments of '", spec.name,
              "'");
  const std::string inner = text.substr(brace + 1, text.size() - brace - 2);
  if (trim(inner).empty()) return spec;
  for (const std::string& arg : split_top(inner, ',')) {
    const size_t eq = arg.find('=');
    SHARC_CHECK(eq != std::string::npos, "sharc pipeline: argument '", trim(arg), "' of '",
                spec.name, "' is not key=value");
    const std::string key = trim(arg.substr(0, eq)), value = trim(arg.substr(eq + 1));
    SHARC_CHECK(is_name(key) && !value.empty(), "sharc pipeline: bad argument '", trim(arg),
                "' of '", spec.name, "'");
    SHARC_CHECK(spec.args.emplace(key, value).second, "sharc pipeline: '", key,
                "' given twice to '", spec.name, "'");
  }
  return spec;
}

// A pass's arguments, read by type; every argument given must be read.
class Args {
 public:
  explicit Args(const PassSpec& spec) : spec_(spec) {}

  std::optional<int64_t> optional_int(const std::string& key) {
    const std::optional<std::string> v = take(key);
    if (!v || *v == "none") return std::nullopt;
    return parse_int(key, *v);
  }
  int64_t required_int(const std::string& key) {
    const std::optional<int64_t> v = optional_int(key);
    SHARC_CHECK(v.has_value(), "sharc pipeline: pass '", spec_.name, "' needs ", key, "=N");
    return *v;
  }
  // `<prefix>_latency_us` and `<prefix>_us_per_byte`, both or neither.
  std::optional<CollectiveCost> cost(const std::string& prefix) {
    const std::optional<std::string> latency = take(prefix + "_latency_us");
    const std::optional<std::string> per_byte = take(prefix + "_us_per_byte");
    const bool none = (!latency || *latency == "none") && (!per_byte || *per_byte == "none");
    if (none) return std::nullopt;
    SHARC_CHECK(latency && per_byte && *latency != "none" && *per_byte != "none",
                "sharc pipeline: pass '", spec_.name, "' takes ", prefix, "_latency_us and ",
                prefix, "_us_per_byte together");
    return CollectiveCost{parse_double(prefix + "_latency_us", *latency),
                          parse_double(prefix + "_us_per_byte", *per_byte)};
  }
  std::optional<std::set<int64_t>> id_set(const std::string& key) {
    const std::optional<std::string> v = take(key);
    if (!v || *v == "all") return std::nullopt;
    std::set<int64_t> ids;
    if (*v == "none") return ids;
    size_t start = 0;
    while (start <= v->size()) {
      const size_t end = std::min(v->find(':', start), v->size());
      ids.insert(parse_int(key, v->substr(start, end - start)));
      start = end + 1;
    }
    return ids;
  }
  void finish() const {
    for (const auto& [key, value] : spec_.args) {
      SHARC_CHECK(read_.count(key), "sharc pipeline: pass '", spec_.name,
                  "' takes no argument '", key, "'", known());
    }
  }

 private:
  std::optional<std::string> take(const std::string& key) {
    read_.insert(key);
    auto it = spec_.args.find(key);
    if (it == spec_.args.end()) return std::nullopt;
    return it->second;
  }
  std::string known() const {
    if (read_.empty()) return " (it takes none)";
    std::string out = " (its arguments:";
    for (const std::string& k : read_) out += " " + k;
    return out + ")";
  }
  int64_t parse_int(const std::string& key, const std::string& v) const {
    int64_t out = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    SHARC_CHECK(ec == std::errc() && end == v.data() + v.size(), "sharc pipeline: ", key, "=",
                v, " of pass '", spec_.name, "' is not an integer");
    return out;
  }
  double parse_double(const std::string& key, const std::string& v) const {
    double out = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    SHARC_CHECK(ec == std::errc() && end == v.data() + v.size(), "sharc pipeline: ", key, "=",
                v, " of pass '", spec_.name, "' is not a number");
    return out;
  }

  const PassSpec& spec_;
  std::set<std::string> read_;
};

using Factory = std::function<std::unique_ptr<Pass>(Args&)>;

const std::map<std::string, Factory>& factories() {
  static const std::map<std::string, Factory> table = {
      {"regather_in_backward", [](Args&) { return make_regather_in_backward(); }},
      {"cast_before_gather", [](Args&) { return make_cast_before_gather(); }},
      {"check_memory_budget",
       [](Args& a) { return make_check_memory_budget(a.optional_int("budget")); }},
      {"keep_gathered_params",
       [](Args& a) {
         return make_keep_gathered_params(a.optional_int("budget"), a.cost("gather"),
                                          a.id_set("candidates"));
       }},
      {"insert_gather_release", [](Args&) { return make_insert_gather_release(); }},
      {"bucket_allgathers",
       [](Args& a) {
         return make_bucket_allgathers(a.required_int("bytes"), a.optional_int("budget"));
       }},
      {"prefetch_gathers",
       [](Args& a) { return make_prefetch_gathers(a.optional_int("budget")); }},
      {"insert_reduce_scatter",
       [](Args& a) { return make_insert_reduce_scatter(a.required_int("bytes")); }},
      {"prefetch_by_cost",
       [](Args& a) {
         CollectiveCostModel costs{a.cost("gather"), a.cost("reduce")};
         return make_prefetch_by_cost(costs, a.optional_int("budget"));
       }},
      {"place_reduce_waits", [](Args&) { return make_place_reduce_waits(); }},
      {"insert_replicate_all_reduce",
       [](Args& a) { return make_insert_replicate_all_reduce(a.required_int("replicas")); }},
      {"mark_graph_prefetch",
       [](Args& a) { return make_mark_graph_prefetch(a.optional_int("budget")); }},
      {"annotate_collective_costs",
       [](Args& a) {
         return make_annotate_collective_costs(a.cost("gather"), a.cost("reduce"));
       }},
  };
  return table;
}

}  // namespace

PipelineSpec parse_pipeline(const std::string& text) {
  PipelineSpec pipeline;
  if (trim(text).empty()) return pipeline;
  for (const std::string& item : split_top(text, ',')) pipeline.push_back(parse_pass(item));
  return pipeline;
}

std::string print_pipeline(const PipelineSpec& pipeline) {
  std::string out;
  for (const PassSpec& spec : pipeline) {
    if (!out.empty()) out += ",";
    out += (spec.enabled ? "" : "-") + spec.name;
    if (spec.args.empty()) continue;
    std::string args;
    for (const auto& [key, value] : spec.args) args += (args.empty() ? "" : ",") + key + "=" + value;
    out += "{" + args + "}";
  }
  return out;
}

std::unique_ptr<Pass> make_pass(const PassSpec& spec) {
  auto it = factories().find(spec.name);
  if (it == factories().end()) {
    std::string known;
    for (const auto& [name, _] : factories()) known += " " + name;
    throw Error(detail::concat("sharc pipeline: no pass named '", spec.name,
                               "'; passes are:", known));
  }
  Args args(spec);
  std::unique_ptr<Pass> pass = it->second(args);
  args.finish();
  return pass;
}

std::string format_number(double value) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  SHARC_CHECK(ec == std::errc(), "sharc pipeline: cannot print ", value);
  return std::string(buf, end);
}

}  // namespace sharc::ir
