#include <optional>

#include "sharc/compiler/memory.h"
#include "sharc/compiler/passes.h"
#include "sharc/core/error.h"

namespace sharc::ir {

namespace {

// Refuses a budget no schedule of this graph fits in, before any pass
// spends it: the plain schedule (each parameter gathered alone right before
// its first use, released right after its last) is the leanest there is.
class CheckMemoryBudget : public Pass {
 public:
  explicit CheckMemoryBudget(std::optional<int64_t> budget) : budget_(budget) {}

  std::string name() const override { return "check_memory_budget"; }

  // It measures the plain schedule from the direct reads insertion rewrites.
  // It rewrites nothing, so every analysis stays valid.
  Contract contract() const override {
    return {{}, {}, {}, {Rule::GathersInserted},
            {Analysis::Dependence, Analysis::PlainSchedulePeak}};
  }

  int64_t run(Graph& graph, Analyses& analyses) override {
    if (!budget_) return 0;
    const GatheredPeak plain = analyses.plain_schedule_peak();
    if (*budget_ >= plain.bytes) return 0;
    throw Error(detail::concat(
        "sharc: memory_budget_bytes=", *budget_, " is below the smallest budget this graph "
        "can run in, ", plain.bytes, " bytes (every parameter gathered alone right before its "
        "first use and released after its last, with ", kept_bytes(graph),
        " bytes of kept parameters resident); raise memory_budget_bytes to at least ",
        plain.bytes));
  }

 private:
  std::optional<int64_t> budget_;
};

}  // namespace

std::unique_ptr<Pass> make_check_memory_budget(std::optional<int64_t> budget_bytes) {
  return std::make_unique<CheckMemoryBudget>(budget_bytes);
}

}  // namespace sharc::ir
