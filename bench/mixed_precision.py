"""sharc mixed precision (bf16 gathers, fp32 master state) against fp32 and
against FSDP2's bf16 policy: step time, bytes all-gathered and peak memory
per rank, in one run, on the same model, data and ranks.

    .venv/bin/python bench/mixed_precision.py     # 2 gloo ranks, CPU

Rows (each trains its own copy of the same GPT, same initial weights, same
batches, with AdamW; bf16 means param_dtype=bfloat16, reduce_dtype=float32):
  1. sharc compiled fp32                   no mixed precision
  2. sharc compiled bf16, gather then cast the cast_before_gather pass off:
                                           gathers fp32, then casts
  3. sharc compiled bf16, cast then gather default passes: casts the shard,
                                           gathers bf16 (the baseline of ratios)
  4. sharc eager bf16
  5. FSDP2 eager bf16                      fully_shard per block and root,
                                           MixedPrecisionPolicy
  6. FSDP2 compiled bf16                   the same under torch.compile
                                           (built, timed and measured last)
Step time and peak memory per rank as bench/_common.py describes. Bytes
all-gathered per step per rank are measured over one training step: for
sharc rows by sharc's own counter (memory_stats' allgather_bytes: what this
rank sent, (world - 1) x its shard bytes per all-gather); for FSDP2 rows by
counting, with that same formula, the all-gathers the gloo backend ran in
that step (torch.profiler's gloo:all_gather events with their input shapes
and dtypes). For sharc rows the profiler's count is checked against the
counter. peak_gathered_bytes is sharc's exact peak of gathered parameter
bytes in that step.

Checks printed: rows 2 and 3 must give bitwise the same loss at every step
and the same fp32 master weights after the last (they differ only in where
the cast happens), and row 2 must all-gather exactly twice row 3's bytes.
On this CPU bf16 matmuls need not be faster than fp32: the times are what
was measured.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import sharc
from _common import (MODEL, Competitor, adamw, allgather_sent_bytes, fresh_model, markdown,
                     median_step_s, profiled_step, resident_bytes, step_peak_bytes,
                     time_rounds, warm_up, write_results)
from sharc.data import CharDataset
from sharc.launch import configure_threads, launch

FP32 = "sharc compiled fp32"
GATHER_THEN_CAST = "sharc compiled bf16, gather then cast"
CAST_THEN_GATHER = "sharc compiled bf16, cast then gather"
SHARC_EAGER = "sharc eager bf16"
FSDP2_EAGER = "FSDP2 eager bf16"
FSDP2_COMPILED = "FSDP2 compiled bf16"
COMPETITORS = [FP32, GATHER_THEN_CAST, CAST_THEN_GATHER, SHARC_EAGER, FSDP2_EAGER,
               FSDP2_COMPILED]
BASE = CAST_THEN_GATHER


def _build(name: str) -> Competitor:
    model = fresh_model()
    if name.startswith("sharc"):
        mp = None if name == FP32 else sharc.MixedPrecision(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)
        # A group of its own: a runtime, and counters, per row.
        sharc.shard(model, dist.new_group(), config=sharc.ShardConfig(mixed_precision=mp))
        step_fn = model
        if name == GATHER_THEN_CAST:
            step_fn = torch.compile(model, backend="sharc",
                                    options={"disable_passes": ("cast_before_gather",)})
        elif name != SHARC_EAGER:
            step_fn = torch.compile(model, backend="sharc")
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        step_fn = torch.compile(model) if name == FSDP2_COMPILED else model
    return Competitor(name, model, step_fn, adamw(model))


def _rank_main(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    configure_threads(world)  # [Note: one thread for gloo's threads]
    data = CharDataset()

    def batch(step):
        return data.rank_batch(step, args.batch, MODEL.block_size, rank, world)

    results, checks = {}, {}
    # FSDP2 compiled goes last, alone, as in bench/compare.py: once Dynamo has
    # compiled FSDP2's graph-breaking GPT.forward, another compiled model of
    # that class in the same process no longer compiles cleanly.
    for phase in (COMPETITORS[:-1], [FSDP2_COMPILED]):
        _run_phase(phase, results, checks, batch, args)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"results": results, "checks": checks})
    if rank == 0:
        _report(per_rank, args)


def _run_phase(names, results, checks, batch, args) -> None:
    competitors = warm_up(names, _build, batch, args.warmup, results)
    times = time_rounds(competitors, batch, args)
    profiled = args.warmup + args.rounds * args.steps_per_round  # the next batch
    for c in competitors:
        results[c.name].update(step_s=median_step_s(times[c.name]),
                               resident_bytes=resident_bytes(c))
        results[c.name].update(_measure_step(c, batch(profiled)))
        results[c.name]["losses"] = c.losses
    by_name = {c.name: c for c in competitors}
    if GATHER_THEN_CAST in by_name and CAST_THEN_GATHER in by_name:
        checks["same_master_weights"] = all(
            torch.equal(a, b) for a, b in zip(by_name[GATHER_THEN_CAST].model.parameters(),
                                              by_name[CAST_THEN_GATHER].model.parameters()))


def _measure_step(c: Competitor, batch) -> dict:
    """Allocator peak and all-gathered bytes of one profiled step, and for
    sharc rows its counters over that step."""
    sharc_group = sharc.api.sharded_root(c.model).group if c.name.startswith("sharc") else None
    if sharc_group is not None:
        sharc.reset_memory_stats(sharc_group)
    prof = profiled_step(c, *batch)
    out = {"step_peak_bytes": step_peak_bytes(prof),
           "profiled_allgather_bytes": allgather_sent_bytes(prof, dist.get_world_size())}
    if sharc_group is None:
        out["allgather_bytes"] = out["profiled_allgather_bytes"]
    else:
        stats = sharc.memory_stats(sharc_group)
        out["allgather_bytes"] = stats["allgather_bytes"]
        out["peak_gathered_bytes"] = stats["peak_gathered_bytes"]
    return out


def _report(per_rank: list[dict], args) -> None:
    per_rank_results = [r["results"] for r in per_rank]

    def worst(name, key):  # the slowest / largest rank
        return max(r[name][key] for r in per_rank_results)

    def peak(name):
        return max(r[name]["resident_bytes"] + r[name]["step_peak_bytes"]
                   for r in per_rank_results)

    def ratio(value, base):  # n/a when the baseline row did not run
        return "n/a" if "error" in per_rank_results[0][BASE] else round(value / base(BASE), 3)

    rows = []
    for name in COMPETITORS:
        r0 = per_rank_results[0][name]
        if "error" in r0:
            rows.append({"competitor": name, "error": r0["error"]})
            continue
        rows.append({
            "competitor": name,
            "step_ms": round(worst(name, "step_s") * 1e3, 1),
            "step_time_ratio": ratio(worst(name, "step_s"), lambda b: worst(b, "step_s")),
            "allgather_bytes_per_step": worst(name, "allgather_bytes"),
            "allgather_ratio": ratio(worst(name, "allgather_bytes"),
                                     lambda b: worst(b, "allgather_bytes")),
            "peak_MiB_per_rank": round(peak(name) / 2**20, 2),
            "peak_ratio": ratio(peak(name), peak),
            "peak_gathered_bytes": (worst(name, "peak_gathered_bytes")
                                    if name.startswith("sharc") else "n/a"),
            "warmup_s": round(r0["warmup_s"], 1),
            "first_loss": round(r0["losses"][0], 4),
        })
    steps = {"warmup_steps": args.warmup, "timed_steps": args.rounds * args.steps_per_round,
             "rounds": args.rounds, "steps_per_round": args.steps_per_round,
             "profiled_steps": 1}
    meta = {"world_size": len(per_rank), "backend": "gloo", "device": "cpu",
            "torch": torch.__version__, "model": repr(MODEL), "batch_per_rank": args.batch,
            "optimizer": "AdamW", **steps, "checks": _checks(per_rank)}
    table = markdown(rows, ["competitor", "step_ms", "step_time_ratio",
                            "allgather_bytes_per_step", "allgather_ratio", "peak_MiB_per_rank",
                            "peak_ratio", "peak_gathered_bytes", "warmup_s", "first_loss"])
    print(table)
    print(f"steps per row: {args.warmup} warm-up, {steps['timed_steps']} timed "
          f"({args.rounds} rounds of {args.steps_per_round}), 1 profiled; ratios are to "
          f"'{BASE}'")
    for line in meta["checks"]["lines"]:
        print(line)
    write_results(args.out, "mixed_precision", meta, rows,
                  f"Ratios are to {BASE} (lower is better).", table)


def _checks(per_rank: list[dict]) -> dict:
    """The claims this benchmark makes, checked on every rank's figures."""
    results = [r["results"] for r in per_rank]
    ok = {name: all("error" not in r[name] for r in results) for name in COMPETITORS}
    lines, out = [], {}
    if ok[GATHER_THEN_CAST] and ok[CAST_THEN_GATHER]:
        a, b = GATHER_THEN_CAST, CAST_THEN_GATHER
        same_losses = all(r[a]["losses"] == r[b]["losses"] for r in results)
        same_weights = all(r["checks"].get("same_master_weights", False) for r in per_rank)
        twice = all(r[a]["allgather_bytes"] == 2 * r[b]["allgather_bytes"] for r in results)
        n = len(results[0][a]["losses"])
        out.update(rows_2_3_same_losses=same_losses, rows_2_3_same_master_weights=same_weights,
                   row_2_gathers_twice_row_3=twice)
        lines.append(f"check: '{a}' and '{b}' give bitwise the same loss at all {n} steps: "
                     f"{_yes(same_losses)}; the same fp32 master weights after them: "
                     f"{_yes(same_weights)}")
        lines.append(f"check: '{a}' all-gathers exactly twice the bytes of '{b}' on every "
                     f"rank: {_yes(twice)} ({results[0][a]['allgather_bytes']} vs "
                     f"{results[0][b]['allgather_bytes']} bytes per step on rank 0)")
    counted = [n for n in COMPETITORS if n.startswith("sharc") and ok[n]]
    agree = all(r[n]["allgather_bytes"] == r[n]["profiled_allgather_bytes"]
                for r in results for n in counted)
    out["profiler_count_matches_sharc_counters"] = agree
    lines.append("check: the profiler's all-gather count equals sharc's counter for every "
                 f"sharc row: {_yes(agree)}")
    for other in (FP32, SHARC_EAGER, FSDP2_EAGER, FSDP2_COMPILED):
        if ok[other] and ok[BASE]:
            diff = max(abs(x - y) for x, y in zip(results[0][other]["losses"],
                                                  results[0][BASE]["losses"]))
            out[f"max_loss_diff_{other}"] = diff
            lines.append(f"info: largest loss difference, '{other}' vs '{BASE}', rank 0: "
                         f"{diff:.4g}")
    return out | {"lines": lines}


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    launch(_rank_main, args.nproc, args=(args,))


if __name__ == "__main__":
    main()
