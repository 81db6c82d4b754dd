#pragma once
// Analyses a pass asks for instead of computing them itself.
//
// Each is computed at most once over a graph and kept until a pass that
// may change what it depends on has run: after each pass the pass manager
// drops every analysis the pass does not declare preserved
// (Contract::preserved). The verifier, which runs after every pass, asks
// for the same dependence the passes do.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>

#include "sharc/compiler/ir.h"
#include "sharc/compiler/memory.h"

namespace sharc::ir {

enum class Analysis {
  Dependence,          ///< which nodes feed which (ir.h's Dependence)
  PlainSchedulePeak,   ///< the gathered peak of the plain schedule (passes.h)
};

/// The peak of gathered bytes of `graph`'s plain schedule: every parameter
/// gathered alone right before its first use and released right after its
/// last (kept ones resident), the leanest schedule there is. The graph
/// reads its parameters directly (before insert_gather_release).
GatheredPeak plain_schedule_peak(const Graph& graph);

class Analyses {
 public:
  /// Over `graph`, which must outlive this object; passes rewrite it in
  /// place, and the manager invalidates what they change.
  explicit Analyses(const Graph& graph) : graph_(graph) {}

  const Dependence& dependence();
  const GatheredPeak& plain_schedule_peak();

  /// Drops every analysis but `preserved` (the graph changed).
  void invalidate_except(const std::vector<Analysis>& preserved);
  /// How many times `analysis` was computed (for tests and statistics).
  int64_t computed(Analysis analysis) const;

 private:
  const Graph& graph_;
  std::unique_ptr<Dependence> dependence_;
  std::optional<GatheredPeak> plain_peak_;
  std::map<Analysis, int64_t> computed_;
};

}  // namespace sharc::ir
