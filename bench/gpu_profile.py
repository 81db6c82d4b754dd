"""Where one training step's time goes on a GPU: a row of bench/gpu.py
(same model, batch, optimizer, autocast and compile mode) run under
torch.profiler, each row in a process of its own.

    python bench/gpu_profile.py --rows torch.compile "sharc compiled" --out DIR
    python bench/gpu_profile.py --device cpu --tiny --steps 2 --warmup 1   # smoke test

For each row it prints and writes to DIR/profile_<row>.txt:
  - the median step time without the profiler, and the step time under it;
  - the device's busy time per step (the union of its kernels' and copies'
    intervals) and so how long the device sat idle, waiting for the host;
  - how often, and for how long, the host waited for the device
    (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize);
  - the host operators by self time, and the device kernels by time.
A step whose device is idle for most of it is bound by the host: the
operators at the top of the host table are then what to cut.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu  # noqa: E402  (the benchmark's model, batch and row builders)

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def _busy_us(events) -> float:
    """The union of the device intervals of `events` (kernels, copies), in us."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def _device_events(prof):
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def _profile_row(row: str, opts: dict) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = opts["device"]
    step, _ = gpu._training_step(row, opts)
    t0 = time.perf_counter()
    step()
    gpu._sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(opts["warmup"]):
        step()
    times = []
    for _ in range(opts["steps"]):
        gpu._sync(device)
        t0 = time.perf_counter()
        step()
        gpu._sync(device)
        times.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    n = opts["profiled_steps"]
    gpu._sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        gpu._sync(device)
        profiled_s = (time.perf_counter() - t0) / n
    lines = [f"# {row} on {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}",
             f"first step {first_s:.1f} s; step {statistics.median(times) * 1e3:.2f} ms "
             f"(median of {len(times)}), {profiled_s * 1e3:.2f} ms under the profiler "
             f"(mean of {n})"]
    if device == "cuda":
        busy = _busy_us(_device_events(prof)) / n / 1e3
        lines.append(f"device busy {busy:.2f} ms per step; idle {profiled_s * 1e3 - busy:.2f} ms "
                     f"({1 - busy / (profiled_s * 1e3):.0%} of the profiled step)")
    averages = prof.key_averages()
    for name in WAITS:
        hits = [a for a in averages if a.key == name]
        if hits:
            lines.append(f"{name}: {hits[0].count / n:.1f} calls per step, "
                         f"{hits[0].self_cpu_time_total / n / 1e3:.2f} ms per step")
    lines.append("\n## host operators by self time (per profiled run of all steps)")
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    if device == "cuda":
        lines.append("\n## device work by time")
        lines.append(averages.table(sort_by="self_cuda_time_total", row_limit=25,
                                    max_name_column_width=70))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rows", nargs="+", default=["torch.compile", "sharc compiled"])
    parser.add_argument("--compile", choices=["whole", "blocks"], default="blocks")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profiled-steps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results"))
    parser.add_argument("--_row", help=argparse.SUPPRESS)
    parser.add_argument("--_opts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._row:
        opts = json.loads(args._opts)
        text = _profile_row(args._row, opts)
        with open(os.path.join(opts["out"], f"profile_{args._row.replace(' ', '_')}.txt"), "w") as f:
            f.write(text + "\n")
        return 0
    config = gpu.TINY if args.tiny else gpu.GPT_124M
    opts = dict(device=args.device, tiny=args.tiny, compile=args.compile,
                batch=args.batch or (2 if args.tiny else 8), seq=args.seq or config["block_size"],
                warmup=args.warmup, steps=args.steps, profiled_steps=args.profiled_steps,
                out=os.path.abspath(args.out))
    os.makedirs(opts["out"], exist_ok=True)
    failed = 0
    for row in args.rows:
        row = gpu.ALIASES.get(row, row)
        cmd = [sys.executable, os.path.abspath(__file__), "--_row", row, "--_opts", json.dumps(opts)]
        failed += subprocess.call(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1")) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
