#include "sharc/core/collective_cost.h"

#include <algorithm>

#include "sharc/core/error.h"

namespace sharc {

double CollectiveCost::time_us(int64_t bytes) const {
  return latency_us + us_per_byte * static_cast<double>(std::max<int64_t>(bytes, 0));
}

CollectiveCost CollectiveCost::fit(const std::vector<std::pair<int64_t, double>>& samples) {
  SHARC_CHECK(!samples.empty(), "sharc: fitting a collective's cost needs at least one sample");
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [bytes, us] : samples) {
    SHARC_CHECK(bytes >= 0 && us >= 0, "sharc: a collective cost sample must have bytes >= 0 "
                "and time >= 0, got ", bytes, " bytes in ", us, " us");
    const double x = static_cast<double>(bytes);
    n += 1;
    sx += x;
    sy += us;
    sxx += x * x;
    sxy += x * us;
  }
  const double spread = n * sxx - sx * sx;
  CollectiveCost cost;
  if (spread <= 0) {  // one size only: all of it is latency
    cost.latency_us = sy / n;
    return cost;
  }
  cost.us_per_byte = std::max(0.0, (n * sxy - sx * sy) / spread);
  cost.latency_us = std::max(0.0, (sy - cost.us_per_byte * sx) / n);
  return cost;
}

}  // namespace sharc
