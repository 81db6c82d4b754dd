#include "sharc/compiler/pass.h"

#include <algorithm>

#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

bool contains(const std::vector<Rule>& rules, Rule rule) {
  return std::find(rules.begin(), rules.end(), rule) != rules.end();
}

}  // namespace

PassManager::PassManager(VerifyOptions input_rules, VerifyOptions final_rules)
    : input_rules_(input_rules), final_rules_(final_rules) {}

PassManager& PassManager::add(std::unique_ptr<Pass> pass) {
  // Passes are switched off and reported by name, so a name means one pass.
  for (const auto& known : passes_) {
    SHARC_CHECK(known->name() != pass->name(), "sharc: pass '", pass->name(),
                "' is already in the pipeline");
  }
  passes_.push_back(std::move(pass));
  return *this;
}

void PassManager::disable(const std::string& name) {
  for (const auto& pass : passes_) {
    if (pass->name() == name) {
      disabled_.insert(name);
      return;
    }
  }
  std::string known;
  for (const std::string& pass : pass_names()) known += " " + pass;
  throw Error(detail::concat("sharc: no pass named '", name, "'; passes are:", known));
}

std::vector<std::string> PassManager::pass_names() const {
  std::vector<std::string> names;
  for (const auto& pass : passes_) names.push_back(pass->name());
  return names;
}

void PassManager::check(const Graph& graph, Analyses& analyses, const VerifyOptions& rules,
                        const std::string& after) const {
  const auto errors = verify(graph, rules, analyses.dependence());
  if (errors.empty()) return;
  std::string all;
  for (const auto& e : errors) all += "\n  " + e;
  throw Error(detail::concat("sharc: the IR is invalid ", after, ":", all));
}

void PassManager::check_final(const Graph& graph, Analyses& analyses) const {
  std::string off;
  for (const std::string& name : disabled_) off += (off.empty() ? "" : ", ") + name;
  check(graph, analyses, final_rules_,
        off.empty() ? std::string("at the end of the pass pipeline")
                    : "at the end of the pass pipeline, with passes switched off (" + off +
                          "); switch them back on");
}

// Refuses to run pass `index` on a graph its required rules may not hold
// for: a pass's assumptions fail quietly (it rewrites nothing, or wrongly),
// so the message says which rule is missing and which pass gives it.
void PassManager::check_required(size_t index, const VerifyOptions& holding,
                                 const std::map<Rule, std::string>& undone_by) const {
  const std::string name = passes_[index]->name();
  for (Rule rule : passes_[index]->contract().required) {
    if (holding.demands(rule)) continue;
    const auto undone = undone_by.find(rule);
    if (undone != undone_by.end()) {
      throw Error(detail::concat("sharc: pass '", name, "' requires '", to_string(rule),
                                 "', which pass '", undone->second, "' undid; run it before '",
                                 undone->second, "'"));
    }
    throw Error(detail::concat("sharc: pass '", name, "' requires '", to_string(rule),
                               "', which no earlier pass established",
                               how_to_establish(index, rule)));
  }
}

// Refuses to run pass `index` once a rule it must precede holds: the pass
// would find nothing of what it rewrites, and quietly do nothing.
void PassManager::check_precedes(size_t index, const VerifyOptions& holding,
                                 const std::map<Rule, std::string>& established_by) const {
  const std::string name = passes_[index]->name();
  for (Rule rule : passes_[index]->contract().precedes) {
    if (!holding.demands(rule)) continue;
    const auto by = established_by.find(rule);
    if (by != established_by.end()) {
      throw Error(detail::concat("sharc: pass '", name, "' must run before '", to_string(rule),
                                 "' holds, but pass '", by->second,
                                 "' established it; run it before '", by->second, "'"));
    }
    throw Error(detail::concat("sharc: pass '", name, "' must run before '", to_string(rule),
                               "' holds, but the pipeline's input already satisfies it; "
                               "switch it off"));
  }
}

// The fix for a required rule nothing established before pass `index`.
std::string PassManager::how_to_establish(size_t index, Rule rule) const {
  for (size_t i = 0; i < passes_.size(); ++i) {
    const std::string name = passes_[i]->name();
    if (!contains(passes_[i]->contract().established, rule)) continue;
    if (disabled_.count(name)) return "; enable '" + name + "'";
    if (i > index) return "; run it after '" + name + "'";
  }
  return "; no pass in the pipeline establishes it";
}

std::vector<PassRecord> PassManager::run(Graph& graph) const {
  Analyses analyses(graph);
  return run(graph, analyses);
}

std::vector<PassRecord> PassManager::run(Graph& graph, Analyses& analyses) const {
  VerifyOptions holding = input_rules_;
  std::map<Rule, std::string> undone_by;       // rule -> the pass that undid it
  std::map<Rule, std::string> established_by;  // rule -> the pass that established it
  check(graph, analyses, holding, "on input");
  std::vector<PassRecord> records;
  for (size_t i = 0; i < passes_.size(); ++i) {
    Pass& pass = *passes_[i];
    const std::string name = pass.name();
    if (disabled_.count(name)) {
      records.push_back({name, 0, true, {}});
      continue;
    }
    check_required(i, holding, undone_by);
    check_precedes(i, holding, established_by);
    if (printer_) printer_(name, "before", print(graph));
    const int64_t rewrites = pass.run(graph, analyses);
    if (printer_) printer_(name, "after", print(graph));
    const Contract contract = pass.contract();
    analyses.invalidate_except(contract.preserved);
    for (Rule rule : contract.undone) {
      holding.waive(rule);
      undone_by[rule] = name;
    }
    for (Rule rule : contract.established) {
      holding.require(rule);
      undone_by.erase(rule);
      established_by[rule] = name;
    }
    check(graph, analyses, holding, "after pass '" + name + "'");
    std::map<std::string, int64_t> stats = pass.statistics();
    stats["rewrites"] = rewrites;
    records.push_back({name, rewrites, false, std::move(stats)});
  }
  check_final(graph, analyses);
  return records;
}

}  // namespace sharc::ir
