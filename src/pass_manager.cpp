#include "sharc/pass.h"

#include "sharc/error.h"

namespace sharc::ir {

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

void PassManager::check(const Graph& graph, const VerifyOptions& rules,
                        const std::string& after) const {
  const auto errors = verify(graph, rules);
  if (errors.empty()) return;
  std::string all;
  for (const auto& e : errors) all += "\n  " + e;
  throw Error(detail::concat("sharc: the IR is invalid ", after, ":", all));
}

std::vector<PassRecord> PassManager::run(Graph& graph) const {
  VerifyOptions rules = input_rules_;
  check(graph, rules, "on input");
  std::vector<PassRecord> records;
  for (const auto& pass : passes_) {
    const std::string name = pass->name();
    if (disabled_.count(name)) {
      records.push_back({name, 0, true});
      continue;
    }
    if (printer_) printer_(name, "before", print(graph));
    const int64_t rewrites = pass->run(graph);
    if (printer_) printer_(name, "after", print(graph));
    pass->establishes(rules);
    check(graph, rules, "after pass '" + name + "'");
    records.push_back({name, rewrites, false});
  }
  std::string off;
  for (const std::string& name : disabled_) off += (off.empty() ? "" : ", ") + name;
  check(graph, final_rules_,
        off.empty() ? std::string("at the end of the pass pipeline")
                    : "at the end of the pass pipeline, with passes switched off (" + off +
                          "); switch them back on");
  return records;
}

}  // namespace sharc::ir
