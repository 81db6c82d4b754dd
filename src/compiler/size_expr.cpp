#include "sharc/compiler/size_expr.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <vector>

#include "sharc/core/error.h"

namespace sharc::ir {

struct SizeExpr::Term {
  enum class Kind { Number, Symbol, Add, Sub, Mul, FloorDiv, Mod, Pow, Neg, Max, Min };
  Kind kind = Kind::Number;
  int64_t number = 0;
  std::string symbol;
  std::vector<std::shared_ptr<const Term>> args;
};

namespace {

using Term = SizeExpr::Term;
using TermPtr = std::shared_ptr<const Term>;

TermPtr make(Term::Kind kind, std::vector<TermPtr> args) {
  auto t = std::make_shared<Term>();
  t->kind = kind;
  t->args = std::move(args);
  return t;
}

// Recursive descent over the grammar in size_expr.h.
class Parser {
 public:
  explicit Parser(const std::string& text) : text_(text) {}

  TermPtr run() {
    TermPtr root = sum();
    skip_space();
    if (pos_ != text_.size()) fail("unexpected '", text_[pos_], "'");
    return root;
  }

 private:
  template <typename... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    throw Error(detail::concat("sharc size expression '", text_, "' at position ", pos_,
                               ": ", parts...));
  }

  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }

  bool take(const char* token) {
    skip_space();
    const std::string t(token);
    if (text_.compare(pos_, t.size(), t) != 0) return false;
    pos_ += t.size();
    return true;
  }

  TermPtr sum() {
    TermPtr left = term();
    while (true) {
      if (take("+")) {
        left = make(Term::Kind::Add, {left, term()});
      } else if (take("-")) {
        left = make(Term::Kind::Sub, {left, term()});
      } else {
        return left;
      }
    }
  }

  TermPtr term() {
    TermPtr left = unary();
    while (true) {
      skip_space();
      if (text_.compare(pos_, 2, "**") == 0) return left;  // belongs to power()
      if (take("*")) {
        left = make(Term::Kind::Mul, {left, unary()});
      } else if (take("//")) {
        left = make(Term::Kind::FloorDiv, {left, unary()});
      } else if (take("%")) {
        left = make(Term::Kind::Mod, {left, unary()});
      } else {
        return left;
      }
    }
  }

  // Every nesting (parentheses, unary minus, powers, calls) passes here:
  // a bounded depth keeps hostile text from exhausting the stack.
  TermPtr unary() {
    if (++depth_ > kMaxDepth) fail("nested more than ", kMaxDepth, " deep");
    TermPtr out;
    if (take("-")) {
      out = make(Term::Kind::Neg, {unary()});
    } else {
      out = atom();
      if (take("**")) out = make(Term::Kind::Pow, {out, unary()});
    }
    --depth_;
    return out;
  }

  TermPtr atom() {
    skip_space();
    if (pos_ >= text_.size()) fail("expected a number, a symbol or '('");
    const char c = text_[pos_];
    if (take("(")) {
      TermPtr inner = sum();
      if (!take(")")) fail("expected ')'");
      return inner;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) return number();
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') return name();
    fail("unexpected '", c, "'");
  }

  TermPtr number() {
    auto t = std::make_shared<Term>();
    const size_t start = pos_;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    try {
      t->number = std::stoll(text_.substr(start, pos_ - start));
    } catch (const std::out_of_range&) {
      fail("number out of range");
    }
    return t;
  }

  TermPtr name() {
    const size_t start = pos_;
    while (pos_ < text_.size() &&
           (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) {
      ++pos_;
    }
    const std::string word = text_.substr(start, pos_ - start);
    if (word == "Max" || word == "Min") return call(word);
    auto t = std::make_shared<Term>();
    t->kind = Term::Kind::Symbol;
    t->symbol = word;
    return t;
  }

  TermPtr call(const std::string& function) {
    if (!take("(")) fail("expected '(' after ", function);
    std::vector<TermPtr> args{sum()};
    while (take(",")) args.push_back(sum());
    if (!take(")")) fail("expected ')' closing ", function);
    return make(function == "Max" ? Term::Kind::Max : Term::Kind::Min, std::move(args));
  }

  static constexpr int kMaxDepth = 256;
  const std::string& text_;
  size_t pos_ = 0;
  int depth_ = 0;
};

void check_no_overflow(bool overflowed) {
  SHARC_CHECK(!overflowed, "sharc size expression: a value overflows 64 bits");
}

int64_t add(int64_t a, int64_t b) {
  int64_t out = 0;
  check_no_overflow(__builtin_add_overflow(a, b, &out));
  return out;
}

int64_t subtract(int64_t a, int64_t b) {
  int64_t out = 0;
  check_no_overflow(__builtin_sub_overflow(a, b, &out));
  return out;
}

int64_t multiply(int64_t a, int64_t b) {
  int64_t out = 0;
  check_no_overflow(__builtin_mul_overflow(a, b, &out));
  return out;
}

int64_t floor_div(int64_t a, int64_t b) {
  SHARC_CHECK(b != 0, "sharc size expression: division by zero");
  check_no_overflow(a == INT64_MIN && b == -1);
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

int64_t py_mod(int64_t a, int64_t b) {
  return subtract(a, multiply(floor_div(a, b), b));
}

// By squaring: a large exponent of 0 or 1 must not loop for long.
int64_t power(int64_t base, int64_t exponent) {
  SHARC_CHECK(exponent >= 0, "sharc size expression: negative exponent ", exponent);
  int64_t out = 1;
  while (exponent > 0) {
    if (exponent & 1) out = multiply(out, base);
    exponent >>= 1;
    if (exponent > 0) base = multiply(base, base);
  }
  return out;
}

int64_t evaluate_term(const Term& t, const SizeBindings& bindings) {
  using K = Term::Kind;
  auto arg = [&](size_t i) { return evaluate_term(*t.args[i], bindings); };
  int64_t out = 0;
  switch (t.kind) {
    case K::Number: return t.number;
    case K::Symbol: {
      auto it = bindings.find(t.symbol);
      SHARC_CHECK(it != bindings.end(), "sharc size expression: symbol ", t.symbol,
                  " has no value");
      return it->second;
    }
    case K::Add: return add(arg(0), arg(1));
    case K::Sub: return subtract(arg(0), arg(1));
    case K::Mul: return multiply(arg(0), arg(1));
    case K::FloorDiv: return floor_div(arg(0), arg(1));
    case K::Mod: return py_mod(arg(0), arg(1));
    case K::Pow: return power(arg(0), arg(1));
    case K::Neg: return subtract(0, arg(0));
    case K::Max:
    case K::Min: {
      out = arg(0);
      for (size_t i = 1; i < t.args.size(); ++i) {
        const int64_t v = arg(i);
        out = t.kind == K::Max ? std::max(out, v) : std::min(out, v);
      }
      return out;
    }
  }
  return out;
}

void collect_symbols(const Term& t, std::set<std::string>& out) {
  if (t.kind == Term::Kind::Symbol) out.insert(t.symbol);
  for (const TermPtr& a : t.args) collect_symbols(*a, out);
}

}  // namespace

SizeExpr SizeExpr::parse(const std::string& text) {
  return SizeExpr(Parser(text).run());
}

int64_t SizeExpr::evaluate(const SizeBindings& bindings) const {
  return evaluate_term(*root_, bindings);
}

std::set<std::string> SizeExpr::symbols() const {
  std::set<std::string> out;
  collect_symbols(*root_, out);
  return out;
}

}  // namespace sharc::ir
