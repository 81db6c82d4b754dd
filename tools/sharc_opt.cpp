// sharc-opt: runs a pass pipeline over an IR file and prints the result.
//
//   sharc-opt FILE.ir [--pipeline TEXT | --pipeline-file FILE] [--stats]
//                     [--print-before-all] [--print-after-all]
//
// Without a pipeline it runs the shipping one with no measured facts (no
// budget, no costs). A pipeline dumped beside a schedule (`*.pipeline`,
// CompileConfig.dump_ir / SHARC_DUMP_IR) has every argument written out, so
// `sharc-opt STEM.before.ir --pipeline-file STEM.pipeline` prints that
// schedule's `STEM.after.ir` again. The scheduled IR goes to stdout; the
// IR around each pass (asked for) and each pass's statistics (--stats) go
// to stderr. Exit status 1 with the error on stderr if the IR or the
// pipeline is bad or a rule is violated, 2 on bad usage.

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "sharc/compiler/ir.h"
#include "sharc/compiler/pipeline.h"
#include "sharc/compiler/pipeline_text.h"
#include "sharc/core/error.h"

namespace {

struct Options {
  std::string ir_file;
  std::string pipeline;
  bool stats = false;
  bool print_before = false;
  bool print_after = false;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  SHARC_CHECK(in.good(), "sharc-opt: cannot read '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

int usage() {
  std::cerr << "usage: sharc-opt FILE.ir [--pipeline TEXT | --pipeline-file FILE] [--stats]"
               " [--print-before-all] [--print-after-all]\n";
  return 2;
}

bool parse_args(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--pipeline" && has_value) {
      o.pipeline = argv[++i];
    } else if (arg == "--pipeline-file" && has_value) {
      o.pipeline = read_file(argv[++i]);
    } else if (arg == "--stats") {
      o.stats = true;
    } else if (arg == "--print-before-all") {
      o.print_before = true;
    } else if (arg == "--print-after-all") {
      o.print_after = true;
    } else if (!arg.empty() && arg[0] != '-' && o.ir_file.empty()) {
      o.ir_file = arg;
    } else {
      return false;
    }
  }
  return !o.ir_file.empty();
}

int run(const Options& o) {
  using namespace sharc::ir;
  Graph graph = parse(read_file(o.ir_file));
  const PipelineSpec pipeline = o.pipeline.find_first_not_of(" \t\n") == std::string::npos
                                    ? shipping_pipeline({})
                                    : complete_pipeline(parse_pipeline(o.pipeline), {});
  PassManager manager = build_pipeline(pipeline);
  manager.set_printer([&o](const std::string& pass, const std::string& when,
                           const std::string& text) {
    if ((when == "before" && o.print_before) || (when == "after" && o.print_after)) {
      std::cerr << "# ---- " << when << " " << pass << "\n" << text;
    }
  });
  for (const PassRecord& record : manager.run(graph)) {
    if (!o.stats) continue;
    std::cerr << record.name << (record.skipped ? ": switched off" : ":");
    for (const auto& [key, value] : record.stats) std::cerr << " " << key << "=" << value;
    std::cerr << "\n";
  }
  std::cout << print(graph);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!parse_args(argc, argv, options)) return usage();
  try {
    return run(options);
  } catch (const sharc::Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
