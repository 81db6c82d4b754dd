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

int64_t inter_host_bytes_per_step(int64_t param_bytes, int64_t hosts, int64_t per_host,
                                  bool hybrid) {
  SHARC_CHECK(param_bytes >= 0 && hosts >= 1 && per_host >= 1, "sharc: inter-host bytes need "
              "param_bytes >= 0 and at least one host of one rank, got ", param_bytes, ", ",
              hosts, " x ", per_host);
  if (hosts == 1) return 0;
  const double p = static_cast<double>(param_bytes);
  const double h = static_cast<double>(hosts), m = static_cast<double>(per_host);
  if (hybrid) return static_cast<int64_t>(m * 2.0 * (h - 1.0) / h * (p / m));
  const double w = h * m;
  const double gathers = 2.0 * (w - 1.0) / w * p;
  const double reduce = m * (w - m) / w * p;
  return static_cast<int64_t>(gathers + reduce);
}

double predict_step_us(double compute_us, int64_t inter_host_bytes, double link_bits_per_s) {
  SHARC_CHECK(link_bits_per_s > 0, "sharc: a link rate must be > 0, got ", link_bits_per_s);
  return compute_us + static_cast<double>(inter_host_bytes) * 8.0 / link_bits_per_s * 1e6;
}

}  // namespace sharc
