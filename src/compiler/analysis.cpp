#include "sharc/compiler/analysis.h"

#include <algorithm>

#include "sharc/compiler/passes.h"

namespace sharc::ir {

GatheredPeak plain_schedule_peak(const Graph& graph) {
  Graph plain = graph;
  make_insert_gather_release()->run(plain);
  return peak_gathered(plain);
}

const Dependence& Analyses::dependence() {
  if (!dependence_) {
    dependence_ = std::make_unique<Dependence>(graph_);
    ++computed_[Analysis::Dependence];
  }
  return *dependence_;
}

const GatheredPeak& Analyses::plain_schedule_peak() {
  if (!plain_peak_) {
    plain_peak_ = ir::plain_schedule_peak(graph_);
    ++computed_[Analysis::PlainSchedulePeak];
  }
  return *plain_peak_;
}

void Analyses::invalidate_except(const std::vector<Analysis>& preserved) {
  auto kept = [&](Analysis a) {
    return std::find(preserved.begin(), preserved.end(), a) != preserved.end();
  };
  if (!kept(Analysis::Dependence)) dependence_.reset();
  if (!kept(Analysis::PlainSchedulePeak)) plain_peak_.reset();
}

int64_t Analyses::computed(Analysis analysis) const {
  auto it = computed_.find(analysis);
  return it == computed_.end() ? 0 : it->second;
}

}  // namespace sharc::ir
