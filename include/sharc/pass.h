#pragma once
// Passes over the scheduling IR and the manager that runs them.
//
// A pass does one thing and reports how many rewrites it made (0 when there
// was nothing to do). The manager owns everything around passes: running a
// plain list in order, switching passes off by name, printing the IR before
// and after each pass, and verifying after each one with the rules the passes
// so far have established. A violation throws sharc::Error naming the pass.

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "sharc/ir.h"

namespace sharc::ir {

class Pass {
 public:
  virtual ~Pass() = default;
  virtual std::string name() const = 0;
  /// Rewrites the graph; returns the number of rewrites made.
  virtual int64_t run(Graph& graph) = 0;
  /// Tightens `rules` with what the graph satisfies after this pass.
  virtual void establishes(VerifyOptions& rules) const { (void)rules; }
};

struct PassRecord {
  std::string name;
  int64_t rewrites = 0;
  bool skipped = false;  ///< switched off by name
};

class PassManager {
 public:
  /// (pass name, "before" or "after", IR text)
  using Printer = std::function<void(const std::string&, const std::string&, const std::string&)>;

  /// `input_rules`: what the bridge's graph satisfies; `final_rules`: what the
  /// scheduled graph must satisfy however passes were switched on or off.
  explicit PassManager(VerifyOptions input_rules = VerifyOptions::structural(),
                       VerifyOptions final_rules = VerifyOptions{});

  PassManager& add(std::unique_ptr<Pass> pass);
  /// Switches a pass off; throws sharc::Error if no pass has that name.
  void disable(const std::string& name);
  void set_printer(Printer printer) { printer_ = std::move(printer); }
  /// The passes' names in the order they run, switched off or not.
  std::vector<std::string> pass_names() const;

  /// Verifies the input, runs every enabled pass in order verifying after
  /// each, then verifies the result with the final rules. Throws sharc::Error
  /// on the first violation.
  std::vector<PassRecord> run(Graph& graph) const;

 private:
  void check(const Graph& graph, const VerifyOptions& rules, const std::string& after) const;

  VerifyOptions input_rules_;
  VerifyOptions final_rules_;
  std::vector<std::unique_ptr<Pass>> passes_;
  std::set<std::string> disabled_;
  Printer printer_;
};

}  // namespace sharc::ir
