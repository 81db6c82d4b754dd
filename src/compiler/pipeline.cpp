#include "sharc/compiler/pipeline.h"

#include "sharc/compiler/passes.h"

namespace sharc::ir {

PassManager make_pipeline(const PipelineOptions& options) {
  PassManager manager;
  // Re-gather comes first so the saved parameters it turns into direct reads
  // get their gathers from insertion; casting before the gather looks at
  // direct reads only, so it runs after re-gather (whose reads it sees) and
  // before insertion (which gathers in the dtype it chose); bucketing needs
  // each gather still next to its wait, which prefetching undoes, so it runs
  // before prefetching. Waits on reductions are placed once every reduction
  // is in, since each goes right after the next one starts.
  manager.add(make_regather_in_backward())
      .add(make_cast_before_gather())
      .add(make_insert_gather_release())
      .add(make_bucket_allgathers(options.gather_bucket_bytes))
      .add(make_prefetch_gathers())
      .add(make_insert_reduce_scatter(options.reduce_bucket_bytes))
      .add(make_place_reduce_waits());
  for (const std::string& name : options.disabled_passes) manager.disable(name);
  return manager;
}

std::vector<std::string> pipeline_pass_names() { return make_pipeline({}).pass_names(); }

}  // namespace sharc::ir
