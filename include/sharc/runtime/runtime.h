#pragma once
// sharc's per-process-group state: the registry of sharded parameters, their
// gathered buffers, and the byte accounting.
//
// One Runtime exists per process group in a process. It is owned through
// c10::intrusive_ptr, reaches Python as torch.classes.sharc.Runtime, and the
// torch.ops.sharc operators find it by the group's name (RuntimeTable).

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/Dict.h>
#include <torch/custom_class.h>

#include "sharc/core/accounting.h"
#include "sharc/core/collective_agreement.h"
#include "sharc/core/gather_order.h"
#include "sharc/runtime/collective_probe.h"
#include "sharc/runtime/communicator.h"
#include "sharc/runtime/eager_prefetch.h"
#include "sharc/runtime/eager_reduction.h"
#include "sharc/runtime/eager_scope.h"
#include "sharc/runtime/forward_dataflow.h"
#include "sharc/core/layout.h"
#include "sharc/core/param_state.h"
#include "sharc/runtime/gather_spec.h"
#include "sharc/runtime/header_readback.h"
#include "sharc/runtime/replicate_group.h"

namespace sharc {

/// One all-gather collective in flight, serving one parameter or several
/// (a bucket, all in one dtype). A single parameter is gathered straight into
/// its own buffer; a bucket's cast shards are concatenated, gathered into
/// one rank-major staging buffer and copied out into each parameter's
/// buffer when waited.
struct GatherInFlight {
  c10::intrusive_ptr<c10d::Work> work;  ///< null when there was nothing to send
  at::Tensor staging;            ///< buckets only: world_size rows of the shards
  /// What the collective writes: each rank's row (the shards, then the
  /// rank's collective header: see [Note: collective agreement]).
  at::Tensor wire;
  int64_t seq = -1;              ///< its number in the group's agreed sequence
  int64_t row = 0;               ///< elements of shards in each rank's row
  int64_t header = 0;            ///< elements of header after them
  std::vector<int64_t> ids;      ///< parameters served, in staging order
  std::vector<int64_t> offsets;  ///< each one's column offset within a row
  bool on_cpu = false;           ///< sent from host memory (see release_waited)
};

/// A reduce-scatter in flight, found by the token start_reduce_scatter
/// handed out: its padded input, its output and the shard widths of the
/// parameters it serves, in order.
struct PendingReduction {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor input;
  at::Tensor out;   ///< the shard gradients, then the non-finite flag
  at::Tensor wire;  ///< what the collective writes: `out`, then the header's bit sums
  /// Once waited, where the host's all-to-all left the shard columns
  /// unsummed ([W, columns]; see Communicator::reduce_scatter_sum): the
  /// rows, summed straight into the shard gradients. Undefined where `out`
  /// holds the sums.
  at::Tensor rows;
  int64_t seq = -1; ///< its number in the group's agreed sequence
  std::vector<int64_t> widths;
  std::vector<c10::ScalarType> dtypes;  ///< each parameter's reduce dtype
  std::vector<bool> held;  ///< held back (no_sync, unit): no part in the collective
  std::vector<int64_t> ids;  ///< the parameters served, in order
  /// Hybrid sharding: whether the replicate step was taken (the all-reduce
  /// started, or the sums held back by defer_replicate), and the
  /// all-reduce's seq in the replicate group (-1: none in flight).
  bool replicated = false;
  int64_t replicate_seq = -1;
  /// Replicas whose sum `out` holds (1 until the all-reduce delivered).
  int64_t replicas = 1;
  /// A unit's reduction: one column per parameter after the shard columns,
  /// summed over the ranks (and the replicas), saying whether any rank had
  /// a gradient for it (see [Note: used by no rank]). 0: none sent.
  int64_t used_columns = 0;
  /// Read from those columns before the sums are divided (or, where
  /// defer_replicate keeps them back, before they leave `out`): the
  /// members no rank used.
  std::vector<bool> unused;
};

/// One sharded parameter: its true shape, layout, shard and gathered buffer.
struct ShardedParam {
  ShardedParam(std::string name, std::vector<int64_t> shape, ShardLayout layout,
               at::Tensor shard);

  std::string name;
  std::vector<int64_t> shape;  ///< true (unsharded) shape
  ShardLayout layout;
  at::Tensor shard;  ///< this rank's flat shard (the user's nn.Parameter)
  /// Padded flat buffer in the dtype of its last gather; one storage for the
  /// parameter's life, holding 0 bytes unless gathered.
  at::Tensor base;
  ParamStateMachine state;
  std::shared_ptr<GatherInFlight> pending;  ///< the gather in flight, if any
  int64_t gathered_version = -1;  ///< the shard's version counter when gathered
  /// The shard was written where its version counter does not show it
  /// (CPU's fused optimizer kernels, writes through `.data`), as an
  /// optimizer step reports (Runtime::note_shards_written); cleared when a
  /// gather starts.
  bool written_unseen = false;
  GatherSpec spec;
  /// Flat full gradient summed over no_sync micro-batches, not yet reduced.
  at::Tensor unreduced;
  /// A full tensor handed out since the buffer was gathered, weakly, with
  /// its version counter (shared by its views and detached aliases, and
  /// kept beyond the tensor) and the counter's value then: a tensor still
  /// alive at the last release was kept by someone (a view of it keeps it
  /// alive too, through its base); a counter that moved, however short the
  /// tensor's life, counts a write in place.
  struct HandedOut {
    c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
    c10::VariableVersion counter;
    uint32_t version;
  };
  std::vector<HandedOut> handed_out;
  /// Hybrid sharding, defer_replicate: the shard gradient sums (undivided,
  /// then the non-finite flag's sum) reduce-scattered in the shard group
  /// and not yet all-reduced over the replicate group.
  at::Tensor unreplicated;
  /// The tensor the last gather outside backward read as this shard
  /// (check_shard), weakly: the user's parameter, whose .grad a late
  /// reduction adds into ([Note: late reduction waits]).
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> read_as_shard;
  /// The nn.Parameter made of `shard` (set_parameter), weakly.
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> parameter;
  /// In a gather unit: its gradient always waits in `unreduced` until the
  /// unit's reduction (flush_unit), never reduced on its own.
  bool deferred = false;
  /// Its nn.Parameter died: the shard and any buffer are given back
  /// (Runtime::retire, [Note: retired parameters]).
  bool retired = false;
  /// The .grad of the user's parameter when the last backward that held a
  /// sum here ended ([Note: gradients held by no_sync]): a .grad set to
  /// None or replaced by hand since then drops the held sum.
  struct HeldBeside {
    bool recorded = false;
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> grad;
  };
  HeldBeside held_beside;

  /// A persistent parameter kept gathered from a shard that has changed since.
  bool is_stale() const;
  /// Whether the shard was written (an optimizer step, a write under
  /// no_grad) since its last gather started: a buffer gathered or held
  /// since then has the old values.
  bool shard_changed() const;

  /// Bytes of the padded buffer in its current dtype.
  int64_t full_bytes() const;
  /// Whether a handed-out tensor was written in place since it was handed
  /// out; forgets the write (it is reported once).
  bool take_in_place_write();
  /// A flat tensor of `elements` elements of the base's dtype over its
  /// storage, which claim_buffer_locked allocated with room for a
  /// collective's headers beyond the padded bytes: what a single
  /// parameter's all-gather writes before its rows are compacted.
  at::Tensor wire_view(int64_t elements);
  /// Moves rank r's row (`row` elements, followed by `header` more) to
  /// r * row: the padded layout, once the headers were read.
  void compact_rows(int64_t world, int64_t row, int64_t header);
  /// Frees the buffer's bytes in place; a read through any reference
  /// still holding the storage then raises an error naming the parameter.
  void free_base();
  /// A new, empty (0-byte) buffer of its own for `base`.
  void renew_base();
  /// Points `base` at the same storage in `dtype` (the storage's bytes are
  /// the caller's business).
  void retype_base(c10::ScalarType dtype);
};

/// The kinds of compiled graphs. Python reads these numbers from
/// Runtime.graph_kinds() (sharc/_compile/ops.py), so they are written here
/// only.
enum GraphKind : int64_t { kForwardGraph = 0, kBackwardGraph = 1 };

/// What Runtime::release does with a gathered buffer when its last hold
/// goes. Python names them by string (release_mode_from_name).
enum class ReleaseMode : int64_t {
  /// Frees the bytes in place, whoever still references them: the compiled
  /// path's release (the sharc::release op), where a compiler keeps
  /// references until its graph ends. Python: "free".
  kFree = 0,
  /// The eager path's release: frees, unless a handed-out full tensor is
  /// still alive (a gathered weight a user kept, or a view or array of it,
  /// which keeps it alive); then the buffer is handed over to those
  /// references, which stay valid (the values of that gather) and take the
  /// memory with them, and the parameter gets a fresh buffer for its next
  /// gather. (Storage use counts cannot tell: a communication library may
  /// still hold views of a finished collective's output for a while.)
  /// Python: "free_or_hand_over".
  kFreeOrHandOver = 1,
  /// Always hands the buffer over to whatever still references its storage
  /// (freed with the last reference, as any tensor's memory), and the
  /// parameter gets a fresh buffer: for a forward whose saved tensors
  /// another saved-tensor hook pair keeps (activation checkpointing's
  /// recomputation keeps detached aliases, which handed-out tracking cannot
  /// see). Python: "hand_over".
  kHandOver = 2,
};

/// The mode of a Python name ("free", "free_or_hand_over", "hand_over");
/// any other name raises sharc::Error naming the valid ones.
ReleaseMode release_mode_from_name(const std::string& name);

class Runtime : public torch::CustomClassHolder {
 public:
  explicit Runtime(const std::string& group_name);

  /// Registers a parameter from its full value (identical on every rank) and
  /// returns its id. Cuts this rank's padded flat shard (see ShardLayout);
  /// `shard(id)` returns it. Does not communicate.
  int64_t register_param(const at::Tensor& full, std::string name);
  /// Registers a parameter known only by its true shape and dtype (a model
  /// built on the meta device) and returns its id: allocates this rank's
  /// padded flat shard on `device`, zero-filled, and nothing full-size;
  /// its values come later through load_full() or writes to `shard(id)`.
  /// Does not communicate.
  int64_t register_empty(std::vector<int64_t> shape, c10::ScalarType dtype,
                         c10::Device device, std::string name);
  /// This rank's flat shard of a parameter: the tensor that sharc.shard()
  /// wraps as the module's nn.Parameter, so optimizer updates reach gathers.
  at::Tensor shard(int64_t id);
  /// The nn.Parameter sharc.shard() made of shard(id), weakly: whose .grad a
  /// gradient reaches where no forward read the shard (see grad_owner).
  void set_parameter(int64_t id, const at::Tensor& parameter);
  /// Copies this rank's slice of `full` (the true-shape value) into the shard.
  void load_full(int64_t id, const at::Tensor& full);

  /// Blocks until the parameter is gathered in its spec's gather dtype
  /// (starting the gather if none is in flight), takes one hold and returns
  /// the true-shape full view.
  at::Tensor gather(int64_t id);
  /// Non-blocking: starts the all-gather of each of `ids` that is sharded or
  /// released (or persistent with a changed shard or another dtype), in
  /// `dtype` (default: each one's gather dtype): one collective per dtype.
  /// Others are gathered or in flight already and are skipped.
  void start_gather(const std::vector<int64_t>& ids,
                    std::optional<c10::ScalarType> dtype = std::nullopt);
  /// A compiled graph's start_gather: as start_gather(), and a step of its
  /// own in the order of compiled graphs of its kind (see [Note: gather
  /// order] in sharc/core/gather_order.h and [Note: cross-graph prefetch]
  /// in runtime_graph_prefetch.cpp): it takes what was gathered ahead for
  /// it, and a bucket gathered ahead that this gather shows will not be
  /// taken (the other kind of graph, another dtype) is given up (freed,
  /// waiting for its collective first) before it starts.
  /// `graph_kind`: kForwardGraph (or inference) or kBackwardGraph. A
  /// backward graph's gather also queues, once per backward pass, a call
  /// at the pass's end that gives up what was gathered ahead and not taken.
  void start_graph_gather(int64_t graph_kind, const std::vector<int64_t>& ids,
                          c10::ScalarType dtype);
  /// Bytes a compiled graph's point keeps started ahead at most, beyond the
  /// next graph's bucket ([Note: graph prefetch window]).
  static constexpr int64_t kGraphPrefetchWindowBytes = 4 << 20;
  /// A compiled graph reached a point where the next graph's first gather
  /// may start (its prefetch point; `key` names the graph): starts the
  /// gather recorded after this graph's end last time, and those of the
  /// graphs after it within kGraphPrefetchWindowBytes, if the bytes then
  /// gathered stay within `budget_bytes` (the graph's memory budget);
  /// gives up a bucket gathered ahead for a graph that did not come.
  /// `key` (the parameters of the graph's last gather) finds the point.
  /// Non-blocking; issues at most one collective per dtype.
  void prefetch_next_graph(int64_t graph_kind, const std::vector<int64_t>& key,
                           int64_t budget_bytes);
  /// A compiled graph of `graph_kind` was scheduled to gather at most
  /// `bytes` at once: what a point that starts buckets of graphs after the
  /// next must leave room for ([Note: the budget across graphs]).
  void note_graph_peak(int64_t graph_kind, int64_t bytes);
  /// The autograd engine's call at the end of a backward pass that ran a
  /// compiled backward graph (see start_graph_gather) or eager backward
  /// work (EagerScope): the one end-of-backward callback of both paths.
  /// Blocking where gather units reduce.
  void end_backward_pass();
  /// Queues end_backward_pass() with the autograd engine, once a pass
  /// (nothing outside a backward pass).
  void queue_end_of_backward();
  /// An eager forward begins (its outermost scope): outside a backward
  /// pass, no end-of-backward call is pending, even if the last backward
  /// raised before its callbacks ran.
  void begin_eager_forward();
  /// end_backward_pass() calls so far (tests and statistics: one a backward
  /// pass that gathered, eager or compiled).
  int64_t backward_ends();
  /// A compiled forward graph is about to run on `inputs`. Unless one of
  /// them derives from an output of a forward graph of this pass, within
  /// the same step ([Note: forward dataflow]), a new forward pass begins
  /// here: the graph is nobody's follower, and a bucket gathered ahead is
  /// given up. So only graphs that continue a pass's dataflow follow one
  /// another, and nothing gathered ahead stays gathered between two forward
  /// calls. Does not communicate.
  void begin_forward_graph(const std::vector<at::Tensor>& inputs);
  /// The forward graph that ran has returned `outputs` (held weakly, for the
  /// next begin_forward_graph).
  void end_forward_graph(const std::vector<at::Tensor>& outputs);
  /// Blocks until every one of `ids` is gathered, takes one hold on each and
  /// returns their true-shape full views (the compiled path's wait).
  std::vector<at::Tensor> wait_gather(const std::vector<int64_t>& ids);
  /// Blocking: the full value in the master dtype as a tensor of its own,
  /// for reads outside any schedule (checkpoints, the functional all_gather
  /// op): one all-gather of the shard into a fresh buffer, counted as
  /// gathered while it runs. Leaves the parameter's own buffer as it is.
  at::Tensor read_full(int64_t id);
  /// Drops one hold on a gathered parameter; what the last hold does with
  /// the buffer is `mode`'s (see ReleaseMode; persistent parameters keep
  /// theirs). Returns whether the parameter got a fresh buffer because the
  /// old one was handed over to references outside the runtime (never for
  /// kFree). Does not communicate. Raises (after releasing) under
  /// kFreeOrHandOver and kHandOver when a handed-out tensor was written in
  /// place: the write would be lost.
  bool release(int64_t id, ReleaseMode mode);
  /// Blocking: sums the full gradient over the group, divides by the world
  /// size and returns this rank's flat shard of it.
  at::Tensor reduce_scatter(int64_t id, const at::Tensor& full_grad);

  /// Non-blocking: starts one reduce-scatter for several gradients (copied
  /// into a buffer of its own, so the caller may free them). Returns its
  /// token, the id wait_reduce_scatter takes; tokens are handed out in
  /// order and never reused.
  int64_t start_reduce_scatter(const std::vector<int64_t>& ids,
                               const std::vector<at::Tensor>& full_grads);
  /// Blocks until the reduce-scatter of `token` is done and returns each of
  /// its parameters' flat shard gradients (summed, divided by the world
  /// size), in the order they were started. Throws sharc::Error for a token
  /// waited on already or never handed out.
  /// `into`, if given, names per parameter a tensor (flat, the shard's
  /// width and grad dtype, contiguous) the shard gradient is written into
  /// and returned as, overwriting it; an undefined entry gets a new one.
  std::vector<at::Tensor> wait_reduce_scatter(int64_t token,
                                              const std::vector<at::Tensor>& into = {});
  /// A compiled backward graph's wait: as wait_reduce_scatter(), or, where
  /// the reduction may finish after the graph ([Note: late reduction
  /// waits]), zero shard gradients at once, the reduced ones being added
  /// into the parameters' .grad when the reduction is waited: at the end
  /// of the backward pass, or sooner to keep the reductions in flight
  /// within kLateReductionWindowBytes.
  std::vector<at::Tensor> wait_reduce_scatter_in_graph(int64_t token);
  /// Bytes of reductions in flight (their inputs and outputs) that compiled
  /// backward graphs may leave behind them ([Note: late reduction waits]).
  static constexpr int64_t kLateReductionWindowBytes = 4 << 20;
  /// Adds `grad` into `param`'s .grad outside autograd (sets it when it has
  /// none), as the engine's accumulation would: the gradients the runtime
  /// delivers after backward computed them (gather units, late reductions).
  static void add_into_grad(const at::Tensor& param, const at::Tensor& grad);
  /// Waits every reduction a compiled graph left in flight and adds its
  /// shard gradients into their parameters' .grad, oldest first: the
  /// autograd engine's call at the end of a backward pass that left one.
  void deliver_late_reductions();

  /// Hybrid sharding: sums shard gradients over `group_name` (the ranks
  /// holding the same shards) after each reduce-scatter in this group.
  /// Set once, before any reduction; every rank of both groups calls it.
  void set_replicate_group(const std::string& group_name);
  /// The replicate group's size (1 without hybrid sharding).
  int64_t replicate_size();
  /// Non-blocking beyond the reduce-scatter: waits the reduce-scatter of
  /// `token` and starts its all-reduce over the replicate group (a no-op
  /// without one, or when it was started already, or nothing was sent).
  /// wait_reduce_scatter() waits it, starting it first if nobody did.
  void start_replicate_all_reduce(int64_t token);
  /// With replicate sync off (defer_replicate micro-batches), reductions
  /// reduce-scatter in the shard group but skip the all-reduce: the shard
  /// sums wait in a shard-sized buffer per parameter and a zero shard
  /// gradient is returned; the next all-reduce with sync on adds them in.
  void set_replicate_sync(bool sync);

  /// The compiled path's form of a reduction token: a one-element tensor
  /// (on the gradients' device, as compilers expect of an op's output)
  /// whose address names the reduction. Its value is never read: on CUDA,
  /// reading it back would make the host wait for the device.
  at::Tensor token_tensor(int64_t token, const at::TensorOptions& options);
  /// The token a token_tensor() names, forgotten as it is returned; throws
  /// sharc::Error for a tensor that names none (waited already, or not one).
  int64_t take_token(const at::Tensor& token_tensor);

  /// Sets how the parameter is gathered and its gradient reduced and
  /// delivered (see GatherSpec); throws sharc::Error naming it if the spec
  /// does not suit its master dtype.
  void set_spec(int64_t id, c10::ScalarType gather_dtype, c10::ScalarType reduce_dtype,
                c10::ScalarType grad_dtype);
  GatherSpec spec(int64_t id);

  /// With sync off (no_sync micro-batches), reductions send nothing: each
  /// full gradient is added to a buffer of its parameter's and a zero shard
  /// gradient is returned; the next reduction with sync on adds the buffer
  /// in. Trades full-size gradient memory for communication.
  void set_gradient_sync(bool sync);

  /// Marks a parameter as part of a gather unit (see flush_unit).
  void set_deferred_reduction(int64_t id, bool deferred);
  /// Whether `id`'s gradients are held back for its gather unit.
  bool reduction_deferred(int64_t id);
  /// Starts one reduce-scatter of every parameter of a unit, of what its
  /// backward held back or zeros where this rank produced no gradient (a
  /// routed-away expert), so that every rank issues the same collective.
  /// wait_reduce_scatter(token) returns each flat shard gradient,
  /// averaged, in its reduce dtype.
  int64_t flush_unit(const std::vector<int64_t>& ids);

  /// Every collective carries each rank's header and is settled when it
  /// completes (see [Note: collective agreement]): ranks that issue
  /// different collectives all raise, naming what each one issued, and
  /// the group refuses every later collective. With verify on, the ranks
  /// also compare headers in one small all-gather before every collective
  /// (its traffic not counted in stats()), which names the first parameter
  /// where their lists differ and catches a divergence before the
  /// collective instead of when it completes.
  void set_verify_schedule(bool verify);

  /// Where a collective is settled (see header_readback.h): at its wait,
  /// reading its headers back there (the default on the host), or once its
  /// headers have arrived on the host, at the latest before the collective
  /// kLag later is planned (the default on a device, where a read at the
  /// wait would drain the stream). Settling on arrival on the host serves
  /// tests of that path.
  void set_settle_on_arrival(bool on_arrival);

  /// Settles every collective waited on, waiting for the headers still on
  /// their way: raises if the ranks diverged at any of them. Called before
  /// what the step wrote is saved or read out.
  void settle_all();

  /// Frees each of `ids` that is gathered (or in flight, which is waited
  /// for first) with no hold and not persistent: what a prefetch gathered
  /// for a use that did not come. Others are left alone. Returns those
  /// freed. Does not communicate (beyond finishing a collective in flight).
  std::vector<int64_t> drop_unheld(const std::vector<int64_t>& ids);
  /// Gives up (and frees) what `order` gathered ahead if a shard of it
  /// changed since its gather started (an optimizer step between two
  /// passes): it would serve old values.
  void give_up_changed_ahead(GatherOrder& order);

  /// Gives back the shard and any gathered buffer of `id`, whose
  /// nn.Parameter died; false (nothing done) for one with work in flight.
  /// [Note: retired parameters]
  bool retire(int64_t id);

  /// Keep a parameter gathered at zero holds (selective unsharding).
  void set_persistent(int64_t id, bool persistent);
  bool is_persistent(int64_t id);
  /// ShardedParam::shard_changed of `id`.
  bool shard_changed_since_gather(int64_t id);
  /// The shards `ids` were written (an optimizer step ran over them): a
  /// buffer kept gathered from them is stale whatever their version
  /// counters say, and is gathered again at its next read.
  void note_shards_written(const std::vector<int64_t>& ids);
  /// The names of those of `ids` whose gradients no_sync holds back (not
  /// yet reduced into .grad); ids this runtime lacks are skipped. See
  /// [Note: gradients held by no_sync].
  std::vector<std::string> held_back(const std::vector<int64_t>& ids);
  /// Drops what no_sync holds back for `ids` (zero_grad discards it).
  void discard_held_back(const std::vector<int64_t>& ids);
  /// Every persistent parameter's id and full bytes in its gather dtype:
  /// what stays gathered whichever graph runs (the scheduler's budget
  /// counts them in every graph).
  std::vector<std::tuple<int64_t, int64_t>> persistent_params();

  /// The padded flat buffer (its storage holds 0 bytes while not gathered).
  at::Tensor padded_base(int64_t id);
  std::string state(int64_t id);
  /// The parameter's name, as registered (its canonical module path).
  std::string name(int64_t id);
  /// The parameter's true (full) shape.
  std::vector<int64_t> shape(int64_t id);
  /// A meta tensor shaped like parameter `id`'s full value, in `dtype`.
  at::Tensor meta_full(int64_t id, c10::ScalarType dtype);

  c10::Dict<std::string, int64_t> stats();
  void reset_stats();

  /// The eager path's gradient reductions (see [Note: eager reduction]).
  EagerReduction& eager_reduction() { return eager_reduction_; }
  /// The eager path's gathers ahead (see [Note: eager prefetch]).
  EagerPrefetch& eager_prefetch() { return eager_prefetch_; }
  /// The eager path's owner of gathered parameters (see [Note: eager holds]).
  EagerScope& eager_scope() { return eager_scope_; }
  /// A gather unit of root `root` (EagerScope::add_unit): its members are
  /// gathered whole by the unit, on the ranks that enter it, so neither the
  /// eager nor the compiled graphs' gather orders record or start them
  /// ([Note: gather order]). `keep`: kept gathered from its forward to its
  /// backward (EagerScope::exit_unit). Returns the unit's index.
  int64_t add_gather_unit(int64_t root, const std::vector<int64_t>& ids,
                          const std::vector<at::Tensor>& shards, bool keep);

  /// What this group's collectives cost, measured on the first call (a
  /// few small collectives on the parameters' device, the same numbers on
  /// every rank: collective, every rank must call it) and cached: [all-gather
  /// latency µs, all-gather µs per byte, reduce-scatter latency µs,
  /// reduce-scatter µs per byte], bytes being the full tensor's. Not
  /// counted in stats().
  std::vector<double> collective_costs();

  int64_t rank() const { return comm_.rank(); }
  int64_t world_size() const { return comm_.world_size(); }
  const std::string& group_name() const { return comm_.group_name(); }
  bool is_current() const { return comm_.is_current(); }
  /// Whether the process group still exists (sharc holds it weakly).
  bool group_alive() const { return comm_.is_alive(); }
  /// Throws unless `shard` shares storage with parameter `id`'s registered
  /// shard (catches ids from another runtime and replaced `.data`).
  void check_shard(int64_t id, const at::Tensor& shard);
  ShardLayout layout(int64_t id);
  /// A weak reference to this runtime, for callbacks that may outlive it.
  c10::weak_intrusive_ptr<Runtime> weak_self();

 private:
  ShardedParam& param(int64_t id);
  /// Adds a parameter whose shard is cut or allocated already; returns its id.
  int64_t add_param_locked(std::string name, std::vector<int64_t> shape, ShardLayout layout,
                           at::Tensor shard);
  /// The kinds of collective the ranks agree on, by the value in headers.
  enum Collective : int64_t { kAllGather = 0, kReduceScatter = 1, kFullRead = 2 };
  /// Plans the next collective, a `kind` for `ids` of `shape`, with the
  /// other ranks (see [Note: collective agreement]): settles the one
  /// kLag back first, then exchanges headers or sends a decoy where the
  /// plan says. Returns the plan: its seq and this rank's header. Throws
  /// (and marks the group diverged) where the ranks diverged; blocks for a
  /// collective where the plan exchanges or sends a decoy.
  CollectiveAgreement::Issue agree_locked(Collective kind, const std::vector<int64_t>& ids,
                                          const WireShape& shape, c10::Device device);
  /// Settles collective `seq`, finishing it first if it is in flight.
  void settle_locked(int64_t seq);
  /// Settles, in order, every collective numbered below `seq` that is not
  /// settled yet (every gather, for `gathers_only`), before this rank
  /// blocks on `seq` (see [Note: settle in order] in runtime_agreement.cpp).
  void settle_before_locked(int64_t seq, bool gathers_only = false);
  /// The host wait on collective `seq` failed (a rank left): waits for and
  /// settles each earlier reduction that completes, so that a divergence
  /// there is the error raised, not the backend's (see [Note: settle in
  /// order]).
  void explain_failed_wait_locked(int64_t seq);
  /// Whether a collective delivering into `wire` is settled once its
  /// headers arrive (see set_settle_on_arrival).
  bool settles_on_arrival(const at::Tensor& wire) const;
  /// Whether collective `seq` is settled or its headers are on their way.
  bool settled_or_arriving(int64_t seq) const;
  /// Settles collective `seq` from its headers on their way to the host,
  /// waiting for them; nothing if they are not.
  void settle_arriving_locked(int64_t seq);
  /// Settles, in order, the collectives whose headers have arrived.
  void settle_arrived_locked();
  /// settle_all() with the lock held.
  void settle_all_locked();
  /// Settles a reduction from the bit sums in its wire (after its wait).
  void settle_reduction_locked(const PendingReduction& pending);
  /// Settles a full read from the headers in what it gathered.
  void settle_read_locked(int64_t seq, const at::Tensor& wire);
  /// Raises the verdict's error, naming what this rank and the others
  /// issued, and refuses every later collective of the group.
  [[noreturn]] void diverged_locked(const Verdict& verdict, const CollectiveHeader& mine);
  /// The header exchange of an Exchange plan: throws if the ranks differ.
  void exchange_headers_locked(const CollectiveHeader& mine, const std::vector<int64_t>& ids,
                               c10::Device device);
  /// A Decoy plan's decoy of `issue.wire`, carrying this rank's real header.
  Verdict send_decoy_locked(const CollectiveAgreement::Issue& issue, c10::Device device);
  std::string describe(int64_t kind, int64_t count, int64_t first) const;
  /// On divergence: where this rank's parameter list and rank `other`'s
  /// first differ (a collective: every rank calls it with the rows agreed on).
  std::string first_difference_locked(const std::vector<int64_t>& ids, const at::Tensor& rows,
                                      int64_t other, c10::Device device);
  /// Whether `p` must be gathered before a use in `dtype`: sharded or
  /// released, or persistent and stale or in another dtype. Throws if it is
  /// held or in flight in another dtype.
  bool needs_gather(const ShardedParam& p, c10::ScalarType dtype) const;
  /// Gives `p` a buffer of `dtype` bytes (or keeps its persistent one) and
  /// moves it to Gathering.
  void claim_buffer_locked(ShardedParam& p, c10::ScalarType dtype);
  /// start_gather() with the lock held.
  void start_gathers_locked(const std::vector<int64_t>& ids,
                            std::optional<c10::ScalarType> dtype);
  /// The bytes of `ids` in flight or gathered and unheld (started ahead,
  /// not taken yet), each parameter counted once.
  int64_t bytes_gathering_ahead_locked(const std::vector<int64_t>& ids) const;
  /// What a graph's prefetch point starts: the parameters, their bytes,
  /// and per dtype (one collective each) their bytes and count.
  struct StartingAhead {
    std::unordered_set<int64_t> ids;
    std::map<int64_t, std::pair<int64_t, int64_t>> by_dtype;
    /// The parameters' bytes.
    int64_t bytes() const;
    /// The bytes the point's collectives allocate, staging included.
    int64_t allocated() const;
  };
  /// Adds the parameters of `next` not yet in `starting` that need a
  /// gather; false if one is held or in flight in another dtype.
  bool add_ahead_locked(const GatherBucket& next, StartingAhead& starting) const;
  /// The order of compiled graphs of `graph_kind`, and of the other kind.
  GatherOrder& graph_order(int64_t graph_kind);
  GatherOrder& other_graph_order(int64_t graph_kind);
  /// Gives up what each graph order gathered ahead if a shard of it
  /// changed since.
  void give_up_changed_ahead_locked();
  void give_up_changed_ahead_locked(GatherOrder& order);
  /// Queues end_backward_pass() with the autograd engine, once a pass.
  void queue_end_of_backward_locked();
  /// drop_unheld() with the lock held.
  std::vector<int64_t> drop_unheld_locked(const std::vector<int64_t>& ids);
  /// Frees a gathered parameter that nothing holds: through the state
  /// machine's last hold, so its state and the accounting agree.
  void free_gathered_locked(ShardedParam& p);
  /// One collective for `ids`, all needing a gather, in `dtype`.
  void start_gather_locked(const std::vector<int64_t>& ids, c10::ScalarType dtype);
  /// What `gather` sends: its shards in `dtype`, then room for this rank's
  /// header. A single shard in its own dtype is sent in place (a view over
  /// its storage and the room after it); others are copied (and cast).
  at::Tensor input_for_gather(const GatherInFlight& gather, c10::ScalarType dtype);
  void finish_gather_locked(GatherInFlight& gather);
  void copy_out_of_staging(const GatherInFlight& gather);
  /// Writes a full gradient (flat, numel elements) into `rows` (world_size
  /// x shard width, a column block of a reduce-scatter's input) as the
  /// ranks' shards, padding zeroed.
  void write_rows(const ShardedParam& p, const at::Tensor& flat_grad, at::Tensor rows) const;
  /// Writes the full gradients of `ids` (plus what no_sync held back, in
  /// the input's dtype) into the leading columns of a reduce-scatter's
  /// `input`, one block each, in order.
  void write_gradient_columns(at::Tensor input, const std::vector<int64_t>& ids,
                              const std::vector<at::Tensor>& full_grads);
  /// The reduced `sums`' leading columns into `shards` (`widths` each, in
  /// order, each in its own dtype).
  static void copy_out_of_sums(const at::Tensor& sums, const std::vector<at::Tensor>& shards,
                               const std::vector<int64_t>& widths);
  /// The reduced bucket `sums` (the shard columns, then the non-finite
  /// flag's sum) divided by `divisor` into `shards` (`widths` each, in
  /// order), all NaN where the flag is set.
  static void divide_sums_into_shards(const at::Tensor& sums, const std::vector<at::Tensor>& shards,
                                      const std::vector<int64_t>& widths, int64_t divisor);
  /// As divide_sums_into_shards(), from the rows the all-to-all left
  /// unsummed (`pending.rows`), the flag's sum read from `pending.out`.
  static void sum_rows_into_shards(const PendingReduction& pending,
                                   const std::vector<at::Tensor>& shards,
                                   const std::vector<int64_t>& widths, int64_t divisor);
  /// 1 x 1: nonzero (1 or true) if any element of `grid` is not finite.
  static at::Tensor nonfinite_flag(const at::Tensor& grid);
  /// A true-shape tensor over the buffer, recorded in `handed_out`.
  at::Tensor hand_out(ShardedParam& p);
  /// The last hold on `p` is gone: hands its buffer over to a handed-out
  /// tensor still alive (true), or frees it.
  bool finish_release_locked(ShardedParam& p);
  /// The gradient to reduce now: `grad` plus what no_sync held back.
  at::Tensor take_unreduced(ShardedParam& p, const at::Tensor& grad, c10::ScalarType dtype);
  void hold_unreduced(ShardedParam& p, const at::Tensor& grad);
  /// The replicate step of a finished reduce-scatter: holds its sums back
  /// (defer_replicate) or starts the all-reduce with what was held added.
  void replicate_locked(PendingReduction& pending);
  /// Undefines the shard gradients of members no rank had a gradient for.
  static std::vector<bool> unused_members(const PendingReduction& pending);
  static void drop_unused(const std::vector<bool>& unused, std::vector<at::Tensor>& shards);
  /// Waits the reduce-scatter of `token` (outside the lock) and settles it.
  void finish_reduce_scatter(int64_t token);
  /// Starts the collective and returns its token.
  /// `used`, for a unit's reduction: whether this rank has a gradient for
  /// each parameter (empty: not asked).
  int64_t start_reduce_scatter_locked(const std::vector<int64_t>& ids,
                                      const std::vector<at::Tensor>& full_grads,
                                      const std::vector<bool>& held,
                                      const std::vector<bool>& used = {});

  Communicator comm_;
  MemoryAccounting accounting_;
  std::vector<std::unique_ptr<ShardedParam>> params_;
  std::map<int64_t, PendingReduction> reductions_;  ///< in flight, by token
  int64_t next_reduction_token_ = 0;
  std::map<const void*, int64_t> token_tensors_;  ///< token_tensor() addresses
  bool gradient_sync_ = true;
  bool verify_schedule_ = false;
  CollectiveAgreement agreement_;
  /// Hybrid sharding's replicate dimension (null: flat sharding).
  std::unique_ptr<ReplicateGroup> replicate_;
  bool replicate_sync_ = true;
  int64_t unreplicated_bytes_ = 0;  ///< held by defer_replicate, now
  /// Collectives issued and not settled yet, by seq: gathers and reductions
  /// (by token).
  std::map<int64_t, std::weak_ptr<GatherInFlight>> unsettled_gathers_;
  std::map<int64_t, int64_t> unsettled_reductions_;
  /// Collectives waited on whose headers are on their way to the host, by
  /// seq (see header_readback.h): a reduction's bit sums, or a gather's rows.
  struct ArrivingHeaders {
    HeaderReadback headers;
    bool bit_sums;
  };
  std::map<int64_t, ArrivingHeaders> arriving_;
  std::optional<bool> settle_on_arrival_;  ///< unset: on a device only
  /// Set once the ranks diverged: the error every later collective raises.
  std::string diverged_;
  /// The order of compiled graphs of each kind (cross-graph prefetch).
  GatherOrder forward_graphs_;
  GatherOrder backward_graphs_;
  /// The largest scheduled peak of a compiled graph of each kind.
  int64_t forward_graph_peak_ = 0;
  int64_t backward_graph_peak_ = 0;
  int64_t graph_gathers_ = 0;  ///< names each compiled gather a step of its own
  EagerReduction eager_reduction_{*this};
  EagerPrefetch eager_prefetch_{*this};
  EagerScope eager_scope_{*this};
  bool end_of_backward_queued_ = false;
  int64_t backward_ends_ = 0;  ///< end_backward_pass() calls
  /// `zeros`: the storage of the zero shard gradients handed to autograd
  /// in their place, held weakly (a strong hold on a zeros tensor would keep
  /// the engine from taking it as .grad), with each one's version then.
  struct LateReduction {
    int64_t token;
    int64_t bytes;
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> zeros;
    std::vector<int64_t> zero_versions;
  };
  /// The tensors deliver_late() may write reduced values into: a .grad
  /// still the untouched zeros handed out for it.
  std::vector<at::Tensor> untouched_zero_grads(const LateReduction& late,
                                               const std::vector<at::Tensor>& targets) const;
  /// Late reductions ([Note: late reduction waits]), in
  /// runtime_late_reduction.cpp.
  bool may_finish_late_locked(const PendingReduction& pending);
  bool queue_late_delivery_locked();
  void deliver_late(const LateReduction& late);
  std::vector<LateReduction> take_late_reductions();
  /// A forward outside backward: reductions a backward that raised left in
  /// flight are waited and their gradients dropped, as that pass's.
  void drop_late_reductions();
  /// Reductions compiled graphs left in flight, oldest first, with the
  /// bytes each holds; their bytes together; and the autograd graph task
  /// whose end delivers them.
  std::deque<LateReduction> late_reductions_;
  int64_t late_reduction_bytes_ = 0;
  int64_t late_delivery_task_ = -1;
  /// At the end of a synced backward: reduces, in one collective, what
  /// no_sync held back for parameters this backward did not reduce (used
  /// in an earlier micro-batch only), and adds it into their .grad
  /// ([Note: held back to the end], runtime.cpp). Queued, once per
  /// autograd graph task, by a synced reduction that finds anything held.
  void queue_reduce_held_back_locked();
  void reduce_held_back();
  int64_t held_back_task_ = -1;
  /// Queues `callback` at the end of the current autograd graph task, once
  /// per task (`queued_task` remembers the last); false outside backward.
  bool queue_once_per_backward_locked(int64_t& queued_task, void (Runtime::*callback)());
  /// The parameter whose .grad receives `p`'s shard gradient: the tensor
  /// the last forward read as its shard, else the nn.Parameter made of it
  /// (set_parameter), else the registered shard.
  static at::Tensor grad_owner(const ShardedParam& p);
  /// [Note: gradients held by no_sync]: what `p` holds, dropped.
  void drop_held_locked(ShardedParam& p);
  /// Whether `p` holds a sum and its .grad was set to None or replaced
  /// since the backward that held it ended.
  static bool grad_reset_since_held(const ShardedParam& p);
  /// Once per backward, before any held sum is used: drops each sum whose
  /// .grad was reset (grad_reset_since_held), then forgets the records.
  void sweep_held_resets_locked();
  int64_t resets_swept_task_ = -1;
  /// Queues, once per autograd graph task, the record of every holding
  /// parameter's .grad at the task's end (record_held_beside).
  void queue_record_held_locked();
  void record_held_beside();
  int64_t record_held_task_ = -1;
  /// Whether a forward graph continues the pass (begin_forward_graph).
  ForwardDataflow forward_dataflow_;
  std::optional<CollectiveCosts> costs_;  ///< collective_costs(), once measured
  std::mutex costs_mutex_;  ///< guards costs_ (mutex_ is not held while measuring)
  std::mutex mutex_;  // autograd may run backward on a worker thread
};

}  // namespace sharc
