"""sharc compiled vs sharc eager vs FSDP2 vs DDP vs the floor: step time
and peak memory per rank, in one run, on the same model, data and ranks.

    .venv/bin/python bench/compare.py                 # every model, 2 gloo ranks, CPU
    .venv/bin/python bench/compare.py --size small    # one model

Every competitor runs with its default options (no hand-set bucket sizes)
and trains its own copy of the same model (same initial weights, same
batches) with AdamW. The models: the GPT "small", 4 layers 256 wide, and
"large", 12 layers 512 wide (11.8x the parameters); "bert", a 2-layer
BERT-like encoder; "broken", a 6-layer GPT with two graph breaks per block
(12 in all); "switch", a small HF SwitchTransformers encoder-decoder whose
routing breaks Dynamo's graph dozens of times (its sparse MLPs sharc
gather units, DDP finding unused experts). The floor is what data parallelism cannot beat: each rank
trains the plain compiled model (torch.compile, Inductor) on its own slice
with its own AdamW, all ranks at once, no process group touched; every
row's `to_floor` is its step time over the floor's. sharc compiled also
runs with profiling switched off (CompileConfig(profile=False)), to show
what the measured costs buy, with the lean budget
(memory_budget_rule="largest_param", four times the largest parameter: the
CPU default before the host's free memory was read), and with a memory budget of four times the
model's parameter bytes ("DDP's memory": every parameter may stay gathered
from forward to backward, as DDP holds them); for sharc the table adds the exposed communication per
step (host time blocked waiting on all-gathers and reduce-scatters) and the
peak of gathered bytes. Step time is the median over interleaved rounds
(each round times a few steps of every competitor in turn, so machine noise
hits all of them alike), after warm-up steps that include compilation.
Each competitor's model runs code objects of its own (_common.fresh_model),
so no competitor's compiler changes how another's model runs.

warmup_s is a competitor's build and warm-up steps, compilation included
(warmup_parts_s: rank 0's build, then each step; warmup_cpu_s: the CPU
seconds all ranks and the C++ compiler runs they waited for used meanwhile,
summed over ranks since the ranks share a cache directory and either may
build a kernel the other then loads; other processes on a shared host move
it less than the wall time),
and every compiled competitor compiles under the same cache conditions:
with --inductor-cache fresh (the default) each compiles into an empty
Inductor cache directory of its own, with Inductor's in-memory caches
emptied first (_common.own_inductor_cache), so each pays its whole first
compilation, as a new model's first run does. Before, all competitors
shared the process's cache: DDP compiled compiles the same graph as the
floor, which ran first, and found its kernels, wrappers and graphs cached
(its warm-up then left out most of what the floor's included), while sharc
compiled, first of sharc's rows, built kernels the later sharc rows then
found. --inductor-cache DIR keeps each competitor's directory under DIR, so
a second run with the same DIR measures every competitor's warm start
alike; --inductor-cache process restores the shared cache. What a process
pays once, at its first Inductor compilation, whatever it compiles (the C++
compiler's and the CPU's vector-ISA probes, each a C++ build, the compile
workers' start, lazy imports), is paid before the first competitor, by a
small model compiled in a cache of its own (_first_compile): it went to
whichever compiled competitor ran first, sharc compiled since the floor's
row is optional.

Peak memory per rank is exact byte accounting, in two parts:
  resident: bytes of the parameters, gradients and optimizer state this rank
            holds between steps (tensor storages, each counted once), and
            for sharc the parameters its schedule keeps gathered between
            steps (kept_gathered_bytes);
  step:     the highest level the CPU allocator reached above that during one
            training step (torch.profiler's memory events, summed in order).
DDP's internal gradient buckets are allocated at construction and not seen
by either part, so DDP's figure is a lower bound.

Prints a table of ratios to sharc compiled and writes it as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

import sharc
from _common import (LARGE_MODEL, MODEL, Competitor, adamw, fresh_model, markdown,
                     median_step_s, own_inductor_cache, profiled_step, resident_bytes, slug,
                     step_peak_bytes,
                     time_rounds, warm_up, write_results)
from _models import BrokenConfig, EncoderConfig, SwitchConfig
from sharc.data import CharDataset
from sharc.launch import configure_threads, launch

COMPETITORS = ["floor", "sharc compiled", "sharc compiled, lean budget",
               "sharc compiled, profiling off", "sharc compiled, DDP's memory", "sharc eager", "FSDP2 eager", "FSDP2 compiled",
               "DDP eager", "DDP compiled"]
SIZES = {"small": MODEL, "large": LARGE_MODEL, "bert": EncoderConfig(),
         "broken": BrokenConfig(vocab_size=65, block_size=128, n_layer=6, n_head=4, n_embd=128),
         "switch": SwitchConfig()}
# The small real-model cases run fewer competitors.
SMALL_CASES = {"bert", "broken", "switch"}
SMALL_CASE_COMPETITORS = ["floor", "sharc compiled", "sharc compiled, lean budget",
                          "sharc eager", "DDP compiled"]
# The targets, as (sharc row, the row it is held to, figure, bound on the
# ratio, the models it applies to).
GPT_SIZES = ("small", "large")
TARGETS = [("sharc compiled", "floor", "step_ms", 1.20, GPT_SIZES),
           ("sharc compiled", "FSDP2 compiled", "step_ms", 0.85, GPT_SIZES),
           ("sharc compiled", "FSDP2 compiled", "peak_MiB_per_rank", 1.00, GPT_SIZES),
           ("sharc compiled, DDP's memory", "DDP compiled", "step_ms", 1.05, GPT_SIZES),
           ("sharc compiled, DDP's memory", "DDP compiled", "peak_MiB_per_rank", 1.00,
            GPT_SIZES),
           ("sharc compiled", "DDP compiled", "warmup_s", 1.50, GPT_SIZES),
           ("sharc compiled", "DDP compiled", "warmup_cpu_s", 1.50, GPT_SIZES),
           ("sharc eager", "FSDP2 eager", "step_ms", 1.00, GPT_SIZES),
           ("sharc eager", "FSDP2 eager", "peak_MiB_per_rank", 1.00, GPT_SIZES),
           ("sharc compiled", "sharc eager", "step_ms", 1.00, tuple(SIZES)),
           ("sharc compiled", "DDP compiled", "step_ms", 1.50, tuple(SMALL_CASES))]


def _build(name: str, size) -> Competitor:
    model = fresh_model(size)
    if name == "floor":
        return Competitor(name, model, torch.compile(model), adamw(model))
    if name.startswith("sharc"):
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        units = getattr(model, "gather_units", ())  # SwitchLM's experts: one unit per MLP
        sharc.shard(model, dist.new_group(),  # a runtime (and counters) of its own
                    config=sharc.ShardConfig(gather_units=units))
        step_fn = model
        if name == "sharc compiled":
            step_fn = torch.compile(model, backend="sharc")
        elif name == "sharc compiled, lean budget":  # the CPU default before issue 26
            step_fn = torch.compile(model, backend="sharc",
                                    options={"memory_budget_rule": "largest_param"})
        elif name == "sharc compiled, profiling off":
            step_fn = torch.compile(model, backend="sharc", options={"profile": False})
        elif name == "sharc compiled, DDP's memory":
            step_fn = torch.compile(model, backend="sharc",
                                    options={"memory_budget_bytes": 4 * full_bytes})
    elif name.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        step_fn = torch.compile(model) if name == "FSDP2 compiled" else model
    else:
        # SwitchLM's routing leaves experts unused on a step.
        model = torch.nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=hasattr(model, "gather_units"))
        step_fn = torch.compile(model) if name == "DDP compiled" else model
    return Competitor(name, model, step_fn, adamw(model))


def _rank_main(args) -> None:
    configure_threads(dist.get_world_size())  # [Note: one thread for gloo's threads]
    sizes = list(SIZES) if args.size == "all" else [args.size]
    for size in sizes:
        _run_size(size, args)


def _run_size(size: str, args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = SIZES[size]
    data = CharDataset()

    def batch(step):
        return data.rank_batch(step, args.batch, config.block_size, rank, world)

    names = SMALL_CASE_COMPETITORS if size in SMALL_CASES else COMPETITORS
    names = [n for n in names if not args.only or n in args.only or n == "sharc compiled"]
    results = {}
    root = _cache_root(args.inductor_cache, size)
    first_compile_s = None
    if root is not None:
        start = time.perf_counter()
        with own_inductor_cache(os.path.join(root, "first_compile")):
            _first_compile()
        first_compile_s = time.perf_counter() - start
    # FSDP2 compiled is built, timed and measured last, alone: once Dynamo has
    # compiled FSDP2's graph-breaking GPT.forward, another compiled model of
    # that class in the same process no longer compiles cleanly (see the
    # limitations in docs/design/compiled-schedule.md).
    for phase in ([n for n in names if n != "FSDP2 compiled"],
                  [n for n in names if n == "FSDP2 compiled"]):
        _run_phase(phase, results, batch, args, config, root)
    dist.barrier()
    if rank == 0 and root is not None and args.inductor_cache == "fresh":
        shutil.rmtree(root, ignore_errors=True)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, results)
    if rank == 0:
        _report(per_rank, args, size, config, first_compile_s)


def _cache_root(mode: str, size: str) -> str | None:
    """The directory whose subdirectories are the competitors' Inductor
    caches, the same on every rank (one host, one cache, as in a real run);
    None for the process's shared cache."""
    if mode == "process":
        return None
    root = [tempfile.mkdtemp(prefix="compare_inductor_") if mode == "fresh"
            else os.path.join(os.path.abspath(mode), size)]
    dist.broadcast_object_list(root, src=0)
    return root[0]


def _first_compile() -> None:
    """An Inductor compilation of a small model's training step (forward
    and backward), unlike any competitor's: what a process pays at its
    first compilation is paid here, not by the first competitor."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    torch.compile(model)(torch.randn(4, 8)).sum().backward()


def _run_phase(names, results, batch, args, config, root) -> None:
    competitors = warm_up(names, lambda name: _build(name, config), batch, args.warmup, results,
                          cache_dir=lambda name: None if root is None
                          else os.path.join(root, slug(name)))
    for c in competitors:  # counters from here on cover the timed steps only
        if c.name.startswith("sharc"):
            sharc.reset_memory_stats(sharc.api.sharded_root(c.model).group)
    times = time_rounds(competitors, batch, args)
    for c in competitors:
        if c.name.startswith("sharc"):
            stats = sharc.memory_stats(sharc.api.sharded_root(c.model).group)
            steps = len(times[c.name])
            waited_ns = stats["gather_wait_ns"] + stats["reduce_wait_ns"]
            results[c.name].update(peak_gathered_bytes=stats["peak_gathered_bytes"],
                                   exposed_comm_s=waited_ns / 1e9 / steps)
        # Parameters the schedule keeps gathered stay so between steps: the
        # runtime's buffers, which neither the parameters nor the allocator
        # level during a step (they were allocated before it) show.
        kept = (sharc.memory_stats(sharc.api.sharded_root(c.model).group)["kept_gathered_bytes"]
                if c.name.startswith("sharc") else 0)
        results[c.name].update(
            step_s=median_step_s(times[c.name]),
            resident_bytes=resident_bytes(c) + kept,
            step_peak_bytes=step_peak_bytes(profiled_step(c, *batch(0))))


def _report(per_rank: list[dict], args, size: str, config, first_compile_s) -> None:
    names = list(per_rank[0])
    rows = []
    for name in names:
        r0 = per_rank[0][name]
        if "error" in r0:
            rows.append({"competitor": name, "error": r0["error"]})
            continue
        step_s = max(r[name]["step_s"] for r in per_rank)
        peak = max(r[name]["resident_bytes"] + r[name]["step_peak_bytes"] for r in per_rank)
        rows.append({
            "competitor": name,
            "step_ms": round(step_s * 1e3, 1),
            "step_time_ratio": round(step_s / max(r["sharc compiled"]["step_s"]
                                                  for r in per_rank), 3),
            "to_floor": _to_floor(per_rank, step_s),
            "peak_MiB_per_rank": round(peak / 2**20, 2),
            "peak_ratio": round(peak / max(r["sharc compiled"]["resident_bytes"] +
                                           r["sharc compiled"]["step_peak_bytes"]
                                           for r in per_rank), 3),
            "resident_MiB": round(max(r[name]["resident_bytes"] for r in per_rank) / 2**20, 2),
            "exposed_comm_ms": _max_ms(per_rank, name, "exposed_comm_s"),
            "peak_gathered_MiB": _max_mib(per_rank, name, "peak_gathered_bytes"),
            "warmup_s": round(r0["warmup_s"], 1),
            "warmup_parts_s": "/".join(f"{t:.1f}" for t in r0["warmup_parts_s"]),
            "warmup_cpu_s": round(sum(r[name]["warmup_cpu_s"] for r in per_rank), 1),
            "first_loss": round(r0["losses"][0], 4),
        })
    params = sum(p.numel() for p in fresh_model(config).parameters())
    meta = {"size": size, "parameters": params, "world_size": len(per_rank), "backend": "gloo",
            "device": "cpu", "torch": torch.__version__, "model": repr(config),
            "batch_per_rank": args.batch, "timed_steps": args.rounds * args.steps_per_round,
            "inductor_cache": args.inductor_cache,
            "first_compile_s": None if first_compile_s is None else round(first_compile_s, 1),
            "load_average": [round(v, 2) for v in os.getloadavg()]}
    table = markdown(rows, ["competitor", "step_ms", "step_time_ratio", "to_floor",
                            "peak_MiB_per_rank",
                            "peak_ratio", "resident_MiB", "exposed_comm_ms",
                            "peak_gathered_MiB", "warmup_s", "warmup_parts_s", "warmup_cpu_s", "first_loss"])
    targets = markdown(_targets(rows, size), ["target", "ratio", "bound", "met"])
    print(f"\n{size}: {params} parameters\n{table}\n\n{targets}")
    write_results(args.out, f"compare_{size}", meta, rows + _targets(rows, size),
                  "Ratios are to sharc compiled (lower is better).", f"{table}\n\n{targets}")


def _max_ms(per_rank, name, key):
    values = [r[name].get(key) for r in per_rank]
    return None if None in values else round(max(values) * 1e3, 1)


def _max_mib(per_rank, name, key):
    values = [r[name].get(key) for r in per_rank]
    return None if None in values else round(max(values) / 2**20, 2)


def _to_floor(per_rank, step_s):
    if "floor" not in per_rank[0] or "error" in per_rank[0]["floor"]:
        return None
    return round(step_s / max(r["floor"]["step_s"] for r in per_rank), 3)


def _targets(rows: list[dict], size: str) -> list[dict]:
    """Each target that applies to this model, as a measured ratio, met or
    missed."""
    by_name = {r["competitor"]: r for r in rows if "error" not in r}
    out = []
    for ours, theirs, figure, bound, sizes in TARGETS:
        if size not in sizes:
            continue
        if ours not in by_name or theirs not in by_name or not by_name[theirs].get(figure):
            continue
        ratio = by_name[ours][figure] / by_name[theirs][figure]
        out.append({"target": f"{ours} / {theirs}, {figure}", "ratio": round(ratio, 3),
                    "bound": bound, "met": "yes" if ratio <= bound else "MISSED"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--size", choices=[*SIZES, "all"], default="all")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=COMPETITORS,
                        help="run only these competitors (sharc compiled always runs); "
                        "Inductor writes the word after --only into its generated code as a "
                        "quoted string, so do not put a name with an apostrophe first")
    parser.add_argument("--inductor-cache", default="fresh",
                        help='"fresh": each competitor compiles into an empty Inductor cache of '
                        'its own (the default); a directory: each competitor\'s cache kept under '
                        'it (a rerun is warm for all alike); "process": one cache for all, '
                        "whatever TORCHINDUCTOR_CACHE_DIR names")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    launch(_rank_main, args.nproc, args=(args,))


if __name__ == "__main__":
    main()
