#include "sharc/runtime/gather_spec.h"

#include "sharc/core/error.h"

namespace sharc {

void GatherSpec::check(c10::ScalarType master, const std::string& name) const {
  if (!c10::isFloatingType(master)) {
    SHARC_CHECK(gather_dtype == master, "sharc: '", name, "' is a ", master,
                " parameter and is gathered in its own dtype, not ", gather_dtype);
    return;
  }
  SHARC_CHECK(c10::isFloatingType(gather_dtype) &&
                  c10::elementSize(gather_dtype) <= c10::elementSize(master),
              "sharc: '", name, "' (", master, ") cannot be gathered in ", gather_dtype,
              ": use a floating-point dtype no wider than ", master);
  SHARC_CHECK(c10::isFloatingType(reduce_dtype), "sharc: '", name,
              "' cannot reduce its gradient in ", reduce_dtype, ": use a floating-point dtype");
  SHARC_CHECK(c10::isFloatingType(grad_dtype), "sharc: '", name,
              "' cannot receive its gradient in ", grad_dtype, ": use a floating-point dtype");
}

}  // namespace sharc
