#pragma once
// sharc's error type and check macro for the torch-free core.
//
// The core (layout, state machine, accounting, IR) does not link libtorch, so
// it cannot use TORCH_CHECK. sharc::Error derives from std::runtime_error;
// when it crosses a torch operator boundary PyTorch turns it into a Python
// RuntimeError carrying the same message.

#include <sstream>
#include <stdexcept>
#include <string>

namespace sharc {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

}  // namespace sharc

/// Throws sharc::Error with the message parts joined when `cond` is false.
#define SHARC_CHECK(cond, ...)                                   \
  do {                                                           \
    if (!(cond)) {                                               \
      throw ::sharc::Error(::sharc::detail::concat(__VA_ARGS__)); \
    }                                                            \
  } while (false)
