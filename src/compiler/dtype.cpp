#include "sharc/compiler/dtype.h"

#include <cctype>

namespace sharc::ir {
namespace {

struct KnownDtype {
  std::string_view name;
  DtypeInfo info;
};

// torch's names (str(torch.float32) without "torch."); the aliases torch
// also accepts (float, half, double, long) never appear in str(dtype).
constexpr KnownDtype kKnown[] = {
    {"float64", {8, true}},   {"float32", {4, true}},       {"float16", {2, true}},
    {"bfloat16", {2, true}},  {"float8_e4m3fn", {1, true}}, {"float8_e5m2", {1, true}},
    {"int64", {8, false}},    {"int32", {4, false}},        {"int16", {2, false}},
    {"int8", {1, false}},     {"uint8", {1, false}},        {"bool", {1, false}},
    {"complex64", {8, false}}, {"complex128", {16, false}},
};

bool is_word_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}

}  // namespace

std::optional<DtypeInfo> dtype_info(std::string_view name) {
  for (const KnownDtype& known : kKnown) {
    if (known.name == name) return known.info;
  }
  return std::nullopt;
}

bool is_dtype_name(std::string_view name) {
  if (name.empty() || std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  for (char c : name) {
    if (!is_word_char(c)) return false;
  }
  return true;
}

}  // namespace sharc::ir
