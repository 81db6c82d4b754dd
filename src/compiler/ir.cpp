#include "sharc/compiler/ir.h"

#include <algorithm>
#include <cctype>
#include <sstream>

#include "sharc/compiler/dtype.h"
#include "sharc/core/error.h"

namespace sharc::ir {

const char* to_string(NodeKind kind) {
  switch (kind) {
    case NodeKind::Input: return "input";
    case NodeKind::Compute: return "compute";
    case NodeKind::Gather: return "gather";
    case NodeKind::Wait: return "wait";
    case NodeKind::Release: return "release";
    case NodeKind::ReduceScatter: return "reduce_scatter";
    case NodeKind::WaitReduce: return "wait_reduce";
    case NodeKind::PrefetchNext: return "prefetch_next";
    case NodeKind::Output: return "output";
    case NodeKind::AllReduce: return "all_reduce";
  }
  return "unknown";
}

const char* to_string(Rule rule) {
  switch (rule) {
    case Rule::NoSavedParams: return "no saved full parameters";
    case Rule::GathersInserted: return "gathers inserted";
    case Rule::WaitsFollowGathers: return "each wait right after its gather";
    case Rule::GradientsReduced: return "gradients reduced";
    case Rule::ReductionsWaited: return "reductions waited";
    case Rule::ReplicasReduced: return "replicas reduced";
    case Rule::WithinBudget: return "within the memory budget";
  }
  return "unknown";
}

int64_t Graph::value_bytes(const std::string& value) const {
  for (const Node& n : nodes) {
    for (size_t i = 0; i < n.outputs.size(); ++i) {
      if (n.outputs[i] != value) continue;
      if (n.kind != NodeKind::Wait) return n.bytes;
      // A wait's i-th output is the i-th parameter of the gather it waits on.
      for (const Node& g : nodes) {
        if (g.kind == NodeKind::Gather && !g.outputs.empty() &&
            !n.operands.empty() && g.outputs[0] == n.operands[0].value &&
            i < g.params.size()) {
          auto p = params.find(g.params[i]);
          SHARC_CHECK(p != params.end(), "sharc ir: %", value, " is parameter @", g.params[i],
                      ", which is not declared; add a line 'param @", g.params[i],
                      " \"name\" bytes=B'");
          return p->second.bytes;
        }
      }
    }
  }
  throw Error(detail::concat("sharc ir: unknown value %", value));
}

SizeBindings Graph::size_hints() const {
  SizeBindings hints;
  for (const auto& [symbol, hint] : size_symbols) {
    if (hint) hints[symbol] = *hint;
  }
  return hints;
}

int64_t Graph::value_bytes(const std::string& value, const SizeBindings& sizes) const {
  for (const Node& n : nodes) {
    if (n.kind == NodeKind::Wait || !n.bytes_expr) continue;
    for (const std::string& out : n.outputs) {
      if (out != value) continue;
      SizeBindings all = size_hints();
      for (const auto& [symbol, size] : sizes) all[symbol] = size;
      return SizeExpr::parse(*n.bytes_expr).evaluate(all);
    }
  }
  return value_bytes(value);  // a static size
}

// ---------------------------------------------------------------- parsing

namespace {

std::vector<std::string> tokenize(const std::string& line, int lineno) {
  std::vector<std::string> tokens;
  size_t i = 0;
  while (i < line.size()) {
    if (std::isspace(static_cast<unsigned char>(line[i])) || line[i] == ',') {
      ++i;
    } else if (line[i] == '#') {
      break;
    } else if (line[i] == '"') {
      const size_t end = line.find('"', i + 1);
      SHARC_CHECK(end != std::string::npos, "sharc ir line ", lineno, ": unterminated string");
      tokens.push_back(line.substr(i, end - i + 1));
      i = end + 1;
    } else {
      size_t end = i;
      while (end < line.size() && !std::isspace(static_cast<unsigned char>(line[end])) &&
             line[end] != ',') {
        if (line[end] == '"') {  // key="quoted value", spaces and commas included
          const size_t close = line.find('"', end + 1);
          SHARC_CHECK(close != std::string::npos, "sharc ir line ", lineno,
                      ": unterminated string");
          end = close;
        }
        ++end;
      }
      tokens.push_back(line.substr(i, end - i));
      i = end;
    }
  }
  return tokens;
}

int64_t param_id(const std::string& token, int lineno) {
  SHARC_CHECK(token.size() > 1 && token[0] == '@', "sharc ir line ", lineno,
              ": expected a parameter like @0, got '", token, "'");
  try {
    return std::stoll(token.substr(1));
  } catch (const std::exception&) {
    throw Error(detail::concat("sharc ir line ", lineno, ": bad parameter '", token, "'"));
  }
}

NodeKind kind_of(const std::string& word, int lineno) {
  for (NodeKind k : {NodeKind::Input, NodeKind::Compute, NodeKind::Gather, NodeKind::Wait,
                     NodeKind::Release, NodeKind::ReduceScatter, NodeKind::WaitReduce,
                     NodeKind::PrefetchNext, NodeKind::Output, NodeKind::AllReduce}) {
    if (word == to_string(k)) return k;
  }
  throw Error(detail::concat("sharc ir line ", lineno, ": unknown node kind '", word, "'"));
}

std::string dtype_name(const std::string& value, int lineno) {
  SHARC_CHECK(is_dtype_name(value), "sharc ir line ", lineno, ": bad dtype '", value,
              "'; expected a name like float32 or bfloat16");
  return value;
}

// The text of `sym="EXPR"`, checked to parse.
std::string size_expression(const std::string& quoted, int lineno) {
  SHARC_CHECK(quoted.size() >= 2 && quoted.front() == '"' && quoted.back() == '"',
              "sharc ir line ", lineno, ": expected sym=\"EXPR\", got sym=", quoted);
  const std::string text = quoted.substr(1, quoted.size() - 2);
  try {
    SizeExpr::parse(text);
  } catch (const Error& e) {
    throw Error(detail::concat("sharc ir line ", lineno, ": ", e.what()));
  }
  return text;
}

void parse_attribute(Node& node, const std::string& key, const std::string& value,
                     int lineno) {
  if (key == "bytes") {
    node.bytes = std::stoll(value);
  } else if (key == "sym") {
    node.bytes_expr = size_expression(value, lineno);
  } else if (key == "cost") {
    node.cost = std::stod(value);
  } else if (key == "grad") {
    node.grad_of = param_id(value, lineno);
  } else if (key == "param") {
    SHARC_CHECK(node.kind == NodeKind::Input, "sharc ir line ", lineno,
                ": only an input takes 'param=' (a full parameter saved by forward); a ",
                to_string(node.kind), " names parameters as @N operands");
    node.params.push_back(param_id(value, lineno));
  } else if (key == "cast") {
    SHARC_CHECK(node.kind == NodeKind::Compute, "sharc ir line ", lineno,
                ": only compute nodes take 'cast=' (a conversion of the operand), not ",
                to_string(node.kind), " nodes");
    node.cast = dtype_name(value, lineno);
  } else {
    throw Error(detail::concat("sharc ir line ", lineno, ": unknown attribute '", key, "'"));
  }
}

void parse_argument(Node& node, const std::string& tok, int lineno) {
  const size_t eq = tok.find('=');
  if (eq != std::string::npos) {
    try {
      parse_attribute(node, tok.substr(0, eq), tok.substr(eq + 1), lineno);
    } catch (const std::logic_error&) {  // std::stoll / std::stod on a bad number
      throw Error(detail::concat("sharc ir line ", lineno, ": bad value in '", tok, "'"));
    }
  } else if (tok[0] == '%') {
    node.operands.push_back(Operand::of_value(tok.substr(1)));
  } else if (tok[0] == '@') {
    if (node.kind == NodeKind::Compute || node.kind == NodeKind::Output) {
      node.operands.push_back(Operand::of_param(param_id(tok, lineno)));
    } else {
      node.params.push_back(param_id(tok, lineno));
    }
  } else if (tok[0] == '"' && node.kind == NodeKind::Compute) {
    node.op = tok.substr(1, tok.size() - 2);
  } else if (tok == "after" &&
             (node.kind == NodeKind::Release || node.kind == NodeKind::PrefetchNext)) {
    // operands that follow are the release's data dependences
  } else {
    throw Error(detail::concat("sharc ir line ", lineno, ": unexpected '", tok, "'"));
  }
}

constexpr const char* kParamForm = "'param @N \"name\" bytes=B [dtype=D] [kept]'";

// One `key=value` after a parameter's name; `seen` holds the keys so far.
void parse_param_attribute(Param& param, const std::string& tok, std::set<std::string>& seen,
                           int lineno) {
  if (tok == "kept") {
    SHARC_CHECK(seen.insert(tok).second, "sharc ir line ", lineno, ": 'kept' given twice");
    param.kept = true;
    return;
  }
  const size_t eq = tok.find('=');
  SHARC_CHECK(eq != std::string::npos, "sharc ir line ", lineno, ": unexpected '", tok,
              "'; expected ", kParamForm);
  const std::string key = tok.substr(0, eq), value = tok.substr(eq + 1);
  SHARC_CHECK(seen.insert(key).second, "sharc ir line ", lineno, ": '", key,
              "=' given twice");
  if (key == "bytes") {
    try {
      param.bytes = std::stoll(value);
    } catch (const std::logic_error&) {  // not a number, or out of range
      throw Error(detail::concat("sharc ir line ", lineno, ": bad value in '", tok, "'"));
    }
  } else if (key == "dtype") {
    param.dtype = dtype_name(value, lineno);
  } else {
    throw Error(detail::concat("sharc ir line ", lineno, ": unknown parameter attribute '",
                               key, "'; expected ", kParamForm));
  }
}

Param parse_param(const std::vector<std::string>& tokens, int lineno) {
  SHARC_CHECK(tokens.size() >= 3 && tokens[2].front() == '"', "sharc ir line ", lineno,
              ": expected ", kParamForm);
  Param param;
  param.id = param_id(tokens[1], lineno);
  param.name = tokens[2].substr(1, tokens[2].size() - 2);
  std::set<std::string> seen;
  for (size_t i = 3; i < tokens.size(); ++i) {
    parse_param_attribute(param, tokens[i], seen, lineno);
  }
  SHARC_CHECK(seen.count("bytes"), "sharc ir line ", lineno, ": missing 'bytes='; expected ",
              kParamForm);
  return param;
}

// An identifier that a size expression reads as a symbol (not Max or Min).
bool is_symbol_name(const std::string& name) {
  if (name.empty() || name == "Max" || name == "Min") return false;
  if (std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  });
}

// `size NAME [hint=N]`: a size symbol and the value it had when compiled.
void parse_size_symbol(Graph& graph, const std::vector<std::string>& tokens, int lineno) {
  constexpr const char* form = "'size NAME [hint=N]'";
  SHARC_CHECK(tokens.size() == 2 || tokens.size() == 3, "sharc ir line ", lineno,
              ": expected ", form);
  const std::string& name = tokens[1];
  SHARC_CHECK(is_symbol_name(name), "sharc ir line ", lineno, ": '", name,
              "' is not a symbol name; expected ", form);
  std::optional<int64_t> hint;
  if (tokens.size() == 3) {
    SHARC_CHECK(tokens[2].rfind("hint=", 0) == 0, "sharc ir line ", lineno,
                ": unexpected '", tokens[2], "'; expected ", form);
    try {
      hint = std::stoll(tokens[2].substr(5));
    } catch (const std::logic_error&) {
      throw Error(detail::concat("sharc ir line ", lineno, ": bad value in '", tokens[2], "'"));
    }
  }
  SHARC_CHECK(graph.size_symbols.emplace(name, hint).second, "sharc ir line ", lineno,
              ": size symbol ", name, " declared twice");
}

Node parse_node(const std::vector<std::string>& tokens, int lineno) {
  Node node;
  size_t i = 0;
  std::vector<std::string> outputs;
  while (i < tokens.size() && tokens[i] != "=" && tokens[i][0] == '%') {
    outputs.push_back(tokens[i++].substr(1));
  }
  if (!outputs.empty()) {
    SHARC_CHECK(i < tokens.size() && tokens[i] == "=", "sharc ir line ", lineno,
                ": expected '=' after the outputs");
    ++i;
  }
  SHARC_CHECK(i < tokens.size(), "sharc ir line ", lineno, ": missing node kind");
  node.kind = kind_of(tokens[i++], lineno);
  node.outputs = std::move(outputs);
  for (; i < tokens.size(); ++i) {
    parse_argument(node, tokens[i], lineno);
  }
  return node;
}

}  // namespace

Graph parse(const std::string& text) {
  Graph graph;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    const auto tokens = tokenize(line, lineno);
    if (tokens.empty()) continue;
    if (tokens[0] == "param") {
      Param p = parse_param(tokens, lineno);
      SHARC_CHECK(graph.params.count(p.id) == 0, "sharc ir line ", lineno,
                  ": parameter @", p.id, " declared twice");
      graph.params[p.id] = p;
    } else if (tokens[0] == "size") {
      parse_size_symbol(graph, tokens, lineno);
    } else {
      graph.nodes.push_back(parse_node(tokens, lineno));
    }
  }
  return graph;
}

// --------------------------------------------------------------- printing

namespace {

void print_node(std::ostream& out, const Node& n) {
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    out << (i ? ", %" : "%") << n.outputs[i];
  }
  if (!n.outputs.empty()) out << " = ";
  out << to_string(n.kind);
  if (n.kind == NodeKind::Input) {
    for (int64_t p : n.params) out << " param=@" << p;
  } else {
    for (int64_t p : n.params) out << " @" << p;
  }
  if (n.kind == NodeKind::Compute) out << " \"" << n.op << "\"";
  const bool orders = n.kind == NodeKind::Release || n.kind == NodeKind::PrefetchNext;
  if (orders && !n.operands.empty()) out << " after";
  for (const Operand& o : n.operands) {
    if (o.is_param()) {
      out << " @" << *o.param;
    } else {
      out << " %" << o.value;
    }
  }
  if (n.bytes || n.bytes_expr) out << " bytes=" << n.bytes;
  if (n.bytes_expr) out << " sym=\"" << *n.bytes_expr << "\"";
  if (n.grad_of) out << " grad=@" << *n.grad_of;
  if (n.cast) out << " cast=" << *n.cast;
  if (n.cost) out << " cost=" << *n.cost;
  out << "\n";
}

}  // namespace

std::string print(const Graph& graph) {
  std::ostringstream out;
  for (const auto& [id, p] : graph.params) {
    out << "param @" << id << " \"" << p.name << "\" bytes=" << p.bytes;
    if (p.dtype) out << " dtype=" << *p.dtype;
    if (p.kept) out << " kept";
    out << "\n";
  }
  for (const auto& [name, hint] : graph.size_symbols) {
    out << "size " << name;
    if (hint) out << " hint=" << *hint;
    out << "\n";
  }
  for (const Node& n : graph.nodes) {
    print_node(out, n);
  }
  return out.str();
}

}  // namespace sharc::ir
