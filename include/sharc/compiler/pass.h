#pragma once
// Passes over the scheduling IR and the manager that runs them.
//
// A pass does one thing, reports how many rewrites it made (0 when there was
// nothing to do) and declares its contract: the rules it requires of its
// input, those it establishes, those it undoes and those it must precede.
// The manager owns everything around passes: running a plain list in order,
// switching passes off by name, refusing to run a pass whose required rules
// do not hold or that comes after a rule it must precede, printing the IR
// before and after each pass, and verifying after each one with the rules
// that hold so far. A violation throws sharc::Error naming the pass.

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "sharc/compiler/analysis.h"
#include "sharc/compiler/ir.h"

namespace sharc::ir {

/// What a pass assumes and guarantees, in rules the verifier can check.
struct Contract {
  std::vector<Rule> required;     ///< must hold before the pass runs
  std::vector<Rule> established;  ///< hold after it; verified from then on
  std::vector<Rule> undone;       ///< may no longer hold after it
  /// Must not hold yet when the pass runs: it works on what establishing
  /// them rewrites away, so after them it would quietly find nothing to do.
  std::vector<Rule> precedes = {};
  /// Analyses still valid after the pass: it leaves alone what they depend
  /// on. Everything else is computed again when next asked for.
  std::vector<Analysis> preserved = {};
};

class Pass {
 public:
  virtual ~Pass() = default;
  virtual std::string name() const = 0;
  /// Rewrites the graph; returns the number of rewrites made. `analyses`
  /// are over `graph` as it was when the pass started.
  virtual int64_t run(Graph& graph, Analyses& analyses) = 0;
  /// The same with analyses of its own (a pass run alone).
  int64_t run(Graph& graph) {
    Analyses analyses(graph);
    return run(graph, analyses);
  }
  virtual Contract contract() const { return {}; }
  /// Named counts of what the last run did, beyond its rewrite count
  /// ("buckets", "kept_bytes", "exposed_us_after", ...); empty by default.
  virtual std::map<std::string, int64_t> statistics() const { return {}; }
};

struct PassRecord {
  std::string name;
  int64_t rewrites = 0;
  bool skipped = false;  ///< switched off by name
  /// The pass's statistics(), and "rewrites"; empty when skipped.
  std::map<std::string, int64_t> stats;
};

class PassManager {
 public:
  /// (pass name, "before" or "after", IR text)
  using Printer = std::function<void(const std::string&, const std::string&, const std::string&)>;

  /// `input_rules`: what the bridge's graph satisfies, so what holds before
  /// the first pass; `final_rules`: what the scheduled graph must satisfy
  /// however passes were switched on or off.
  explicit PassManager(VerifyOptions input_rules = VerifyOptions::structural(),
                       VerifyOptions final_rules = VerifyOptions::complete());

  /// Appends a pass; throws sharc::Error if one of that name is already there.
  PassManager& add(std::unique_ptr<Pass> pass);
  /// Switches a pass off; throws sharc::Error if no pass has that name.
  void disable(const std::string& name);
  void set_printer(Printer printer) { printer_ = std::move(printer); }
  /// The passes' names in the order they run, switched off or not.
  std::vector<std::string> pass_names() const;

  /// Verifies the input, runs every enabled pass in order (checking its
  /// required and preceded rules first, verifying after it), then verifies
  /// the result with the final rules. Throws sharc::Error on the first
  /// violation.
  std::vector<PassRecord> run(Graph& graph) const;
  /// The same, asking `analyses` (over `graph`) for what passes and the
  /// verifier need: each analysis is computed once, and again only after a
  /// pass that does not preserve it.
  std::vector<PassRecord> run(Graph& graph, Analyses& analyses) const;

 private:
  void check(const Graph& graph, Analyses& analyses, const VerifyOptions& rules,
             const std::string& after) const;
  void check_final(const Graph& graph, Analyses& analyses) const;
  void check_required(size_t index, const VerifyOptions& holding,
                      const std::map<Rule, std::string>& undone_by) const;
  void check_precedes(size_t index, const VerifyOptions& holding,
                      const std::map<Rule, std::string>& established_by) const;
  std::string how_to_establish(size_t index, Rule rule) const;

  VerifyOptions input_rules_;
  VerifyOptions final_rules_;
  std::vector<std::unique_ptr<Pass>> passes_;
  std::set<std::string> disabled_;
  Printer printer_;
};

}  // namespace sharc::ir
