#pragma once
// Element types as the scheduling IR names them: torch's dtype names without
// the `torch.` prefix ("float32", "bfloat16"). The compiler needs only each
// known type's element size and whether it is a floating-point type; any
// other identifier is a valid name of a dtype it does not know.

#include <cstdint>
#include <optional>
#include <string_view>

namespace sharc::ir {

/// What the compiler knows of a dtype.
struct DtypeInfo {
  int64_t element_bytes = 0;
  bool floating = false;  ///< a real floating-point type (not integer, bool or complex)
};

/// The known dtype of that name, or std::nullopt for one sharc does not know
/// (which passes then leave alone).
std::optional<DtypeInfo> dtype_info(std::string_view name);

/// Whether `name` may name a dtype in IR text, known or not: an identifier,
/// [A-Za-z_][A-Za-z0-9_]*.
bool is_dtype_name(std::string_view name);

}  // namespace sharc::ir
