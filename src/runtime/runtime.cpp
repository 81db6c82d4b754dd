#include "sharc/runtime/runtime.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <unordered_set>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "sharc/runtime/collective_headers.h"
#include "sharc/runtime/device_storage.h"
#include "sharc/runtime/row_sum.h"
#include "sharc/core/error.h"

namespace sharc {
namespace {

// Waits for `work`; returns the nanoseconds the host was blocked.
int64_t timed_wait(c10d::Work& work) {
  const auto start = std::chrono::steady_clock::now();
  work.wait();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now() - start).count();
}

}  // namespace

ShardedParam::ShardedParam(std::string name_, std::vector<int64_t> shape_,
                           ShardLayout layout_, at::Tensor shard_)
    : name(std::move(name_)),
      shape(std::move(shape_)),
      layout(layout_),
      shard(std::move(shard_)),
      state(name),
      spec(GatherSpec::of(shard.scalar_type())) {
  base = shard.new_empty({0});
  renew_base();
}

void ShardedParam::renew_base() {
  // Sized without allocating: the storage holds 0 bytes until a gather.
  base = at::empty({0}, base.options());
  base.unsafeGetTensorImpl()->set_sizes_contiguous({layout.padded_numel()});
}

bool ShardedParam::is_stale() const {
  return state.state() == ParamState::Gathered && state.holds() == 0 && shard_changed();
}

bool ShardedParam::shard_changed() const {
  return written_unseen || shard._version() != gathered_version;
}

int64_t ShardedParam::full_bytes() const {
  return layout.padded_numel() * static_cast<int64_t>(base.element_size());
}

namespace {
std::string in_place_write_error(const ShardedParam& p) {
  return detail::concat(
      "sharc: '", p.name, "' was changed in place inside forward (a write to the gathered "
      "parameter, such as `self.weight.mul_(...)`, or `nn.Embedding(max_norm=...)`, which "
      "renormalises the rows it looks up in place); the change never reaches the shards and is "
      "lost when the gathered value is released. Change parameters outside forward, on every "
      "rank, inside `with sharc.unsharded(model, writeback=True):`, or compute with a changed "
      "copy (`w = self.weight * s`; for max_norm, renormalise the looked-up rows out of place: "
      "`F.embedding(ids, w)` then scale the rows whose norm exceeds it)");
}
}  // namespace

bool ShardedParam::take_in_place_write() {
  bool written = false;
  for (HandedOut& out : handed_out) {
    if (!out.counter.enabled()) continue;  // made in inference mode: no counter
    const uint32_t now = out.counter.current_version();
    written = written || now != out.version;
    out.version = now;
  }
  return written;
}

void ShardedParam::free_base() {
  c10::Storage storage = base.storage();
  free_storage(storage, detail::concat(
      "sharc: '", name, "' was read after sharc released its gathered value: this tensor "
      "is a reference to the full parameter kept past its last use (for example "
      "`module.weight.detach()` stored in a forward hook). Keep a copy instead "
      "(`module.weight.detach().clone()` inside forward), or read the parameter again "
      "where you need it (on every rank: outside forward it is gathered on access)"));
}

at::Tensor ShardedParam::wire_view(int64_t elements) {
  c10::Storage storage = base.storage();
  storage.set_nbytes(elements * static_cast<int64_t>(base.element_size()));
  at::Tensor wire = at::empty({0}, base.options());
  wire.set_(storage, 0, {elements}, {1});
  return wire;
}

void ShardedParam::compact_rows(int64_t world, int64_t row, int64_t header) {
  at::Tensor wire = wire_view(world * (row + header));
  const int64_t size = static_cast<int64_t>(base.element_size());
  for (int64_t r = 1; r < world; ++r) {
    if (wire.is_cpu()) {  // rows overlap their destinations: memmove
      auto* data = static_cast<char*>(wire.mutable_data_ptr());
      std::memmove(data + r * row * size, data + r * (row + header) * size,
                   static_cast<size_t>(row * size));
    } else {
      wire.narrow(0, r * row, row).copy_(wire.narrow(0, r * (row + header), row).clone());
    }
  }
  wire.storage().set_nbytes(full_bytes());
}

void ShardedParam::retype_base(c10::ScalarType dtype) {
  if (base.scalar_type() == dtype) return;
  // The storage is attached directly, not by set_(): set_ reads the data
  // pointer, which after a release raises the released-read error above
  // (a parameter gathered fp32 by one graph and bf16 by the next).
  at::Tensor retyped = at::empty({0}, base.options().dtype(dtype));
  retyped.unsafeGetTensorImpl()->set_storage_keep_dtype(base.storage());
  retyped.unsafeGetTensorImpl()->set_sizes_contiguous({layout.padded_numel()});
  base = retyped;
}

Runtime::Runtime(const std::string& group_name) : comm_(group_name) {}

namespace {
// This rank's slice of `full`, flattened and zero-padded as `layout` says.
at::Tensor cut_shard(const at::Tensor& full, const ShardLayout& layout) {
  at::Tensor shard = at::zeros({layout.shard_numel()}, full.options());
  if (layout.valid_numel() > 0) {
    shard.narrow(0, 0, layout.valid_numel())
        .copy_(full.reshape({-1}).narrow(0, layout.shard_offset(), layout.valid_numel()));
  }
  return shard;
}
}  // namespace

int64_t Runtime::register_param(const at::Tensor& full, std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto layout =
      ShardLayout::make(full.numel(), comm_.world_size(), comm_.rank());
  return add_param_locked(std::move(name), full.sizes().vec(), layout,
                          cut_shard(full.detach(), layout));
}

int64_t Runtime::register_empty(std::vector<int64_t> shape, c10::ScalarType dtype,
                                c10::Device device, std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  SHARC_CHECK(device.type() != c10::DeviceType::Meta, "sharc: '", name,
              "' cannot have its shard on the meta device; name a real device "
              "(ShardConfig(device=...))");
  const auto layout = ShardLayout::make(c10::multiply_integers(shape), comm_.world_size(),
                                        comm_.rank());
  // Zeros, not empty: the padding must read as zero (the layout's promise,
  // which checkpoints and gradient norms rely on) before any value arrives.
  at::Tensor shard = at::zeros({layout.shard_numel()}, at::dtype(dtype).device(device));
  return add_param_locked(std::move(name), std::move(shape), layout, std::move(shard));
}

int64_t Runtime::add_param_locked(std::string name, std::vector<int64_t> shape,
                                  ShardLayout layout, at::Tensor shard) {
  // The shard lives in a storage with room for a collective header after
  // it: a gather in the shard's own dtype sends [shard | header] straight
  // from there, with no copy and nothing allocated (see input_for_gather).
  const int64_t n = shard.numel();
  at::Tensor roomy = at::empty({n + header_elements(shard.scalar_type())}, shard.options());
  roomy.narrow(0, 0, n).copy_(shard);
  shard = roomy.narrow(0, 0, n);
  accounting_.add_shard(shard.numel() * static_cast<int64_t>(shard.element_size()));
  params_.push_back(std::make_unique<ShardedParam>(std::move(name), std::move(shape),
                                                   layout, std::move(shard)));
  return static_cast<int64_t>(params_.size()) - 1;
}

at::Tensor Runtime::shard(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).shard;
}

void Runtime::set_parameter(int64_t id, const at::Tensor& parameter) {
  std::lock_guard<std::mutex> lock(mutex_);
  ShardedParam& p = param(id);
  SHARC_CHECK(parameter.storage().is_alias_of(p.shard.storage()), "sharc: the parameter given "
              "for '", p.name, "' is not made of its shard");
  p.parameter = c10::weak_intrusive_ptr<c10::TensorImpl>(parameter.getIntrusivePtr());
}

void Runtime::load_full(int64_t id, const at::Tensor& full) {
  std::lock_guard<std::mutex> lock(mutex_);
  ShardedParam& p = param(id);
  SHARC_CHECK(full.sizes().vec() == p.shape, "sharc: cannot load a tensor of shape ",
              full.sizes(), " into '", p.name, "' of shape ", c10::IntArrayRef(p.shape));
  at::NoGradGuard no_grad;
  p.shard.copy_(cut_shard(full.detach().to(p.shard.options()), p.layout));
}

ShardedParam& Runtime::param(int64_t id) {
  SHARC_CHECK(id >= 0 && id < static_cast<int64_t>(params_.size()),
              "sharc: no parameter with id ", id, " in group '",
              comm_.group_name(), "' (", params_.size(), " registered)");
  return *params_[id];
}

bool Runtime::needs_gather(const ShardedParam& p, c10::ScalarType dtype) const {
  const ParamState s = p.state.state();
  if (s == ParamState::Sharded || s == ParamState::Released) return true;
  SHARC_CHECK(s != ParamState::Gathering || !p.shard_changed(),
              "sharc: '", p.name, "' is read from a gather that started before its shard last "
              "changed (an optimizer step or a write to the shard ran while the gather was in "
              "flight), so it would hold the old values. This is a sharc bug (a prefetch left "
              "in flight past the end of its pass): please report it");
  const bool other_dtype = p.base.scalar_type() != dtype;
  if (s == ParamState::Gathered && p.state.holds() == 0) return other_dtype || p.is_stale();
  SHARC_CHECK(!other_dtype, "sharc: '", p.name, "' is requested in ", dtype, " while it is ",
              s == ParamState::Gathering ? "being gathered" : "held", " in ",
              p.base.scalar_type(), "; one parameter is gathered in one dtype at a time "
              "(read it in one dtype within a forward, or cast the gathered value)");
  return false;
}

void Runtime::claim_buffer_locked(ShardedParam& p, c10::ScalarType dtype) {
  c10::Storage storage = p.base.storage();
  if (p.state.state() == ParamState::Gathered) {
    p.state.begin_refresh();  // persistent: gathered again into the buffer it keeps
    if (p.base.scalar_type() == dtype) return;
    accounting_.on_freed(p.full_bytes());  // ... unless the buffer's dtype changes
    p.free_base();
  } else {
    p.state.begin_gather();
  }
  p.retype_base(dtype);
  // Room for every rank's collective header beyond the padded bytes: a
  // single parameter is gathered in place (see compact_rows).
  allocate_storage(storage, p.full_bytes() + comm_.world_size() * kHeaderBytes);
  storage.set_nbytes(p.full_bytes());
  accounting_.on_gathered(p.full_bytes());
}

// The cast happens here, on the shard: the collective sends `dtype`'s bytes.
// Each rank's row ends with its collective header; the ranks agree on the
// collective before anything is claimed (a divergence leaves them as they
// were).
void Runtime::start_gather_locked(const std::vector<int64_t>& ids, c10::ScalarType dtype) {
  RECORD_FUNCTION("sharc::start_gather", std::vector<c10::IValue>());
  const int64_t world = comm_.world_size();
  auto gather = std::make_shared<GatherInFlight>();
  gather->ids = ids;
  for (int64_t id : ids) {
    const ShardedParam& p = param(id);
    // Before anything reads its (emptied) shard: [Note: retired parameters].
    SHARC_CHECK(!p.retired, "sharc: '", p.name, "' was given back when its nn.Parameter was "
                "deleted (its model and optimizer are gone), so it cannot be gathered; keep "
                "the model alive while its forward or backward runs");
    gather->offsets.push_back(gather->row);
    gather->row += p.layout.shard_numel();
  }
  const int64_t row = gather->row;
  std::optional<CollectiveAgreement::Issue> issue;
  at::Tensor input;
  if (row > 0) {  // else zero-size parameters only: nothing to send
    gather->header = header_elements(dtype);
    input = input_for_gather(*gather, dtype);
    const WireShape shape{WireShape::kAllGather, static_cast<int64_t>(dtype), row + gather->header};
    issue = agree_locked(kAllGather, ids, shape, input.device());
    write_header(input.narrow(0, row, gather->header), issue->header);
  }
  for (int64_t id : ids) {
    ShardedParam& p = param(id);
    claim_buffer_locked(p, dtype);
    p.gathered_version = p.shard._version();
    p.written_unseen = false;
    p.pending = gather;
  }
  if (!issue) return;
  const int64_t wire_numel = world * (row + gather->header);
  if (ids.size() > 1) {
    gather->staging = at::empty({wire_numel}, input.options());
    accounting_.on_gathered(world * row * static_cast<int64_t>(input.element_size()));
    gather->wire = gather->staging;
  } else {
    gather->wire = param(ids[0]).wire_view(wire_numel);
  }
  gather->seq = issue->seq;
  unsettled_gathers_[issue->seq] = gather;
  gather->on_cpu = input.is_cpu();
  gather->work = comm_.all_gather(gather->wire, input);
  accounting_.on_allgather_sent((world - 1) * row * static_cast<int64_t>(input.element_size()));
  accounting_.on_header_sent((world - 1) * gather->header *
                             static_cast<int64_t>(input.element_size()));
}

at::Tensor Runtime::input_for_gather(const GatherInFlight& gather, c10::ScalarType dtype) {
  const at::Tensor& first = param(gather.ids[0]).shard;
  const int64_t numel = gather.row + gather.header;
  if (gather.ids.size() == 1 && first.scalar_type() == dtype) {
    // The room add_param_locked left after the shard, if it is still there.
    const c10::Storage& storage = first.storage();
    const int64_t end = (first.storage_offset() + numel) * static_cast<int64_t>(first.element_size());
    if (first.is_contiguous() && static_cast<int64_t>(storage.nbytes()) >= end) {
      at::Tensor input = at::empty({0}, first.options());
      input.set_(storage, first.storage_offset(), {numel}, {1});
      return input;
    }
  }
  // One multi-tensor copy (one kernel on a GPU, casting as it copies)
  // rather than a copy per member.
  at::Tensor input = at::empty({numel}, first.options().dtype(dtype));
  std::vector<at::Tensor> targets;
  std::vector<at::Tensor> shards;
  for (size_t i = 0; i < gather.ids.size(); ++i) {
    const ShardedParam& p = param(gather.ids[i]);
    targets.push_back(input.narrow(0, gather.offsets[i], p.layout.shard_numel()));
    shards.push_back(p.shard.detach());
  }
  at::_foreach_copy_(targets, shards);
  return input;
}

void Runtime::finish_gather_locked(GatherInFlight& gather) {
  RECORD_FUNCTION("sharc::wait_gather", std::vector<c10::IValue>());
  if (gather.work && gather.on_cpu) {
    settle_before_locked(gather.seq, /*gathers_only=*/true);  // [Note: settle in order]
  }
  if (gather.work) {
    int64_t ns = 0;
    try {
      ns = timed_wait(*gather.work);
    } catch (const std::exception&) {
      explain_failed_wait_locked(gather.seq);  // [Note: settle in order]
      throw;
    }
    accounting_.on_gather_wait(ns);
    if (gather.on_cpu) release_waited(gather.work);  // frees the (cast) shard sent here
  }
  gather.work.reset();
  const bool sent = gather.wire.defined();
  const int64_t world = comm_.world_size();
  std::optional<Verdict> verdict;
  CollectiveHeader mine;
  if (sent && !settled_or_arriving(gather.seq)) {
    unsettled_gathers_.erase(gather.seq);
    if (settles_on_arrival(gather.wire)) {  // read before the rows move
      arriving_.emplace(gather.seq,
                        ArrivingHeaders{HeaderReadback(header_rows(gather.wire, world)), false});
    } else {
      const auto rows = read_headers(gather.wire, world);
      mine = rows.at(static_cast<size_t>(comm_.rank()));
      verdict = agreement_.settle(gather.seq, rows, comm_.rank());
    }
  }
  if (gather.staging.defined()) copy_out_of_staging(gather);
  for (size_t i = 0; i < gather.ids.size(); ++i) {
    ShardedParam& p = param(gather.ids[i]);
    if (sent && !gather.staging.defined()) p.compact_rows(world, gather.row, gather.header);
    p.state.finish_gather();
    p.pending.reset();
  }
  if (gather.staging.defined()) {
    accounting_.on_freed(world * gather.row * static_cast<int64_t>(gather.staging.element_size()));
    gather.staging = at::Tensor();
  }
  gather.wire = at::Tensor();
  if (verdict && verdict->kind != Verdict::kAgree) diverged_locked(*verdict, mine);
}

// A bucket's rows hold each rank's slice of every member, then its header:
// one split copy moves them all (one kernel on a GPU, where a copy per
// member cost a launch each), the header columns into a scratch tensor.
void Runtime::copy_out_of_staging(const GatherInFlight& gather) {
  const int64_t world = comm_.world_size();
  std::vector<at::Tensor> outs;
  std::vector<int64_t> widths;
  for (int64_t id : gather.ids) {
    ShardedParam& p = param(id);
    widths.push_back(p.layout.shard_numel());
    outs.push_back(p.base.view({world, widths.back()}));
  }
  widths.push_back(gather.header);
  outs.push_back(at::empty({world, gather.header}, gather.staging.options()));
  at::split_with_sizes_copy_out(outs, gather.staging.view({world, -1}), widths, /*dim=*/1);
}

void Runtime::start_gather(const std::vector<int64_t>& ids,
                           std::optional<c10::ScalarType> dtype) {
  std::lock_guard<std::mutex> lock(mutex_);
  start_gathers_locked(ids, dtype);
}

void Runtime::start_gathers_locked(const std::vector<int64_t>& ids,
                                   std::optional<c10::ScalarType> dtype) {
  // Those needing a gather, grouped by dtype in first-seen order: a
  // collective carries one dtype. Each once: a graph's prefetch point may
  // start several recorded steps that read one parameter (a tied weight read
  // in two graphs after it), and needs_gather sees none of them started yet.
  std::vector<std::pair<c10::ScalarType, std::vector<int64_t>>> by_dtype;
  std::unordered_set<int64_t> seen;
  for (int64_t id : ids) {
    if (!seen.insert(id).second) continue;
    const ShardedParam& p = param(id);
    const c10::ScalarType want = dtype.value_or(p.spec.gather_dtype);
    if (!needs_gather(p, want)) continue;
    auto group = std::find_if(by_dtype.begin(), by_dtype.end(),
                              [&](const auto& g) { return g.first == want; });
    if (group == by_dtype.end()) group = by_dtype.insert(by_dtype.end(), {want, {}});
    group->second.push_back(id);
  }
  for (const auto& [want, group] : by_dtype) start_gather_locked(group, want);
}

std::vector<at::Tensor> Runtime::wait_gather(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> fulls;
  for (int64_t id : ids) {
    ShardedParam& p = param(id);
    SHARC_CHECK(p.state.state() != ParamState::Sharded &&
                p.state.state() != ParamState::Released,
                "sharc: waiting on '", p.name, "', whose gather was never started");
    if (p.state.state() == ParamState::Gathering) {
      std::shared_ptr<GatherInFlight> gather = p.pending;  // outlives the resets inside
      finish_gather_locked(*gather);
    }
    p.state.acquire();
    fulls.push_back(hand_out(p));
  }
  return fulls;
}

at::Tensor Runtime::gather(int64_t id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ShardedParam& p = param(id);
    if (needs_gather(p, p.spec.gather_dtype)) start_gather_locked({id}, p.spec.gather_dtype);
  }
  return wait_gather({id})[0];
}

at::Tensor Runtime::read_full(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  RECORD_FUNCTION("sharc::read_full", std::vector<c10::IValue>());
  ShardedParam& p = param(id);
  const int64_t world = comm_.world_size();
  const int64_t width = p.layout.shard_numel();
  if (width == 0) return at::empty(p.shape, p.shard.options());
  const int64_t header = header_elements(p.shard.scalar_type());
  at::Tensor input = at::empty({width + header}, p.shard.options());
  input.narrow(0, 0, width).copy_(p.shard.detach());
  const WireShape shape{WireShape::kAllGather, static_cast<int64_t>(p.shard.scalar_type()),
                        width + header};
  const auto issue = agree_locked(kFullRead, {id}, shape, input.device());
  write_header(input.narrow(0, width, header), issue.header);
  at::Tensor wire = at::empty({world * (width + header)}, p.shard.options());
  const int64_t padded_bytes = p.layout.padded_numel() * static_cast<int64_t>(p.shard.element_size());
  accounting_.on_gathered(padded_bytes);
  wait_and_release(comm_.all_gather(wire, input));
  accounting_.on_allgather_sent((world - 1) * static_cast<int64_t>(p.shard.nbytes()));
  accounting_.on_header_sent((world - 1) * header * static_cast<int64_t>(p.shard.element_size()));
  accounting_.on_freed(padded_bytes);
  settle_read_locked(issue.seq, wire);
  // The true-shape value, owning its storage (headers and padding dropped).
  return wire.view({world, width + header}).narrow(1, 0, width).reshape({-1})
      .narrow(0, 0, p.layout.numel).clone().view(p.shape);
}

namespace {

constexpr std::pair<ReleaseMode, const char*> kReleaseModeNames[] = {
    {ReleaseMode::kFree, "free"},
    {ReleaseMode::kFreeOrHandOver, "free_or_hand_over"},
    {ReleaseMode::kHandOver, "hand_over"},
};

}  // namespace

ReleaseMode release_mode_from_name(const std::string& name) {
  std::string valid;
  for (const auto& [mode, mode_name] : kReleaseModeNames) {
    if (name == mode_name) return mode;
    valid += std::string(valid.empty() ? "'" : ", '") + mode_name + "'";
  }
  throw Error(detail::concat("sharc: unknown release mode '", name, "'; the modes are ", valid));
}

bool Runtime::release(int64_t id, ReleaseMode mode) {
  std::lock_guard<std::mutex> lock(mutex_);
  RECORD_FUNCTION("sharc::release", std::vector<c10::IValue>());
  ShardedParam& p = param(id);
  switch (mode) {
    case ReleaseMode::kFree:
      if (p.state.release()) {
        p.free_base();
        accounting_.on_freed(p.full_bytes());
        p.handed_out.clear();
      }
      return false;
    case ReleaseMode::kFreeOrHandOver: {
      // Checks per release, nothing on any operator's path.
      const bool written = p.take_in_place_write();
      const bool handed_over = p.state.release() && finish_release_locked(p);
      SHARC_CHECK(!written, in_place_write_error(p));
      return handed_over;
    }
    case ReleaseMode::kHandOver: {
      const bool written = p.take_in_place_write();
      const bool last = p.state.release();
      if (last) {
        accounting_.on_freed(p.full_bytes());
        p.handed_out.clear();
        p.renew_base();
      }
      SHARC_CHECK(!written, in_place_write_error(p));
      return last;
    }
  }
  throw Error(detail::concat("sharc: unknown release mode ", static_cast<int64_t>(mode)));
}

bool Runtime::finish_release_locked(ShardedParam& p) {
  accounting_.on_freed(p.full_bytes());  // no longer the runtime's, either way
  const bool kept = std::any_of(p.handed_out.begin(), p.handed_out.end(),
                                [](const auto& out) { return out.tensor.use_count() > 0; });
  p.handed_out.clear();
  if (kept) {
    p.renew_base();
    return true;
  }
  p.free_base();
  return false;
}

void Runtime::write_rows(const ShardedParam& p, const at::Tensor& flat_grad,
                         at::Tensor rows) const {
  const int64_t n = p.layout.numel;
  SHARC_CHECK(flat_grad.numel() == n, "sharc: gradient of '", p.name, "' has ",
              flat_grad.numel(), " elements, expected ", n);
  // Row r is rank r's shard: elements [r * width, (r + 1) * width) of the
  // padded flat gradient, the padding (at the end) zero.
  const int64_t width = p.layout.shard_numel();
  if (width == 0) return;
  const int64_t full_rows = n / width;
  const int64_t rest = n - full_rows * width;
  at::Tensor flat = flat_grad.reshape({-1});
  rows.narrow(0, 0, full_rows).copy_(flat.narrow(0, 0, full_rows * width).view({full_rows, width}));
  if (full_rows == rows.size(0)) return;
  at::Tensor partial = rows.select(0, full_rows);
  partial.narrow(0, 0, rest).copy_(flat.narrow(0, full_rows * width, rest));
  partial.narrow(0, rest, width - rest).zero_();
  rows.narrow(0, full_rows + 1, rows.size(0) - full_rows - 1).zero_();
}

void Runtime::write_gradient_columns(at::Tensor input, const std::vector<int64_t>& ids,
                                     const std::vector<at::Tensor>& full_grads) {
  // Gradients that fill their rows, in the input's dtype and with nothing
  // held back to add, are viewed as rows and copied by one concatenation
  // per run of them (one kernel on a GPU, where a copy per member cost a
  // launch each). Any other is written on its own as it comes, so that no
  // cast, sum or padded copy of a gradient outlives its own write (a
  // bucket's worth of them at once would raise the peak).
  const int64_t world = comm_.world_size();
  std::vector<at::Tensor> run;
  int64_t run_start = 0;
  int64_t column = 0;
  auto copy_run = [&] {
    if (run.empty()) return;
    at::Tensor target = input.narrow(1, run_start, column - run_start);
    if (run.size() == 1) {
      target.copy_(run[0]);
    } else {
      at::cat_out(target, run, /*dim=*/1);
    }
    run.clear();
  };
  for (size_t i = 0; i < ids.size(); ++i) {
    ShardedParam& p = param(ids[i]);
    const int64_t width = p.layout.shard_numel();
    const at::Tensor& grad = full_grads[i];
    const bool as_is = grad.scalar_type() == input.scalar_type() && !p.unreduced.defined() &&
                       grad.numel() == p.layout.numel && p.layout.padded_numel() == p.layout.numel;
    if (as_is) {
      if (run.empty()) run_start = column;
      run.push_back(grad.reshape({world, width}));
    } else {
      copy_run();
      write_rows(p, take_unreduced(p, grad, input.scalar_type()), input.narrow(1, column, width));
    }
    column += width;
  }
  copy_run();
}

at::Tensor Runtime::nonfinite_flag(const at::Tensor& grid) {
  // Exact and cheap: a sum is finite only if every element is. On the host a
  // plain sum settles it unless it overflowed, which the element-wise check
  // then tells apart; on a device, reading the sum back would make the host
  // wait, so x * 0 (NaN exactly where x is not finite) is summed instead.
  if (grid.numel() == 0) return at::zeros({1, 1}, grid.options());
  if (grid.is_cpu()) {
    const bool finite = std::isfinite(grid.sum().item<double>());
    const bool any = !finite && !at::isfinite(grid).all().item<bool>();
    return at::full({1, 1}, any ? 1.0 : 0.0, grid.options());
  }
  return grid.mul(0).sum().isnan().view({1, 1});
}

at::Tensor Runtime::reduce_scatter(int64_t id, const at::Tensor& full_grad) {
  return wait_reduce_scatter(start_reduce_scatter({id}, {full_grad}))[0];
}

int64_t Runtime::start_reduce_scatter(const std::vector<int64_t>& ids,
                                      const std::vector<at::Tensor>& full_grads) {
  SHARC_CHECK(ids.size() == full_grads.size() && !ids.empty(),
              "sharc: start_reduce_scatter got ", ids.size(), " parameters and ",
              full_grads.size(), " gradients");
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<bool> held;
  for (int64_t id : ids) held.push_back(!gradient_sync_ || param(id).deferred);
  return start_reduce_scatter_locked(ids, full_grads, held);
}

// One collective for the gradients not held back; held ones go to their
// parameters' buffers and come back as zero shard gradients, so every rank
// still sees the same start and wait calls.
int64_t Runtime::start_reduce_scatter_locked(const std::vector<int64_t>& ids,
                                             const std::vector<at::Tensor>& full_grads,
                                             const std::vector<bool>& held,
                                             const std::vector<bool>& used) {
  RECORD_FUNCTION("sharc::start_reduce_scatter", std::vector<c10::IValue>());
  sweep_held_resets_locked();  // [Note: gradients held by no_sync]
  const int64_t world = comm_.world_size();
  PendingReduction pending;
  // One collective in the widest reduce dtype of the bucket; each result is
  // cast to its parameter's grad dtype when waited.
  c10::ScalarType bucket_dtype = param(ids[0]).spec.reduce_dtype;
  for (int64_t id : ids) {
    bucket_dtype = c10::promoteTypes(bucket_dtype, param(id).spec.reduce_dtype);
  }
  // Rank-major input: row r holds rank r's slice of every gradient, then
  // one column saying whether this rank's gradients hold a non-finite value,
  // so every rank learns it (see wait_reduce_scatter). Each gradient is
  // copied once, straight into its columns; the input is kept alive with
  // the work, since the collective reads (and with gloo overwrites) it.
  int64_t columns = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    ShardedParam& p = param(ids[i]);
    pending.widths.push_back(p.layout.shard_numel());
    pending.dtypes.push_back(p.spec.grad_dtype);
    pending.held.push_back(held[i]);
    pending.ids.push_back(ids[i]);
    if (!held[i]) columns += p.layout.shard_numel();
  }
  const at::TensorOptions options = full_grads[0].options().dtype(bucket_dtype);
  const int64_t token = next_reduction_token_++;
  if (std::all_of(held.begin(), held.end(), [](bool h) { return h; })) {  // nothing to send
    for (size_t i = 0; i < ids.size(); ++i) hold_unreduced(param(ids[i]), full_grads[i]);
    pending.out = at::empty({0}, options);
  } else {
    // Then the collective header's bits, summed over the ranks (see
    // [Note: collective agreement]); agreed on before any gradient moves.
    // Then, for a gather unit, whether this rank used each member
    // ([Note: used by no rank]).
    const int64_t marks = used.empty() ? 0 : static_cast<int64_t>(ids.size());
    const int64_t row = columns + marks + 1 + CollectiveHeader::kBits;
    const WireShape shape{WireShape::kAllToAll, static_cast<int64_t>(bucket_dtype), world * row};
    const auto issue = agree_locked(kReduceScatter, ids, shape, options.device());
    at::Tensor input = at::empty({world, row}, options);
    write_header_bits(input.narrow(1, columns + marks + 1, CollectiveHeader::kBits),
                      issue.header);
    if (marks > 0) {
      std::vector<double> mine(used.begin(), used.end());
      input.narrow(1, columns, marks)
          .copy_(at::tensor(mine, at::TensorOptions().dtype(at::kDouble)).view({1, marks})
                     .expand({world, marks}));
    }
    std::vector<int64_t> sent;
    std::vector<at::Tensor> sent_grads;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (held[i]) {
        hold_unreduced(param(ids[i]), full_grads[i]);
        continue;
      }
      sent.push_back(ids[i]);
      sent_grads.push_back(full_grads[i]);
    }
    queue_reduce_held_back_locked();  // [Note: held back to the end]
    write_gradient_columns(input, sent, sent_grads);
    at::Tensor flag = nonfinite_flag(input.narrow(1, 0, columns));
    input.narrow(1, columns + marks, 1).copy_(flag.expand({world, 1}));
    pending.input = input.view({-1});
    pending.wire = at::empty({row}, options);
    pending.out = pending.wire.narrow(0, 0, columns + marks + 1);
    pending.used_columns = marks;
    pending.seq = issue.seq;
    unsettled_reductions_[issue.seq] = token;
    // On the host (flat sharding) the shard columns stay unsummed until
    // the wait sums them straight into the shard gradients; the replicas'
    // all-reduce and a device take the summed bucket.
    const int64_t summed_from = replicate_ || !input.is_cpu() ? 0 : columns;
    pending.work = comm_.reduce_scatter_sum(pending.wire, pending.input, summed_from);
    accounting_.on_reduce_scatter_sent((world - 1) * static_cast<int64_t>(pending.out.nbytes()));
    accounting_.on_header_sent((world - 1) * CollectiveHeader::kBits *
                               static_cast<int64_t>(pending.out.element_size()));
  }
  reductions_.emplace(token, std::move(pending));
  return token;
}

void Runtime::finish_reduce_scatter(int64_t token) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = reductions_.find(token);
    SHARC_CHECK(token >= 0 && token < next_reduction_token_, "sharc: no reduce-scatter has "
                "token ", token, " in group '", comm_.group_name(), "' (", next_reduction_token_,
                " handed out); wait on the token start_reduce_scatter returned");
    SHARC_CHECK(it != reductions_.end(), "sharc: the reduce-scatter of token ", token,
                " in group '", comm_.group_name(), "' was waited on already; each reduction "
                "is waited on once");
    work = it->second.work;
    // [Note: settle in order]: this wait blocks the host.
    if (work && it->second.wire.is_cpu()) {
      settle_before_locked(it->second.seq, /*gathers_only=*/true);
    }
  }
  if (!work) return;  // finished already (start_replicate_all_reduce), or nothing sent
  int64_t ns = 0;
  try {
    ns = timed_wait(*work);  // outside the lock: backward runs on
  } catch (const std::exception&) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = reductions_.find(token); it != reductions_.end()) {
      explain_failed_wait_locked(it->second.seq);  // [Note: settle in order]
    }
    throw;
  }
  at::Tensor rows = Communicator::take_unsummed_rows(*work);
  work.reset();
  std::lock_guard<std::mutex> lock(mutex_);
  accounting_.on_reduce_wait(ns);
  auto it = reductions_.find(token);
  SHARC_CHECK(it != reductions_.end(), "sharc: the reduce-scatter of token ", token,
              " was waited on by two threads at once");
  // Kept before anything may return: the rows are handed over once, and a
  // reduction without them would read an unsummed bucket.
  if (rows.defined() && !it->second.rows.defined()) it->second.rows = std::move(rows);
  if (!it->second.work) return;
  settle_reduction_locked(it->second);  // may raise: the ranks diverged
  // Its input goes with the work; `out` (a view of the wire) stays.
  release_waited(it->second.work);
  it->second.work.reset();
  it->second.input = at::Tensor();
}

void Runtime::start_replicate_all_reduce(int64_t token) {
  finish_reduce_scatter(token);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = reductions_.find(token);
  SHARC_CHECK(it != reductions_.end(), "sharc: the reduce-scatter of token ", token,
              " in group '", comm_.group_name(), "' was waited on already");
  if (!it->second.replicated) replicate_locked(it->second);
}

void Runtime::replicate_locked(PendingReduction& pending) {
  pending.replicated = true;
  sweep_held_resets_locked();  // [Note: gradients held by no_sync]
  if (!replicate_ || pending.seq < 0) return;  // flat sharding, or nothing was sent
  const at::Tensor sums = pending.out;  // undivided shard sums, used marks, the flag's sum
  const int64_t flag_at = sums.numel() - 1;
  if (!replicate_sync_) pending.unused = unused_members(pending);
  int64_t offset = 0;
  for (size_t i = 0; i < pending.ids.size(); ++i) {
    if (pending.held[i]) continue;
    ShardedParam& p = param(pending.ids[i]);
    const int64_t width = pending.widths[i];
    at::Tensor mine = sums.narrow(0, offset, width);
    offset += width;
    if (!replicate_sync_) {  // defer_replicate: kept for the next synced all-reduce
      // A unit member no rank of the shard group used keeps nothing, so
      // that the synced reduction's marks still tell it apart.
      if (!pending.unused.empty() && pending.unused[i]) {
        pending.held[i] = true;  // no part in this all-reduce; drop_unused empties it
        continue;
      }
      queue_record_held_locked();
      at::Tensor held = at::cat({mine, sums.narrow(0, flag_at, 1)});
      if (p.unreplicated.defined()) {
        p.unreplicated.add_(held.to(p.unreplicated.scalar_type()));
      } else {
        p.unreplicated = held;
        unreplicated_bytes_ += static_cast<int64_t>(held.nbytes());
      }
      pending.held[i] = true;
      continue;
    }
    if (!p.unreplicated.defined()) continue;
    const at::Tensor before = p.unreplicated.to(sums.scalar_type());
    mine.add_(before.narrow(0, 0, width));
    sums.narrow(0, flag_at, 1).add_(before.narrow(0, width, 1));
    unreplicated_bytes_ -= static_cast<int64_t>(p.unreplicated.nbytes());
    p.unreplicated = at::Tensor();
  }
  if (!replicate_sync_) {
    pending.out = at::empty({0}, sums.options());  // every shard gradient comes back zero
    return;
  }
  pending.replicate_seq = replicate_->start(pending.ids, sums, verify_schedule_);
}

std::vector<at::Tensor> Runtime::wait_reduce_scatter(int64_t token,
                                                      const std::vector<at::Tensor>& into) {
  RECORD_FUNCTION("sharc::wait_reduce_scatter", std::vector<c10::IValue>());
  finish_reduce_scatter(token);
  c10::intrusive_ptr<c10d::Work> all_reduce;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = reductions_.find(token);
    SHARC_CHECK(it != reductions_.end(), "sharc: the reduce-scatter of token ", token,
                " was waited on by two threads at once");
    if (!it->second.replicated) replicate_locked(it->second);
    if (it->second.replicate_seq >= 0) all_reduce = replicate_->work(it->second.replicate_seq);
    // [Note: settle in order]: this wait blocks the host.
    if (all_reduce && it->second.out.is_cpu()) replicate_->settle_before(it->second.replicate_seq);
  }
  const int64_t ns = all_reduce ? timed_wait(*all_reduce) : 0;  // outside the lock
  all_reduce.reset();
  PendingReduction pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    accounting_.on_reduce_wait(ns);
    auto it = reductions_.find(token);
    SHARC_CHECK(it != reductions_.end(), "sharc: the reduce-scatter of token ", token,
                " was waited on by two threads at once");
    pending = std::move(it->second);
    reductions_.erase(it);
    if (pending.replicate_seq >= 0) {  // may raise: the replicas diverged
      pending.out = replicate_->finish(pending.replicate_seq);
      pending.replicas = replicate_->world_size();
    }
  }
  // Read before the division, which may poison the whole bucket NaN.
  if (pending.unused.empty()) pending.unused = unused_members(pending);
  // Each shard gradient gets storage of its own (or the caller's): compilers
  // assume a kernel's outputs are separate, aligned buffers.
  std::vector<at::Tensor> shards;
  std::vector<at::Tensor> sent;
  std::vector<int64_t> sent_widths;
  for (size_t i = 0; i < pending.widths.size(); ++i) {
    const at::TensorOptions options = pending.out.options().dtype(pending.dtypes[i]);
    if (pending.held[i]) {
      shards.push_back(at::zeros({pending.widths[i]}, options));
      continue;
    }
    const bool given = i < into.size() && into[i].defined();
    shards.push_back(given ? into[i] : at::empty({pending.widths[i]}, options));
    sent.push_back(shards.back());
    sent_widths.push_back(pending.widths[i]);
  }
  // Averaged over every rank that summed into it: the shard group, times
  // the replicas where the all-reduce ran (so hybrid averages as flat does;
  // in a 16-bit dtype the host's flat path rounds once, after the division,
  // the summed bucket's path after the sum and again after it).
  const int64_t divisor = comm_.world_size() * pending.replicas;
  if (pending.rows.defined()) {
    sum_rows_into_shards(pending, sent, sent_widths, divisor);
  } else {
    divide_sums_into_shards(pending.out, sent, sent_widths, divisor);
  }
  drop_unused(pending.unused, shards);
  return shards;
}

// [Note: used by no rank]
// A gather unit's reduction takes every member whenever the unit ran, with
// zeros from a rank whose backward gave a member nothing (the ranks route
// differently, yet must send alike). A member that no rank gave a gradient
// (an expert no rank's tokens chose) would get a zero gradient where one
// process training the whole batch leaves `.grad` None, and a stateful
// optimizer (momentum, Adam, weight decay) would move it. So each rank also
// sends, per member, whether it had a gradient for it; the sums come back
// to every rank alike, and a member used by none gets no gradient (an
// undefined tensor, which add_into_grad skips) on every rank.
//
// Under hybrid sharding the marks travel with the shard sums through the
// replicas' all-reduce, so they count every rank of the mesh. Where
// defer_replicate keeps the sums back for a later all-reduce, a member no
// rank of the shard group used keeps nothing back (its `unreplicated`
// stays undefined), so the synced reduction's marks, which count a held
// sum as use, still find it unused if no micro-batch on any replica used
// it.
std::vector<bool> Runtime::unused_members(const PendingReduction& pending) {
  if (pending.used_columns == 0) return {};
  const int64_t at = pending.out.numel() - 1 - pending.used_columns;
  // Read on the host (the sums may sit on a device): a few values, once per
  // unit reduction at the end of backward.
  const at::Tensor sums = pending.out.narrow(0, at, pending.used_columns)
                              .to(at::TensorOptions().device(at::kCPU).dtype(at::kDouble));
  const double* used = sums.data_ptr<double>();
  std::vector<bool> unused;
  for (int64_t i = 0; i < pending.used_columns; ++i) unused.push_back(!(used[i] > 0));
  return unused;
}

void Runtime::drop_unused(const std::vector<bool>& unused, std::vector<at::Tensor>& shards) {
  for (size_t i = 0; i < unused.size() && i < shards.size(); ++i) {
    if (unused[i]) shards[i] = at::Tensor();
  }
}

// A non-finite gradient on any rank makes every rank's shard gradients
// NaN: an inf that lands in one rank's shard would otherwise let a loss
// scaler skip the step there and take it elsewhere, and the ranks' models
// would part. (Without sharding every rank would see the inf.) The flag
// is the sums' last column.
void Runtime::divide_sums_into_shards(const at::Tensor& sums, const std::vector<at::Tensor>& shards,
                                      const std::vector<int64_t>& widths, int64_t divisor) {
  if (shards.empty()) return;
  at::Tensor out = sums.div_(divisor);
  // Poisoned once, over the whole bucket (one kernel, not one per member).
  // On the host the flag is read first: a masked fill is a pass over every
  // reduced element each step (1.5 ms a step on the small benchmark GPT),
  // for a flag that is almost never set.
  at::Tensor flag = out.narrow(0, out.numel() - 1, 1);
  if (!out.is_cpu()) {
    out.masked_fill_(flag.gt(0), std::numeric_limits<double>::quiet_NaN());
  } else if (flag.item<double>() > 0) {
    out.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  copy_out_of_sums(out, shards, widths);
}

// The host's all-to-all left the W rows that arrived: each shard gradient
// is their sum, divided, in one pass ([Note: reduce-scatter on CPU]), in
// place of a sum into the bucket, a division and a copy out of it.
void Runtime::sum_rows_into_shards(const PendingReduction& pending,
                                   const std::vector<at::Tensor>& shards,
                                   const std::vector<int64_t>& widths, int64_t divisor) {
  if (shards.empty()) return;
  const bool poisoned = pending.out.narrow(0, pending.out.numel() - 1, 1).item<double>() > 0;
  int64_t offset = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    at::Tensor shard = shards[i];
    if (poisoned) {
      shard.fill_(std::numeric_limits<double>::quiet_NaN());
    } else {
      sum_rows_divided(shard, pending.rows.narrow(1, offset, widths[i]), divisor);
    }
    offset += widths[i];
  }
}

// One split copy (one kernel on a GPU) where the shard gradients keep the
// reduced dtype, else a cast per member.
void Runtime::copy_out_of_sums(const at::Tensor& sums, const std::vector<at::Tensor>& shards,
                               const std::vector<int64_t>& widths) {
  if (shards.empty()) return;
  const int64_t total = std::accumulate(widths.begin(), widths.end(), int64_t{0});
  const bool same_dtype = std::all_of(shards.begin(), shards.end(), [&](const at::Tensor& s) {
    return s.scalar_type() == sums.scalar_type();
  });
  if (same_dtype) {
    at::split_with_sizes_copy_out(shards, sums.narrow(0, 0, total), widths, /*dim=*/0);
    return;
  }
  int64_t offset = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    shards[i].copy_(sums.narrow(0, offset, widths[i]));
    offset += widths[i];
  }
}

at::Tensor Runtime::take_unreduced(ShardedParam& p, const at::Tensor& grad,
                                   c10::ScalarType dtype) {
  at::Tensor flat = grad.reshape({-1}).to(dtype);
  if (!p.unreduced.defined()) return flat;
  flat = flat + p.unreduced.to(dtype);
  accounting_.on_unreduced(-static_cast<int64_t>(p.unreduced.nbytes()));
  p.unreduced = at::Tensor();
  return flat;
}

void Runtime::add_into_grad(const at::Tensor& param, const at::Tensor& grad) {
  if (!grad.defined()) return;  // [Note: used by no rank]
  at::NoGradGuard no_grad;
  at::Tensor& current = param.mutable_grad();
  if (current.defined()) {
    current.add_(grad);
  } else {
    current = grad;
  }
}

void Runtime::hold_unreduced(ShardedParam& p, const at::Tensor& grad) {
  SHARC_CHECK(grad.numel() == p.layout.numel, "sharc: gradient of '", p.name, "' has ",
              grad.numel(), " elements, expected ", p.layout.numel);
  at::NoGradGuard no_grad;
  queue_record_held_locked();
  // Summed in the wider of the reduce and grad dtypes: micro-batches add up
  // before any rounding to a small reduce dtype.
  const c10::ScalarType dtype = c10::promoteTypes(p.spec.reduce_dtype, p.spec.grad_dtype);
  at::Tensor flat = grad.detach().reshape({-1}).to(dtype);
  if (p.unreduced.defined()) {
    p.unreduced.add_(flat);
    return;
  }
  p.unreduced = flat.clone();
  accounting_.on_unreduced(static_cast<int64_t>(p.unreduced.nbytes()));
}

void Runtime::set_replicate_group(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(mutex_);
  SHARC_CHECK(!replicate_, "sharc: group '", comm_.group_name(), "' already all-reduces over "
              "replicate group '", replicate_ ? replicate_->group_name() : "", "'; a shard group "
              "has one replicate group for its life");
  SHARC_CHECK(reductions_.empty(), "sharc: set the replicate group before any reduction");
  replicate_ = std::make_unique<ReplicateGroup>(group_name);
  replicate_->set_settle_on_arrival(settle_on_arrival_);
}

int64_t Runtime::replicate_size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return replicate_ ? replicate_->world_size() : 1;
}

void Runtime::set_replicate_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  replicate_sync_ = sync;
}

void Runtime::set_gradient_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  gradient_sync_ = sync;
}

void Runtime::set_deferred_reduction(int64_t id, bool deferred) {
  std::lock_guard<std::mutex> lock(mutex_);
  param(id).deferred = deferred;
}

bool Runtime::reduction_deferred(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).deferred;
}

int64_t Runtime::flush_unit(const std::vector<int64_t>& ids) {
  RECORD_FUNCTION("sharc::flush_unit", std::vector<c10::IValue>());
  SHARC_CHECK(!ids.empty(), "sharc: flush_unit needs at least one parameter");
  std::lock_guard<std::mutex> lock(mutex_);
  sweep_held_resets_locked();  // [Note: gradients held by no_sync]
  // What backward held back, taken over as it is; zeros where nothing was.
  std::vector<at::Tensor> grads;
  std::vector<bool> used;
  for (int64_t id : ids) {
    ShardedParam& p = param(id);
    used.push_back(p.unreduced.defined() || p.unreplicated.defined());
    if (p.unreduced.defined()) {
      accounting_.on_unreduced(-static_cast<int64_t>(p.unreduced.nbytes()));
      grads.push_back(std::move(p.unreduced));
      p.unreduced = at::Tensor();
    } else {
      grads.push_back(at::zeros({p.layout.numel}, p.shard.options().dtype(p.spec.reduce_dtype)));
    }
  }
  return start_reduce_scatter_locked(ids, grads, std::vector<bool>(ids.size(), false), used);
}

// [Note: held back to the end]
// no_sync holds each full gradient back (`unreduced`; with replicate_only,
// the shard sums in `unreplicated`) and the synced backward's reduction of
// a parameter takes what was held. A parameter the last micro-batch does
// not use (a branch taken earlier only) gets no reduction in that backward,
// so what it held would be left out of this step and added into a later
// one. So a synced reduction that finds anything held queues a call at the
// end of its backward (the autograd graph task), after every reduction of
// that backward started, where every parameter still holding something is
// reduced in one collective (zeros where only the shard sums wait, whose
// all-reduce then carries them), in parameter order. A gather unit's full
// gradients are left to the unit's own reduction, which takes all of its
// members whenever the unit ran. The set is rank-invariant when the ranks
// ran the same code under no_sync; where they did not, the collective
// agreement names the difference.
void Runtime::queue_reduce_held_back_locked() {
  if (!gradient_sync_ || !replicate_sync_) return;
  if (accounting_.stats().unreduced_grad_bytes == 0 && unreplicated_bytes_ == 0) return;
  queue_once_per_backward_locked(held_back_task_, &Runtime::reduce_held_back);
}

bool Runtime::queue_once_per_backward_locked(int64_t& queued_task, void (Runtime::*callback)()) {
  const int64_t task = torch::autograd::get_current_graph_task_id();
  if (task == -1) return false;  // outside backward
  if (task == queued_task) return true;
  c10::weak_intrusive_ptr<Runtime> weak = weak_self();
  try {
    torch::autograd::Engine::get_default_engine().queue_callback([weak, callback] {
      if (auto runtime = weak.lock()) ((*runtime).*callback)();
    });
  } catch (const c10::Error&) {
    return false;
  }
  queued_task = task;
  return true;
}

void Runtime::reduce_held_back() {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!gradient_sync_ || !replicate_sync_) return;
    sweep_held_resets_locked();  // [Note: gradients held by no_sync]
    for (size_t id = 0; id < params_.size(); ++id) {
      const ShardedParam& p = *params_[id];
      if ((p.unreduced.defined() && !p.deferred) || p.unreplicated.defined()) {
        ids.push_back(static_cast<int64_t>(id));
      }
    }
  }
  if (ids.empty()) return;
  const std::vector<at::Tensor> grads = wait_reduce_scatter(flush_unit(ids));
  std::vector<at::Tensor> targets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t id : ids) targets.push_back(grad_owner(param(id)));
  }
  for (size_t i = 0; i < ids.size(); ++i) add_into_grad(targets[i], grads[i]);
}

at::Tensor Runtime::hand_out(ShardedParam& p) {
  // A plain tensor over the base storage (not an autograd view of `base`):
  // it stays a true-shape alias whose bytes vanish when the base is freed.
  at::Tensor view = at::empty({0}, p.base.options());
  view.set_(p.base.storage(), 0, p.shape, c10::contiguous_strides(p.shape));
  // Dead ones are dropped here (a persistent parameter is handed out every
  // step and never released), but a written one stays until a release
  // reports it.
  auto dead = [](const ShardedParam::HandedOut& out) {
    return out.tensor.expired() &&
           (!out.counter.enabled() || out.counter.current_version() == out.version);
  };
  p.handed_out.erase(std::remove_if(p.handed_out.begin(), p.handed_out.end(), dead),
                     p.handed_out.end());
  const c10::VariableVersion& counter = view.unsafeGetTensorImpl()->version_counter();
  p.handed_out.push_back({c10::weak_intrusive_ptr<c10::TensorImpl>(view.getIntrusivePtr()),
                          counter, counter.enabled() ? counter.current_version() : 0});
  return view;
}

void Runtime::check_shard(int64_t id, const at::Tensor& shard) {
  std::lock_guard<std::mutex> lock(mutex_);
  ShardedParam& p = param(id);
  // [Note: a saved shard copied by the user's hooks]
  // In backward, a graph's re-gather reads the shard autograd unpacked from
  // the forward's saved tensors, and saved-tensor hooks of the user's
  // (torch.autograd.graph.save_on_cpu off the CPU, an offloader, a pack
  // that clones) hand back a copy of it there, not the registered shard.
  // The runtime gathers its registered shard, whose values the copy holds,
  // so there a copy of its size and dtype passes; anything else means the
  // hooks changed it.
  if (torch::autograd::get_current_graph_task_id() != -1 &&
      !shard.storage().is_alias_of(p.shard.storage())) {
    SHARC_CHECK(shard.numel() == p.shard.numel() && shard.scalar_type() == p.shard.scalar_type(),
                "sharc: in backward, the shard of '", p.name, "' (id ", id,
                ") came back from the forward's saved tensors as ", shard.numel(),
                " elements of ", shard.scalar_type(), ", not the ", p.shard.numel(),
                " elements of ", p.shard.scalar_type(), " saved: a saved_tensors_hooks "
                "unpack must return what its pack was given (same size and dtype), and "
                "the shard's .data must not be replaced between forward and backward "
                "(write into it in place instead)");
    return;
  }
  SHARC_CHECK(shard.storage().is_alias_of(p.shard.storage()), "sharc: the tensor passed "
              "as the shard of '", p.name, "' (id ", id, ", group '", comm_.group_name(),
              "') is not the shard sharc registered. Either the module was sharded on a "
              "process group that has since been destroyed (shard the module again on the "
              "current group), or the shard's .data was replaced (`p.data = t`, as "
              "torch.nn.utils.vector_to_parameters does; write into it in place instead: "
              "`with torch.no_grad(): p.copy_(t)`, or copy full values inside "
              "sharc.unsharded(model, writeback=True))");
  // The tensor a forward reads is the one its backward accumulates into:
  // the user's parameter. In backward, a graph's re-gather reads what
  // autograd unpacked from the saved tensors, a stand-in sharing its
  // storage, which .grad of would go nowhere.
  if (shard.requires_grad() && torch::autograd::get_current_graph_task_id() == -1) {
    p.read_as_shard = c10::weak_intrusive_ptr<c10::TensorImpl>(shard.getIntrusivePtr());
  }
}

void Runtime::set_spec(int64_t id, c10::ScalarType gather_dtype, c10::ScalarType reduce_dtype,
                       c10::ScalarType grad_dtype) {
  std::lock_guard<std::mutex> lock(mutex_);
  ShardedParam& p = param(id);
  const GatherSpec spec{gather_dtype, reduce_dtype, grad_dtype};
  spec.check(p.shard.scalar_type(), p.name);
  SHARC_CHECK(p.state.state() == ParamState::Sharded || p.state.state() == ParamState::Released,
              "sharc: cannot change how '", p.name, "' is gathered while it is ",
              to_string(p.state.state()));
  p.spec = spec;
}

GatherSpec Runtime::spec(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).spec;
}

std::vector<int64_t> Runtime::drop_unheld(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  return drop_unheld_locked(ids);
}

std::vector<int64_t> Runtime::drop_unheld_locked(const std::vector<int64_t>& ids) {
  std::vector<int64_t> dropped;
  for (int64_t id : ids) {
    ShardedParam& p = param(id);
    const ParamState s = p.state.state();
    const bool unheld = (s == ParamState::Gathering) ||
                        (s == ParamState::Gathered && p.state.holds() == 0);
    if (!unheld || p.state.persistent()) continue;
    if (s == ParamState::Gathering) {
      std::shared_ptr<GatherInFlight> gather = p.pending;  // outlives the resets inside
      finish_gather_locked(*gather);
    }
    free_gathered_locked(p);
    dropped.push_back(id);
  }
  return dropped;
}

void Runtime::free_gathered_locked(ShardedParam& p) {
  p.state.acquire();  // the state machine frees through the last hold
  p.state.release();
  p.free_base();
  accounting_.on_freed(p.full_bytes());
  p.handed_out.clear();
}

// [Note: retired parameters]
// A deleted model (and its optimizer) leaves nothing that can read its
// shards again: the nn.Parameter made of a shard is what every path reads
// through (forward, the optimizer, autograd's leaf, a compiled graph's
// input, the eager saved-tensor handles, which keep it alive), so its death
// retires the parameter here: a Python finalizer notes it, and the next
// shard() or memory_stats() calls this (_retired.py: a finalizer may run
// where this runtime holds its lock). Its shard and,
// for a persistent parameter, its gathered buffer are given back, and
// memory_stats() stops counting them. The record stays, its shard empty, so
// ids stay dense. One with work still in flight (a gather, no_sync sums, a
// hold) is left as it is: nothing is freed under a collective.
bool Runtime::retire(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (id < 0 || id >= static_cast<int64_t>(params_.size())) return false;  // another group's
  ShardedParam& p = *params_[id];
  if (p.retired || p.pending || p.unreduced.defined() || p.unreplicated.defined()) return false;
  const ParamState s = p.state.state();
  if (s == ParamState::Gathered) {
    if (p.state.holds() != 0) return false;
    p.state.set_persistent(false);
    free_gathered_locked(p);
  } else if (s != ParamState::Sharded && s != ParamState::Released) {
    return false;
  }
  accounting_.remove_shard(p.shard.numel() * static_cast<int64_t>(p.shard.element_size()));
  p.shard = at::empty({0}, p.shard.options());
  p.handed_out.clear();
  p.retired = true;
  return true;
}

void Runtime::set_persistent(int64_t id, bool persistent) {
  std::lock_guard<std::mutex> lock(mutex_);
  param(id).state.set_persistent(persistent);
}

bool Runtime::is_persistent(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).state.persistent();
}

bool Runtime::shard_changed_since_gather(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).shard_changed();
}

void Runtime::note_shards_written(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  // An id this runtime lacks: a shard of a destroyed group whose name a new
  // group took (its runtime is another one); nothing of it is gathered here.
  for (int64_t id : ids) {
    if (id >= 0 && id < static_cast<int64_t>(params_.size())) param(id).written_unseen = true;
  }
}

std::vector<std::tuple<int64_t, int64_t>> Runtime::persistent_params() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::tuple<int64_t, int64_t>> out;
  for (size_t id = 0; id < params_.size(); ++id) {
    const ShardedParam& p = *params_[id];
    if (!p.state.persistent()) continue;
    out.emplace_back(static_cast<int64_t>(id),
                     p.layout.padded_numel() * c10::elementSize(p.spec.gather_dtype));
  }
  return out;
}

at::Tensor Runtime::padded_base(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).base;
}

at::Tensor Runtime::meta_full(int64_t id, c10::ScalarType dtype) {
  std::lock_guard<std::mutex> lock(mutex_);
  const ShardedParam& p = param(id);
  return at::empty(p.shape, p.shard.options().device(c10::kMeta).dtype(dtype));
}

std::string Runtime::state(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return to_string(param(id).state.state());
}

std::string Runtime::name(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).name;
}

std::vector<int64_t> Runtime::shape(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).shape;
}

ShardLayout Runtime::layout(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return param(id).layout;
}

c10::Dict<std::string, int64_t> Runtime::stats() {
  // Before the runtime's lock: the eager scope may call into the runtime
  // under its own.
  const std::set<int64_t> kept_for_backward = eager_scope_.kept_for_backward();
  std::lock_guard<std::mutex> lock(mutex_);
  const MemoryStats& s = accounting_.stats();
  c10::Dict<std::string, int64_t> out;
  out.insert("shard_bytes", s.shard_bytes);
  out.insert("gathered_bytes", s.gathered_bytes);
  out.insert("peak_gathered_bytes", s.peak_gathered_bytes);
  out.insert("allgather_bytes", s.allgather_bytes);
  out.insert("reduce_scatter_bytes", s.reduce_scatter_bytes);
  out.insert("allgather_calls", s.allgather_calls);
  out.insert("reduce_scatter_calls", s.reduce_scatter_calls);
  out.insert("unreduced_grad_bytes", s.unreduced_grad_bytes);
  out.insert("gather_wait_ns", s.gather_wait_ns);
  out.insert("reduce_wait_ns", s.reduce_wait_ns);
  out.insert("graph_prefetch_calls", s.graph_prefetch_calls);
  out.insert("late_reductions", s.late_reductions);
  out.insert("late_grads_in_place", s.late_grads_in_place);
  // What stays gathered by design: persistent parameters, between steps,
  // and the tied parameters and small gather units the eager forward kept
  // for backward (until their backward; [Note: eager holds]). And the room
  // for collective headers that shard_bytes and gathered_bytes leave out:
  // one header after each shard (add_param_locked), one per rank in each
  // gathered buffer (claim_buffer_locked).
  int64_t kept = 0, headers = 0;
  for (size_t id = 0; id < params_.size(); ++id) {
    const auto& p = params_[id];
    if (p->retired) continue;  // its shard's header went with it
    headers += kHeaderBytes;
    const ParamState s = p->state.state();
    if (s == ParamState::Sharded || s == ParamState::Released) continue;
    const bool kept_for_pass = kept_for_backward.count(static_cast<int64_t>(id)) > 0;
    if (p->state.persistent() || kept_for_pass) kept += p->full_bytes();
    headers += comm_.world_size() * kHeaderBytes;
  }
  out.insert("kept_gathered_bytes", kept);
  out.insert("header_bytes", headers);
  out.insert("header_sent_bytes", s.header_sent_bytes);
  out.insert("agreement_calls", s.agreement_calls);
  // Hybrid sharding: the replicate group's all-reduces, counted apart
  // from the shard group's collectives above.
  out.insert("replicate_size", replicate_ ? replicate_->world_size() : 1);
  out.insert("all_reduce_bytes", replicate_ ? replicate_->sent_bytes() : 0);
  out.insert("all_reduce_calls", replicate_ ? replicate_->calls() : 0);
  out.insert("all_reduce_header_bytes", replicate_ ? replicate_->header_bytes() : 0);
  out.insert("unreplicated_grad_bytes", unreplicated_bytes_);
  return out;
}

std::vector<double> Runtime::collective_costs() {
  // Not under mutex_: the collectives may pass through Python dispatch
  // modes that call back into this runtime.
  std::lock_guard<std::mutex> measuring(costs_mutex_);
  if (!costs_) {
    c10::Device device(c10::kCPU);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!params_.empty()) device = params_.front()->shard.device();
    }
    costs_ = measure_collective_costs(comm_, device);
  }
  return {costs_->all_gather.latency_us, costs_->all_gather.us_per_byte,
          costs_->reduce_scatter.latency_us, costs_->reduce_scatter.us_per_byte};
}

void Runtime::reset_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  accounting_.reset();
  if (replicate_) replicate_->reset_stats();
}

}  // namespace sharc

namespace sharc {

at::Tensor Runtime::token_tensor(int64_t token, const at::TensorOptions& options) {
  at::Tensor t = at::empty({1}, options.dtype(at::kLong));
  std::lock_guard<std::mutex> lock(mutex_);
  token_tensors_[t.const_data_ptr()] = token;  // a stale entry at a reused address is replaced
  return t;
}

int64_t Runtime::take_token(const at::Tensor& token_tensor) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = token_tensor.numel() == 1 ? token_tensors_.find(token_tensor.const_data_ptr())
                                      : token_tensors_.end();
  SHARC_CHECK(it != token_tensors_.end(), "sharc: wait_reduce_scatter takes the token tensor "
              "start_reduce_scatter returned, once; this one names no reduction in flight in "
              "group '", comm_.group_name(), "'");
  const int64_t token = it->second;
  token_tensors_.erase(it);
  return token;
}

}  // namespace sharc

