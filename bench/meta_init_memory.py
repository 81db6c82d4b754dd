"""Peak resident memory per rank while a model is built, sharded, initialised
or loaded: built on the meta device (sharc.init_weights, or
sharc.load_full_state_dict from a safetensors or torch.save file) against
built normally on every rank.

    .venv/bin/python bench/meta_init_memory.py             # 8 gloo ranks, a 403 MB GPT
    .venv/bin/python bench/meta_init_memory.py --nproc 4 --n-layer 4

Each mode runs in fresh rank processes. After imports, process group set-up
and a warm-up collective, each rank notes its resident set (VmRSS) as the
baseline and resets the kernel's peak (writing 5 to /proc/self/clear_refs);
after each phase it reads its peak resident set (VmHWM, the high-water mark
resource.getrusage's ru_maxrss reads, which the reset resets; ru_maxrss
itself also keeps the marks of threads that exited earlier, so it is only
reported beside) and reports the peak above the baseline, then resets the
peak again for the next phase. A tiny model goes through the same steps
first, so that what loads once per process is in the baseline. The bound each
meta mode is held to: this rank's shard bytes + four times the largest
module's parameter bytes + a fixed 64 MiB, which must also stay under half
the full model. Four copies of one module, because gathering a parameter
that has values already (sharc.init_weights's second pass, init_fn, finds
every one initialised by the first) holds the runtime's padded gather
buffer, gloo's own flat staging buffer of the all-gather (allocated by its
worker thread, whose glibc arena keeps it when freed), and the true-shape
copy read_full returns, which the initialiser writes; see
docs/design/meta-init.md, "Memory". The files
loaded are written beforehand by the parent process (its memory is not
measured). Results go to bench/results/meta_init_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile

import torch
import torch.distributed as dist

MODES = ("normal", "meta+init_weights", "meta+load safetensors", "meta+load torch.save")
OVERHEAD_BYTES = 64 << 20


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _reset_peak() -> bool:
    """The kernel's peak resident set back to the current one (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    """The peak resident set since the last reset: the kernel's high-water
    mark of this process's memory (VmHWM). getrusage's ru_maxrss reads the
    same mark but also the marks threads took with them when they exited
    (gloo's and torch's worker threads, some while imports peaked), which no
    reset clears; it is reported beside it."""
    return _status_bytes("VmHWM")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def gpt_config(n_layer: int, n_embd: int):
    from sharc.models.gpt import GPTConfig

    return GPTConfig(vocab_size=65, block_size=128, n_layer=n_layer, n_head=16, n_embd=n_embd)


def model_bytes(cfg) -> tuple[int, int]:
    """(full parameter bytes, the largest module's own parameter bytes)."""
    from sharc.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                  for m in model.modules())
    return full, largest


class PhasePeaks:
    """Peak resident bytes above the baseline, phase by phase."""

    def __init__(self):
        dist.barrier()
        self.baseline = _rss_bytes()
        self.reset_works = _reset_peak()
        if not self.reset_works:  # the peak so far hides smaller rises: note it
            self.baseline = max(self.baseline, _peak_bytes())
        self.phases: dict[str, int] = {}
        self.maxrss: dict[str, int] = {}

    def end(self, phase: str) -> None:
        self.phases[phase] = _peak_bytes() - self.baseline
        self.maxrss[phase] = _maxrss_bytes() - self.baseline
        _reset_peak()


def measure(mode: str, cfg, path: str | None) -> dict:
    """One rank's figures for `mode` (every rank calls it, the default group
    set up)."""
    import sharc
    from sharc.models.gpt import GPT

    torch.set_num_threads(1)
    _warm_up(mode, path)
    peaks = PhasePeaks()
    torch.manual_seed(0)
    if mode == "normal":
        model = GPT(cfg)
    else:
        with torch.device("meta"):
            model = GPT(cfg)
    peaks.end("build")
    sharc.shard(model, config=sharc.ShardConfig(verify_replicas=False))
    peaks.end("shard")
    if mode == "meta+init_weights":
        sharc.init_weights(model, init_fn=model._init_weights)
        peaks.end("init_weights")
    elif mode.startswith("meta+load"):
        sharc.load_full_state_dict(model, path)
        peaks.end("load")
    full, largest = model_bytes(cfg)
    return {"rank": dist.get_rank(), "baseline_rss": peaks.baseline,
            "peak_reset": peaks.reset_works, "phases": peaks.phases,
            "getrusage_maxrss_phases": peaks.maxrss,
            "peak": max(peaks.phases.values()),
            "shard_bytes": sharc.memory_stats()["shard_bytes"],
            "full_bytes": full, "largest_module_bytes": largest}


def _warm_up(mode: str, path: str | None) -> None:
    """The same steps on a tiny model first, so that what Python and torch
    load once per process (modules imported on first use, gloo's buffers,
    sharc's side group) is in the baseline, not in the first phase."""
    import sharc
    from sharc.models.gpt import GPT

    tiny = gpt_config(1, 16)
    with torch.device("meta"):
        model = GPT(tiny)
    sharc.shard(model)
    sharc.init_weights(model, init_fn=model._init_weights)
    if path is not None:  # rank 0 writes tiny files, every rank loads them (one machine)
        where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(where, src=0)
        if dist.get_rank() == 0:
            write_files(where[0], tiny)
        dist.barrier()
        sharc.load_full_state_dict(model, os.path.join(where[0], os.path.basename(path)))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where[0])
    torch.manual_seed(0)
    GPT(tiny)
    del model


def bound(row: dict) -> int:
    return row["shard_bytes"] + 4 * row["largest_module_bytes"] + OVERHEAD_BYTES


def _rank(mode: str, n_layer: int, n_embd: int, path: str | None, out: str) -> None:
    row = measure(mode, gpt_config(n_layer, n_embd), path)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def write_files(directory: str, cfg) -> dict[str, str]:
    """The normally built model's values as a safetensors and a torch.save
    file (the tied head under one name, as Hugging Face saves it)."""
    from safetensors.torch import save_file

    from sharc.models.gpt import GPT

    torch.manual_seed(0)
    sd = GPT(cfg).state_dict()
    del sd["lm_head.weight"]
    paths = {"meta+load safetensors": os.path.join(directory, "model.safetensors"),
             "meta+load torch.save": os.path.join(directory, "model.pt")}
    save_file(sd, paths["meta+load safetensors"])
    torch.save(sd, paths["meta+load torch.save"])
    return paths


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| mode | phase peaks above baseline, max over ranks (MiB) | peak per rank (MiB) | "
             "shards (MiB) | bound (MiB) | full model (MiB) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mode, rows in results.items():
        phases = ", ".join(f"{p} {_mib(max(r['phases'][p] for r in rows))}"
                           for p in rows[0]["phases"])
        peaks = " / ".join(_mib(r["peak"]) for r in rows)
        lines.append(f"| {mode} | {phases} | {peaks} | {_mib(rows[0]['shard_bytes'])} | "
                     f"{'-' if mode == 'normal' else _mib(bound(rows[0]))} | "
                     f"{_mib(rows[0]['full_bytes'])} |")
    return "\n".join(lines)


def main() -> None:
    from sharc.launch import launch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args()
    cfg = gpt_config(a.n_layer, a.n_embd)
    results, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(tmp, cfg)
        for mode in a.modes.split(","):
            out = os.path.join(tmp, "rows.json")
            launch(_rank, a.nproc, args=(mode, a.n_layer, a.n_embd, paths.get(mode), out))
            with open(out) as f:
                results[mode] = json.load(f)
            if mode != "normal":
                failed += [f"{mode} rank {r['rank']}" for r in results[mode]
                           if r["peak"] > bound(r) or r["peak"] > r["full_bytes"] / 2]
    meta = {"nproc": a.nproc, "n_layer": a.n_layer, "n_embd": a.n_embd,
            "peak_reset": all(r["peak_reset"] for rows in results.values() for r in rows)}
    text = table(results)
    print(json.dumps(meta))
    print(text)
    print("bound held on every rank" if not failed else f"bound exceeded: {failed}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "meta_init_memory.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    with open(os.path.join(a.out, "meta_init_memory.md"), "w") as f:
        f.write(f"Peak resident memory per rank above the baseline {json.dumps(meta)}\n\n"
                f"{text}\n")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
