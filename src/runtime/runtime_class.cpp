// torch.classes.sharc.Runtime: the Python face of a group's Runtime.
//
// Python obtains the group's Runtime with Runtime.for_group(name) and drives
// registration, eager release (release(id, mode), the mode by name) and
// statistics through it; everything else goes through torch.ops.sharc
// operators.

#include <torch/custom_class.h>
#include <torch/library.h>

#include "sharc/runtime/runtime_table.h"

namespace sharc {
namespace {

c10::intrusive_ptr<Runtime> for_group(std::string group_name) {
  return RuntimeTable::instance().get_or_create(group_name);
}

c10::Dict<std::string, int64_t> graph_kinds() {
  c10::Dict<std::string, int64_t> kinds;
  kinds.insert("forward", kForwardGraph);
  kinds.insert("backward", kBackwardGraph);
  return kinds;
}

}  // namespace
}  // namespace sharc

TORCH_LIBRARY_FRAGMENT(sharc, m) {
  m.class_<sharc::Runtime>("Runtime")
      .def_static("for_group", &sharc::for_group)
      // The GraphKind numbers by name ("forward", "backward"): Python's
      // only source for them (sharc/_compile/ops.py).
      .def_static("graph_kinds", &sharc::graph_kinds)
      .def("register_param", &sharc::Runtime::register_param)
      .def("register_empty", &sharc::Runtime::register_empty)
      .def("shard", &sharc::Runtime::shard)
      .def("set_parameter", &sharc::Runtime::set_parameter)
      .def("load_full", &sharc::Runtime::load_full)
      .def("gather", &sharc::Runtime::gather)
      .def("read_full", &sharc::Runtime::read_full)
      // release(id, mode): mode by name, "free", "free_or_hand_over" or
      // "hand_over" (sharc::ReleaseMode); returns whether the parameter got
      // a fresh buffer because the old one was handed over.
      .def("release",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t id,
              const std::string& mode) {
             return self->release(id, sharc::release_mode_from_name(mode));
           })
      .def("reduce_scatter", &sharc::Runtime::reduce_scatter)
      .def("set_persistent", &sharc::Runtime::set_persistent)
      .def("retire", &sharc::Runtime::retire)
      .def("is_persistent", &sharc::Runtime::is_persistent)
      .def("note_shards_written", &sharc::Runtime::note_shards_written)
      .def("held_back", &sharc::Runtime::held_back)
      .def("discard_held_back", &sharc::Runtime::discard_held_back)
      .def("persistent_params", &sharc::Runtime::persistent_params)
      .def("note_graph_peak", &sharc::Runtime::note_graph_peak)
      .def("drop_unheld", &sharc::Runtime::drop_unheld)
      .def("begin_forward_graph", &sharc::Runtime::begin_forward_graph)
      .def("end_forward_graph", &sharc::Runtime::end_forward_graph)
      .def("set_spec", &sharc::Runtime::set_spec)
      .def("set_gradient_sync", &sharc::Runtime::set_gradient_sync)
      .def("set_replicate_group", &sharc::Runtime::set_replicate_group)
      .def("replicate_size", &sharc::Runtime::replicate_size)
      .def("set_replicate_sync", &sharc::Runtime::set_replicate_sync)
      .def("set_verify_schedule", &sharc::Runtime::set_verify_schedule)
      .def("set_settle_on_arrival", &sharc::Runtime::set_settle_on_arrival)
      .def("settle_all", &sharc::Runtime::settle_all)
      .def("set_deferred_reduction", &sharc::Runtime::set_deferred_reduction)
      // Only a gather unit's members hold back their reductions.
      .def("in_gather_unit", &sharc::Runtime::reduction_deferred)
      .def("set_eager_prefetch",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root, bool enabled,
              std::vector<int64_t> excluded) {
             self->eager_prefetch().configure(root, enabled, excluded);
           })
      .def("set_eager_bucket_bytes",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root, int64_t bytes) {
             self->eager_reduction().set_bucket_bytes(root, bytes);
           })
      .def("eager_reductions_started",
           [](const c10::intrusive_ptr<sharc::Runtime>& self) {
             return self->eager_reduction().reductions_started();
           })
      .def("eager_reductions_in_flight",
           [](const c10::intrusive_ptr<sharc::Runtime>& self) {
             return self->eager_reduction().in_flight();
           })
      // The eager schedule's events (sharc::EagerScope, eager_scope.h).
      .def("eager_add_root",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root,
              std::vector<int64_t> ids, std::vector<int64_t> tied) {
             self->eager_scope().add_root(root, ids, tied);
           })
      .def("eager_add_unit",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root,
              std::vector<int64_t> ids, std::vector<at::Tensor> shards, bool keep) {
             return self->add_gather_unit(root, ids, shards, keep);
           })
      .def("eager_enter",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root,
              bool saves_elsewhere) { return self->eager_scope().enter(root, saves_elsewhere); })
      .def("eager_exit",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root) {
             return self->eager_scope().exit(root);
           })
      .def("eager_read",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root, int64_t id,
              const at::Tensor& shard) { return self->eager_scope().read(root, id, shard); })
      .def("eager_saved_param",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root,
              const at::Tensor& saved) { return self->eager_scope().saved_param(root, saved); })
      .def("eager_unpack",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root, int64_t id) {
             return self->eager_scope().unpack(root, id);
           })
      .def("eager_enter_unit",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root, int64_t unit) {
             self->eager_scope().enter_unit(root, unit);
           })
      .def("eager_exit_unit",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root, int64_t unit,
              bool for_backward) {
             self->eager_scope().exit_unit(root, unit, for_backward);
           })
      .def("eager_unit_backward",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, int64_t root, int64_t unit) {
             self->eager_scope().unit_backward(root, unit);
           })
      .def("backward_ends", &sharc::Runtime::backward_ends)
      .def("start_gather",
           [](const c10::intrusive_ptr<sharc::Runtime>& self, std::vector<int64_t> ids) {
             self->start_gather(ids);  // each in its gather dtype
           })
      .def("wait_gather", &sharc::Runtime::wait_gather)
      .def("padded_base", &sharc::Runtime::padded_base)
      .def("state", &sharc::Runtime::state)
      .def("name", &sharc::Runtime::name)
      .def("stats", &sharc::Runtime::stats)
      .def("collective_costs", &sharc::Runtime::collective_costs)
      .def("reset_stats", &sharc::Runtime::reset_stats);
}
