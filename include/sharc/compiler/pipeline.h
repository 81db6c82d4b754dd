#pragma once
// sharc's pass pipeline: the one place that decides which passes run, in
// which order and with which settings. torch.classes.sharc.Scheduler runs it
// over the bridge's graphs; the unit tests build the same pipeline, so what
// they pin is what ships.

#include <cstdint>
#include <string>
#include <vector>

#include "sharc/compiler/pass.h"

namespace sharc::ir {

/// How the pipeline's passes are configured; the Python CompileConfig fields
/// of the same names are converted once into this struct.
struct PipelineOptions {
  /// bucket_allgathers' cap on the bytes one fused all-gather serves. The
  /// default is CompileConfig's (python/sharc/config.py).
  int64_t gather_bucket_bytes = 64 << 10;
  /// insert_reduce_scatter's cap on the gradient bytes of one bucket.
  int64_t reduce_bucket_bytes = 4 << 20;
  /// Passes switched off by name.
  std::vector<std::string> disabled_passes;
};

/// A PassManager running sharc's passes in order: regather_in_backward,
/// cast_before_gather, insert_gather_release, bucket_allgathers,
/// prefetch_gathers, insert_reduce_scatter, place_reduce_waits. Its input
/// rules are what the bridge's graphs satisfy (structural only); its final
/// rules are a complete schedule's.
/// Throws sharc::Error, listing the pass names, if a disabled pass is unknown.
PassManager make_pipeline(const PipelineOptions& options);

/// The pipeline's pass names, in the order they run.
std::vector<std::string> pipeline_pass_names();

}  // namespace sharc::ir
