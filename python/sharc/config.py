"""User-facing configuration, validated once."""

import os
from dataclasses import dataclass

import torch

from sharc.mixed_precision import MixedPrecision


@dataclass(kw_only=True, slots=True)
class ShardConfig:
    """How `sharc.shard` shards a module."""

    verify_replicas: bool = True
    """Check at shard() time, with one collective, that every rank holds the
    same parameters (names, shapes, dtypes and a hash of the values). Ranks that
    start from different values would each keep a slice of a different model."""

    keep_gathered: tuple[str, ...] = ()
    """Parameter names (as `named_parameters()` gives them; shell-style
    patterns such as "*.norm*.weight" allowed, each must match one or more)
    that stay gathered once gathered: no release and no re-gather within a step, re-gathered
    only after their shard changes (an optimizer step). Trades memory for
    communication, for small parameters read in many places."""

    gather_units: tuple[str, ...] = ()
    """Module names (as `named_modules()` gives them; shell-style patterns
    such as "layers.*.moe" allowed) whose parameters are gathered, re-gathered
    for backward and reduce-scattered together, as one unit that every rank
    enters, whatever its data does inside. Name each mixture-of-experts layer
    (or any module whose submodules run on some ranks only) here, the module
    that is called, never a container of its parts (`moe`, not the
    ModuleList `moe.experts`: shard() refuses that): see
    docs/design/eager-schedule.md, "Ranks that take different paths"."""

    unit_keep_bytes: int = 1 << 20
    """A gather unit whose parameters take at most this many bytes gathered
    stays gathered from its forward to its backward: one all-gather a step
    instead of two, for that many bytes held through the forward pass
    (counted in memory_stats()["kept_gathered_bytes"]). Latency dominates
    small units' gathers. The choice depends on the unit's size only, so
    every rank makes the same one whatever its routing. 0: every unit is
    released after its forward and gathered again for its backward."""

    verify_schedule: bool = False
    """Ranks that issue different collectives always raise, at the
    collective where they part (each collective carries every rank's
    header: docs/design/collective-agreement.md). With this on, the ranks
    also compare headers before each collective, with one more small
    collective, so a divergence is found before the diverging collective
    and the error names the first parameter where the ranks' lists part.
    For debugging ranks that take different paths (costs one small
    all-gather per collective). Applies to everything sharded on the group."""

    eager_prefetch: bool = True
    """Outside compiled graphs, from the second step on, gather each
    module's parameters as one collective when its first one is read, and
    the next module's (in the previous step's order) right behind it, in
    forward and in backward. Costs up to two modules' gathered parameters
    (and a bucket's staging) instead of one parameter at a time; see
    include/sharc/core/gather_order.h (the runtime decides). Gather units
    are gathered one unit ahead the same way, compiled or not (their hooks
    run eagerly): see [Note: gather units ahead] in
    include/sharc/runtime/eager_prefetch.h."""

    eager_reduce_bucket_bytes: int = 4 << 20
    """Outside compiled graphs, gradients are reduce-scattered
    asynchronously in buckets drawn in forward: a bucket closes at the end
    of the first module's forward that brings it to this many bytes of full
    gradients (in the reduce dtype), so a bucket is one module or a run of
    small neighbouring ones. 0: one bucket per module. Gather units'
    reductions, at the end of backward, are batched by the same size (0:
    one per unit). Larger buckets mean fewer collectives and more gradient
    memory in flight (at most two buckets); see src/runtime/eager_reduction.h."""

    rank_check_timeout_s: float = 120.0
    """How long a rank waits for the others at a call every rank must make
    although it looks local (a parameter read outside forward,
    sharc.full_state_dict, sharc.load_full_state_dict, sharc.unsharded).
    A rank that makes one alone raises after this long, naming the call,
    instead of pairing it with the other ranks' next collective."""

    mixed_precision: MixedPrecision | None = None
    """Gather parameters and reduce gradients in smaller floating dtypes
    while the shards (and the optimizer state) keep the model's dtype; see
    `sharc.MixedPrecision`."""

    device: str | torch.device | None = None
    """Where the shards of a model built on the meta device are allocated
    (only this rank's shards; see sharc.init_weights and
    docs/design/meta-init.md). None: the process group's device, the CPU for
    gloo, the current CUDA device for nccl. A model built on a real device
    keeps its parameters' device, and naming another one here is an error."""

    replicate_groups: tuple[tuple[int, ...], ...] | None = None
    """Hybrid sharding without a DeviceMesh: the replicate groups, as tuples
    of global ranks, e.g. `((0, 2), (1, 3))` for 2 hosts of 2 ranks (ranks
    0, 1 on one host, 2, 3 on the other). Each tuple lists ranks that hold
    the same shards (one per host); position i of every tuple together forms
    shard group i, over which parameters are sharded (here (0, 1) and
    (2, 3)). Every tuple has the same length and the tuples cover the ranks
    of `shard()`'s group (which must then be the world) exactly once.
    Gradients are reduce-scattered in the shard group, then all-reduced
    over the replicate group. None: flat sharding over the group. Equivalent
    to `shard(model, mesh=init_device_mesh(..., (R, S),
    mesh_dim_names=("replicate", "shard")))`; see
    docs/design/hybrid-sharding.md."""

    def __post_init__(self) -> None:
        if self.replicate_groups is not None:
            self.replicate_groups = _rank_groups(self.replicate_groups)
        if self.device is not None:
            if not isinstance(self.device, (str, torch.device)):
                raise TypeError("ShardConfig.device must be a torch.device, a device string "
                                f"such as 'cpu' or 'cuda:0', or None, got {self.device!r}")
            try:
                self.device = torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(f"ShardConfig.device: {e}") from None
            if self.device.type == "meta":
                raise ValueError("ShardConfig.device names where shards are allocated and "
                                 "cannot be 'meta'; leave it None or name a real device")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision,
                                                               MixedPrecision):
            raise TypeError("ShardConfig.mixed_precision must be a sharc.MixedPrecision or "
                            f"None, got {self.mixed_precision!r}")
        self.keep_gathered = _names("ShardConfig.keep_gathered", self.keep_gathered,
                                    "parameter names")
        self.gather_units = _names("ShardConfig.gather_units", self.gather_units,
                                   "module names")
        timeout = self.rank_check_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError("ShardConfig.rank_check_timeout_s must be a number of seconds > 0, "
                             f"got {timeout!r}")
        for name in ("eager_reduce_bucket_bytes", "unit_keep_bytes"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"ShardConfig.{name} must be a whole number of bytes >= 0, "
                                 f"got {size!r}")
        for name in ("verify_replicas", "verify_schedule", "eager_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"ShardConfig.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    """How the "sharc" torch.compile backend schedules and compiles graphs.

    Pass it as `torch.compile(model, backend="sharc", options={...})` with
    these field names; `from_options` builds it from those options over
    defaults read from the environment: `SHARC_DUMP_IR=dir` sets `dump_ir`,
    `SHARC_COMPILE_INDUCTOR=0` sets `inductor=False`. Explicit options win."""

    inductor: bool = True
    """Compile the scheduled graphs with Inductor; False runs them as plain
    FX graphs, for debugging a schedule (env SHARC_COMPILE_INDUCTOR=0)."""

    gather_bucket_bytes: int | None = None
    """Consecutive gathers are fused into one all-gather (the later ones
    prefetched) up to this many bytes. None: chosen by the scheduler from
    the measured all-gather cost (the size at which its latency is a tenth
    of its transfer time, between 64 KiB and 64 MiB; 64 KiB unmeasured),
    halved until the schedule fits the memory budget."""

    memory_budget_bytes: int | None = None
    """The most parameter bytes a compiled schedule may hold gathered at
    once (kept parameters, buffers in use, prefetched buckets and their
    staging), checked by the scheduler's verifier; a budget below what a
    graph needs at least is an error naming that smallest budget. None: the
    default rule (memory_budget_rule), never below what the graph needs."""

    memory_budget_rule: str = "free_memory"
    """How the default budget (memory_budget_bytes None) is chosen:
    "free_memory", an eighth of the memory free on the emptiest rank at the
    group's first compile (the device's on CUDA, the host's elsewhere),
    rounded down to a power of two (so a rerun gets the same budget and
    finds its graphs in Inductor's cache), so that with room parameters
    stay gathered from forward to backward;
    "largest_param", four times the largest parameter the graph reads (in
    the dtype it is gathered in), the leanest default; "auto", the first on
    a CUDA device and the second elsewhere (the defaults before the host's
    memory was read). On the benchmark's CPU host the host-memory budget
    made a graph-broken mixture-of-experts model 0.49x-0.77x the lean
    rule's step (compiled 0.63x-0.98x eager, where the lean rule was 1.30x
    eager in 2 of 3 runs), and the GPT 0.75x-1.43x, at a higher peak:
    bench/results/floor_history.md (today's standing: floor_targets.md). Either is raised to what a graph needs
    at least."""

    warn_graphs: int | None = 10
    """Warn once (sharc.ManyGraphsWarning) when graph breaks split a sharded
    model's step into this many compiled graphs reading sharded parameters
    (counted by Dynamo frame, recompiles not counted): each pays its own
    collectives' latency, so the compiled step may be slower than eager.
    The warning carries the measured collective latencies. None: never."""

    profile: bool = True
    """Measure, in the first compile, each compute node's time (on stand-in
    inputs, results untouched) and the process group's collective costs
    (once per group), and schedule from them: selective unsharding
    (parameters kept gathered from forward to backward) and the gather
    bucket sizes and the prefetch distance. False: no measurement, nothing
    kept, 64 KiB gather and 4 MiB reduction buckets, gathers one bucket
    ahead. What is measured is kept in a `sharc` folder of Inductor's cache
    directory, and a later process schedules from it rather than measuring
    anew (docs/design/compiled-schedule.md, "Kept across processes")."""

    reduce_bucket_bytes: int | None = None
    """Gradients are reduce-scattered together up to this many bytes. None:
    chosen by the scheduler from the measured reduce-scatter cost (the same
    rule as gathers, between 1 MiB and 64 MiB; 4 MiB unmeasured)."""

    disable_passes: tuple[str, ...] = ()
    """Passes switched off by name. `bucket_allgathers` and `prefetch_gathers`
    may be, and so may `regather_in_backward` (a safety net the bridge's
    graphs never need); switching off a pass whose rule a later pass requires,
    or that a graph's finished schedule needs, is an error at compile time
    naming the pass."""

    dump_ir: str | None = None
    """A directory: each graph's IR before and after every pass, with each
    pass's statistics, and the pipeline that ran, every argument written out
    (`*.pipeline`), are written there (env SHARC_DUMP_IR)."""

    pipeline: str | None = None
    """The pass pipeline as text, run instead of the shipping one:
    `"regather_in_backward,cast_before_gather,...,bucket_allgathers{bytes=65536},..."`
    (a `-` before a name switches the pass off). A dumped `*.pipeline`
    replays that schedule; arguments left out are chosen as the shipping
    pipeline would. Exclusive with gather_bucket_bytes, reduce_bucket_bytes
    and disable_passes, which edit the shipping pipeline."""

    def __post_init__(self) -> None:
        if not isinstance(self.inductor, bool):
            raise TypeError(f"CompileConfig.inductor must be a bool, got {self.inductor!r}")
        if self.warn_graphs is not None and (not isinstance(self.warn_graphs, int) or
                                             isinstance(self.warn_graphs, bool) or
                                             self.warn_graphs < 1):
            raise ValueError("CompileConfig.warn_graphs must be an int >= 1 or None, got "
                             f"{self.warn_graphs!r}")
        if self.memory_budget_rule not in ("auto", "free_memory", "largest_param"):
            raise ValueError("CompileConfig.memory_budget_rule must be 'auto', 'free_memory' "
                             f"or 'largest_param', got {self.memory_budget_rule!r}")
        if not isinstance(self.profile, bool):
            raise TypeError(f"CompileConfig.profile must be a bool, got {self.profile!r}")
        for name in ("gather_bucket_bytes", "reduce_bucket_bytes", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CompileConfig.{name} must be an int >= 0, got {value!r}")
        self.disable_passes = _names("CompileConfig.disable_passes", self.disable_passes,
                                     "pass names")
        if self.dump_ir is not None:
            if not isinstance(self.dump_ir, (str, os.PathLike)):
                raise TypeError("CompileConfig.dump_ir must be a directory path (str) or "
                                f"None, got {self.dump_ir!r}")
            self.dump_ir = os.fspath(self.dump_ir)
        passes = _pass_names()
        unknown = [p for p in self.disable_passes if p not in passes]
        if unknown:
            raise ValueError(f"CompileConfig.disable_passes: unknown pass {unknown[0]!r}; "
                             f"the passes are {', '.join(passes)}")
        if self.pipeline is not None:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        import torch

        if not isinstance(self.pipeline, str):
            raise TypeError(f"CompileConfig.pipeline must be a str, got {self.pipeline!r}")
        edits = [n for n in ("gather_bucket_bytes", "reduce_bucket_bytes", "disable_passes")
                 if getattr(self, n)]
        if edits:
            raise ValueError(f"CompileConfig.pipeline replaces the shipping pipeline, which "
                             f"{edits[0]} edits; write it in the pipeline text instead")
        try:
            self.pipeline = torch.classes.sharc.Scheduler.normalize_pipeline(self.pipeline)
        except RuntimeError as e:
            raise ValueError(f"CompileConfig.pipeline: {e}") from None

    def pipeline_text(self) -> str:
        """The pipeline to run, as text: the given one, or the shipping
        passes with this config's edits (passes switched off, bucket caps);
        the scheduler fills in every argument not written."""
        if self.pipeline is not None:
            return self.pipeline
        items = []
        for name in _pass_names():
            item = ("-" if name in self.disable_passes else "") + name
            cap = {"bucket_allgathers": self.gather_bucket_bytes,
                   "insert_reduce_scatter": self.reduce_bucket_bytes}.get(name)
            items.append(item if cap is None else f"{item}{{bytes={cap}}}")
        return ",".join(items)

    @classmethod
    def from_options(cls, options: dict | None) -> "CompileConfig":
        """Environment defaults, overridden by torch.compile's `options`."""
        fields = {}
        if os.environ.get("SHARC_DUMP_IR"):
            fields["dump_ir"] = os.environ["SHARC_DUMP_IR"]
        if os.environ.get("SHARC_COMPILE_INDUCTOR") == "0":
            fields["inductor"] = False
        fields.update(options or {})
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown sharc compile option {unknown[0]!r}; the options are "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**fields)


def _rank_groups(value) -> tuple[tuple[int, ...], ...]:
    """ShardConfig.replicate_groups as a tuple of tuples of ranks, checked for
    shape (what only the group's size can check is checked by shard())."""
    field = "ShardConfig.replicate_groups"
    example = "e.g. ((0, 2), (1, 3)) for 2 hosts of 2 ranks"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{field} must be a tuple of tuples of global ranks ({example}), "
                        f"got {value!r}")
    groups = []
    for g in value:
        if isinstance(g, (str, bytes)) or not hasattr(g, "__iter__"):
            raise TypeError(f"{field} must be a tuple of tuples of global ranks ({example}), "
                            f"got the element {g!r}")
        ranks = tuple(g)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if bad:
            raise TypeError(f"{field}: ranks are ints >= 0, got {bad[0]!r} in {ranks!r}")
        groups.append(ranks)
    if not groups or not groups[0]:
        raise ValueError(f"{field} must name at least one non-empty group ({example}); "
                         "leave it None for flat sharding")
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        raise ValueError(f"{field}: every replicate group must have the same size (one rank "
                         f"per host), got sizes {sizes}")
    seen: set[int] = set()
    for g in groups:
        twice = [r for r in g if r in seen or g.count(r) > 1]
        if twice:
            raise ValueError(f"{field}: rank {twice[0]} is in more than one place; each rank "
                             "holds one shard and is in exactly one replicate group")
        seen.update(g)
    return tuple(groups)


def _names(field: str, value, what: str) -> tuple[str, ...]:
    """A tuple of strings from any iterable of strings; a lone string is an
    error (it would be read as its characters)."""
    if isinstance(value, str):
        raise TypeError(f"{field} must be a tuple of {what}, got the string {value!r}: "
                        f"write ({value!r},)")
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(f"{field} must be a tuple of {what}, got {value!r}") from None
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{field} must be a tuple of {what} (strings), got {bad[0]!r} in it")
    return names


def _pass_names() -> list[str]:
    """The scheduler's passes in order, as the C++ pipeline names them."""
    import torch

    from sharc import _library  # noqa: F401  (registers torch.classes.sharc)

    return list(torch.classes.sharc.Scheduler.pass_names())
