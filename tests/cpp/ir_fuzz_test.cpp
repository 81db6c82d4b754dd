// The IR parser and verifier under fuzzed input.
//
// A fixed number of texts, generated and mutated by a seeded generator (the
// same inputs on every run), go through parse, print, verify and value_bytes.
// Bad text must be rejected with a sharc::Error that names its line; no input
// may crash, hang or throw anything else. Text that parses must print to a
// form that parses again and prints the same (a fixed point), also after
// cast_before_gather, which rewrites operands of every kind of node.

#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "sharc/core/error.h"
#include "sharc/compiler/ir.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Fixed, so every run sees the same inputs; the environment variables
// SHARC_IR_FUZZ_SEED and SHARC_IR_FUZZ_CASES explore further by hand.
constexpr uint64_t kSeed = 0x5eed'1234;
constexpr int kCases = 20000;

uint64_t env_or(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  return value ? std::strtoull(value, nullptr, 0) : fallback;
}

// Well-formed graphs to mutate: forward and backward schedules, direct reads.
const std::vector<std::string> kCorpus = {
    "param @0 \"fc.weight\" bytes=4096\n"
    "param @1 \"fc.bias\" bytes=64   # a comment\n"
    "%x = input bytes=256\n"
    "%g = gather @0 @1\n"
    "%w, %b = wait %g\n"
    "%y = compute \"addmm\" %b %x %w bytes=256 cost=1.5\n"
    "release @0 @1 after %y\n"
    "output %y\n",
    "param @0 \"w\" bytes=16\n"
    "%saved = input param=@0\n"
    "%dw = compute \"mm\" %saved @0 bytes=16 grad=@0\n"
    "%r = reduce_scatter @0 %dw\n",
    "param @0 \"w\" bytes=64\n"
    "param @1 \"b\" bytes=8\n"
    "%x = input bytes=16\n"
    "%y = compute \"mm\" %x @0 bytes=16\n"
    "%z = compute \"add\" %y @1 @0 bytes=16\n"
    "%dw = compute \"mm_grad\" %x %z bytes=64 grad=@0\n"
    "%db = compute \"sum\" %z bytes=8 grad=@1\n"
    "%r = reduce_scatter @0 @1 %dw %db\n"
    "%sw, %sb = wait_reduce %r\n"
    "output %z @1 %sw %sb\n",
    "param @0 \"w\" dtype=float32 bytes=64\n"
    "param @1 \"b\" bytes=8 dtype=bfloat16\n"
    "%x = input bytes=16\n"
    "%wb = compute \"convert\" @0 bytes=32 cast=bfloat16\n"
    "%y = compute \"mm\" %x %wb bytes=16 cast=float16 cost=0.5\n"
    "%g = gather @1\n"
    "%b = wait %g\n"
    "%z = compute \"add\" %y %b bytes=16\n"
    "release @1 after %z %wb\n"
    "output %z\n",
    "param @0 \"w\" bytes=64\n"
    "size s0 hint=16\n"
    "size u0\n"
    "%x = input bytes=64 sym=\"4*s0\"\n"
    "%y = compute \"mm\" %x @0 bytes=56 sym=\"4*(s0 - 2)\"\n"
    "%k = compute \"nonzero\" %y bytes=0 sym=\"Max(8*u0, (s0//3) % 5)\"\n"
    "%dw = compute \"mm_grad\" %x %y bytes=64 grad=@0\n"
    "output %y %k\n",
};

// Fragments that hit the tokenizer's and parser's special cases.
const std::vector<std::string> kFragments = {
    "%", "@", "\"", "=", ",", "#", " ", "\n", "\t", "%x", "%y", "%g", "@0", "@1", "@-1",
    "@99999999999999999999", "@x", "@", "bytes=", "bytes=-4", "bytes=1e3", "bytes=lots",
    "bytes=99999999999999999999", "cost=", "cost=nan", "cost=1e999", "cost=-0", "grad=",
    "grad=@0", "grad=x", "param=", "param=@1", "param=@", "after", "input", "compute",
    "gather", "wait", "release", "reduce_scatter", "wait_reduce", "%r", "output", "param",
    "\"op\"", "\"\"",
    "\"unterminated", "==", "%a, %b =", "= input", "frobnicate", "\xff\xfe", std::string(1, '\0'),
    "dtype=", "dtype=float32", "dtype=bfloat16", "dtype=int8", "dtype=odd_type", "dtype=@0",
    "cast=", "cast=bfloat16", "cast=float16", "cast=float64", "cast=%x", "cast=8bit",
    "size", "size s0", "size s1 hint=3", "hint=", "hint=-1", "sym=", "sym=\"\"", "sym=\"s0\"",
    "sym=\"s9*2\"", "sym=\"(\"", "sym=\"1//0\"", "sym=\"2**99\"", "**", "//", "%", "Max(",
    "Min(s0,", ")", "-", "sym=\"Max(s0, 3)\"",
};

using Rng = std::mt19937_64;

size_t pick(Rng& rng, size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); }

std::string fragment(Rng& rng) { return kFragments[pick(rng, kFragments.size())]; }

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    const size_t stop = end == std::string::npos ? text.size() : end;
    lines.push_back(text.substr(start, stop - start));
    start = stop + 1;
  }
  return lines;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& l : lines) text += l + "\n";
  return text;
}

// One random edit: a character, a fragment, a deletion, or a line moved.
void mutate_once(Rng& rng, std::string& text) {
  const size_t at = text.empty() ? 0 : pick(rng, text.size() + 1);
  switch (pick(rng, 6)) {
    case 0:  // overwrite one byte with anything
      if (!text.empty()) text[pick(rng, text.size())] = static_cast<char>(pick(rng, 256));
      break;
    case 1: text.insert(at, fragment(rng)); break;
    case 2: text.erase(at, pick(rng, 8)); break;
    case 3: text.resize(at); break;
    default: {  // duplicate, drop or swap whole lines
      std::vector<std::string> lines = split_lines(text);
      if (lines.empty()) break;
      const size_t a = pick(rng, lines.size()), b = pick(rng, lines.size());
      if (pick(rng, 3) == 0) {
        lines.insert(lines.begin() + a, lines[b]);
      } else if (pick(rng, 2) == 0) {
        lines.erase(lines.begin() + a);
      } else {
        std::swap(lines[a], lines[b]);
      }
      text = join_lines(lines);
    }
  }
}

// A text of random lines built from fragments only.
std::string generate(Rng& rng) {
  std::string text;
  const size_t lines = 1 + pick(rng, 8);
  for (size_t l = 0; l < lines; ++l) {
    const size_t words = 1 + pick(rng, 7);
    for (size_t w = 0; w < words; ++w) text += fragment(rng) + " ";
    text += "\n";
  }
  return text;
}

std::string make_case(Rng& rng) {
  if (pick(rng, 4) == 0) return generate(rng);
  std::string text = kCorpus[pick(rng, kCorpus.size())];
  const size_t edits = 1 + pick(rng, 6);
  for (size_t e = 0; e < edits; ++e) mutate_once(rng, text);
  return text;
}

// Everything a parsed graph offers must work without crashing or throwing.
void exercise(const Graph& graph, const std::string& text) {
  verify(graph);
  verify(graph, VerifyOptions::structural());
  const std::string printed = print(graph);
  Graph again;
  try {
    again = parse(printed);
  } catch (const Error& e) {
    FAIL() << "the printed form does not parse: " << e.what() << "\ninput:\n"
           << text << "\nprinted:\n" << printed;
  }
  EXPECT_EQ(print(again), printed) << "input:\n" << text;
  Graph cast = graph;
  make_cast_before_gather()->run(cast);
  EXPECT_EQ(print(parse(print(cast))), print(cast)) << "input:\n" << text;
  for (const Node& n : graph.nodes) {
    for (const std::string& v : n.outputs) {
      try {
        graph.value_bytes(v);
      } catch (const Error&) {  // a wait on something that is no gather: reported, fine
      }
      try {  // symbolic sizes at other sizes: an unbound symbol or overflow is an Error
        graph.value_bytes(v, {{"s0", 7}, {"s1", 1 << 20}, {"u0", 3}});
      } catch (const Error&) {
      }
    }
  }
}

TEST(IrFuzz, MalformedTextGivesAnErrorNamingTheLine) {
  Rng rng(env_or("SHARC_IR_FUZZ_SEED", kSeed));
  const uint64_t cases = env_or("SHARC_IR_FUZZ_CASES", kCases);
  uint64_t parsed = 0, rejected = 0;
  for (uint64_t i = 0; i < cases; ++i) {
    const std::string text = make_case(rng);
    try {
      const Graph graph = parse(text);
      ++parsed;
      exercise(graph, text);
    } catch (const Error& e) {
      ++rejected;
      ASSERT_NE(std::string(e.what()).find("line "), std::string::npos)
          << "case " << i << ": the error does not name the line: " << e.what()
          << "\ninput:\n" << text;
    } catch (const std::exception& e) {
      FAIL() << "case " << i << ": not a sharc::Error: " << e.what() << "\ninput:\n" << text;
    }
    if (HasFatalFailure() || HasNonfatalFailure()) return;
  }
  // Both outcomes must be common, or the generator stopped exploring.
  EXPECT_GT(parsed, cases / 10);
  EXPECT_GT(rejected, cases / 10);
}

// What the fuzzer found, pinned one by one.
TEST(IrFuzz, FoundCases) {
  // A non-numeric byte count in a parameter declaration escaped as std::invalid_argument.
  EXPECT_THROW(parse("param @0 \"w\" bytes=x\n"), Error);
  EXPECT_THROW(parse("param @0 \"w\" bytes=99999999999999999999\n"), Error);
  // param= on a compute node printed as a direct read, so print(parse(t)) changed meaning.
  EXPECT_THROW(parse("%y = compute \"mm\" param=@0 bytes=4\n"), Error);
  // value_bytes of a wait on a gather of an undeclared parameter escaped as std::out_of_range.
  const Graph g = parse("%g = gather @7\n%w = wait %g\n");
  try {
    g.value_bytes("w");
    FAIL() << "an undeclared parameter has no size";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("@7"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace sharc::ir
