"""sharc compiled against plain torch.compile and FSDP2 compiled on one GPU:
the 124M-parameter GPT (12 layers, 768 wide) at world size 1.

    python bench/gpu.py                                  # the three rows, on cuda:0
    python bench/gpu.py --compile blocks                 # each block compiled in place
    python bench/gpu.py --device cpu --tiny --steps 2 --warmup 1   # a smoke test, no GPU

Rows (each in a subprocess of its own, one after another, so that no row
inherits another's CUDA context, allocator state or Dynamo caches):
  torch.compile   the unsharded model under torch.compile (the baseline)
  sharc compiled  sharc.shard(model), then torch.compile(backend="sharc")
  FSDP2 compiled  fully_shard on every block and the root, then torch.compile

Every row builds the same model (same seed), trains on the same batch (random
tokens, fixed seed) with AdamW (foreach) under bf16 autocast, TF32 allowed,
in a process group of one rank (NCCL on cuda, gloo on cpu). A row measures
its first step (compilation included), then runs --warmup steps, resets the
peak-memory counter, and times --steps steps, each between two
synchronizations; step time is their median. At world size 1 sharc and FSDP2
communicate nothing across ranks, so their step time over torch.compile's is
what sharding itself costs (the target: sharc at most 1.03x).

The losses after the last step must agree across rows within --loss-rtol:
the same model and data, differing only in bf16 rounding order.

Writes --out/gpu.json and --out/gpu.md after every row (a later row that
hangs still leaves the earlier ones). Exits nonzero when a row failed or the
losses disagree.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROWS = ["torch.compile", "sharc compiled", "FSDP2 compiled"]
BASELINE = "torch.compile"
ALIASES = {"compile": "torch.compile", "torch": "torch.compile", "sharc": "sharc compiled",
           "fsdp2": "FSDP2 compiled", "fsdp": "FSDP2 compiled"}
TARGET_OVERHEAD = 1.03
GPT_124M = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
TINY = dict(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_embd=64)
COLUMNS = ["row", "compile_s", "step_ms", "step_ratio", "tokens_per_s", "peak_MiB",
           "peak_ratio", "first_loss", "last_loss", "loss_match"]


# ---------------------------------------------------------------- one row


def _init_group(device: str) -> None:
    """A process group of one rank from a file store: sharc and FSDP2 both
    shard over a group, and at world size 1 neither needs a launcher."""
    import torch.distributed as dist

    store = tempfile.NamedTemporaryFile(prefix="gpu_bench_store_", delete=False).name
    os.unlink(store)  # the file store wants to create it
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"file://{store}", rank=0, world_size=1)


def _gpt_classes():
    """sharc's GPT, loaded from its file alone: importing sharc.models.gpt
    imports sharc, which loads the C++ extension, and the rows without
    sharc must still run where that extension failed to build."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python",
                        "sharc", "models", "gpt.py")
    spec = importlib.util.spec_from_file_location("_bench_gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.GPT, module.GPTConfig


def _build(row: str, opts: dict):
    """The row's model (seed 0, on the device), the callable a step runs, and
    the model's parameter count (tied weights once), taken before sharding."""
    import torch

    GPT, GPTConfig = _gpt_classes()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**(TINY if opts["tiny"] else GPT_124M))).to(opts["device"])
    params = sum(p.numel() for p in model.parameters())
    backend = "inductor"
    if row == "sharc compiled":
        import sharc

        sharc.shard(model)
        backend = "sharc"
    elif row == "FSDP2 compiled":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    if opts["compile"] == "blocks":
        for block in model.blocks:  # in place: the model's own forward calls them
            block.compile(backend=backend)
        return model, model, params
    return model, torch.compile(model, backend=backend), params


def _batch(opts: dict):
    """One fixed batch of random tokens (inputs and targets), the same for
    every row: timing and loss comparison need identical work."""
    import torch

    vocab = (TINY if opts["tiny"] else GPT_124M)["vocab_size"]
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, vocab, (opts["batch"], opts["seq"]), generator=g)
    y = torch.randint(0, vocab, (opts["batch"], opts["seq"]), generator=g)
    return x.to(opts["device"]), y.to(opts["device"])


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _training_step(row: str, opts: dict):
    """The row's group, model, optimizer and batch, set up on the device; returns
    one training step (its loss, detached) and the parameter count."""
    import torch

    device = opts["device"]
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    _init_group(device)
    model, step_fn, params = _build(row, opts)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    x, y = _batch(opts)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, params


def _run_row(row: str, opts: dict) -> dict:
    """Builds, compiles, warms up and times one row; returns its figures."""
    import torch

    device = opts["device"]
    step, params = _training_step(row, opts)
    _sync(device)
    t0 = time.perf_counter()
    first_loss = step().float().item()
    compile_s = time.perf_counter() - t0
    for _ in range(opts["warmup"]):
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if device == "cuda" else None
    times = []
    for _ in range(opts["steps"]):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = opts["batch"] * opts["seq"]
    return {"row": row, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "compile_s": compile_s, "step_s": step_s, "step_times_s": times,
            "tokens_per_s": tokens / step_s, "first_loss": first_loss,
            "last_loss": loss.float().item(), "parameters": params,
            "resident_bytes": resident,
            "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}


def _summary(e: BaseException) -> str:
    """An error in one line for the table: its first line and, where the
    cause is wrapped (Dynamo's "backend='sharc' raised:"), its last."""
    lines = [line.strip() for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return text[:300]


def _child(row: str, opts: dict, result_path: str) -> int:
    """A row's subprocess: its figures, or its error, into result_path."""
    faulthandler.enable()  # a crash in native code still shows where
    try:
        result = _run_row(row, opts)
        code = 0
    except BaseException as e:  # noqa: BLE001  (reported to the parent and printed)
        traceback.print_exc()
        result = {"row": row, "error": _summary(e)}
        code = 1
    with open(result_path, "w") as f:
        json.dump(result, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (the figures are written; teardown may not matter)
        traceback.print_exc()
    return code


# ---------------------------------------------------------------- the parent


def _spawn(row: str, opts: dict, limit_s: float) -> dict:
    """Runs one row in a fresh interpreter, echoing its output prefixed by
    the row's name, and killing it after limit_s. With fresh_cache its
    Inductor and Triton caches are new directories (a cold compile however
    often the script has run); without, a rerun compiles from the caches an
    earlier run left, which saves minutes of a short GPU lease."""
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as tmp:
        result_path = os.path.join(tmp, "result.json")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if opts["fresh_cache"]:
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        cmd = [sys.executable, os.path.abspath(__file__), "--_row", row, "--_opts",
               json.dumps(opts), "--_result", result_path]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        timer = threading.Timer(limit_s, proc.kill)
        timer.start()
        tail = collections.deque(maxlen=40)
        for line in proc.stdout:
            print(f"[{row}] {line}", end="", flush=True)
            if line.strip():
                tail.append(line.strip())
        proc.wait()
        timed_out = not timer.is_alive() and proc.returncode < 0
        timer.cancel()
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
            if proc.returncode != 0 and "error" not in result:
                result["error"] = f"exit status {proc.returncode} after its figures"
            return result
        return {"row": row, "error": _death(proc.returncode, timed_out, limit_s, tail)[:300]}


def _death(code: int, timed_out: bool, limit_s: float, tail) -> str:
    """Why a row left no figures: killed by the time limit, a signal (the
    innermost frame faulthandler printed), or an exit status (the last line)."""
    if timed_out:
        return f"killed after {limit_s:.0f}s (--time-limit)"
    if code < 0:
        frames = [line for line in tail if line.startswith('File "')]
        where = f", in {frames[0]}" if frames else ""
        return f"died of {signal.Signals(-code).name}{where}"
    return f"exit status {code}: {tail[-1] if tail else 'no output'}"


def _table_rows(results: list[dict], rtol: float) -> list[dict]:
    """The printed figures: ratios to torch.compile, and whether each row's
    last loss is the baseline's within rtol."""
    base = next((r for r in results if r["row"] == BASELINE and "error" not in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append({"row": r["row"], "error": r["error"]})
            continue
        peak = r["peak_bytes"]

        def ratio(key):
            if base is None or r.get(key) is None or not base.get(key):
                return None
            return round(r[key] / base[key], 3)

        match = None
        if base is not None:
            match = "yes" if abs(r["last_loss"] - base["last_loss"]) <= rtol * abs(
                base["last_loss"]) else "NO"
        rows.append({"row": r["row"], "compile_s": round(r["compile_s"], 1),
                     "step_ms": round(r["step_s"] * 1e3, 2), "step_ratio": ratio("step_s"),
                     "tokens_per_s": round(r["tokens_per_s"]),
                     "peak_MiB": None if peak is None else round(peak / 2**20, 1),
                     "peak_ratio": ratio("peak_bytes"),
                     "first_loss": round(r["first_loss"], 5), "last_loss": round(r["last_loss"], 5),
                     "loss_match": match})
    return rows


def _markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            cells = [r["row"], f"FAILED: {r['error']}".replace("|", "\\|")]
            cells += [""] * (len(COLUMNS) - 2)
        else:
            cells = ["" if r[c] is None else str(r[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _verdicts(rows: list[dict], rtol: float) -> list[str]:
    """The sentences under the table: the overhead target and the losses."""
    out = []
    by_name = {r["row"]: r for r in rows if "error" not in r}
    sharc_row = by_name.get("sharc compiled")
    if sharc_row and sharc_row["step_ratio"] is not None:
        met = "met" if sharc_row["step_ratio"] <= TARGET_OVERHEAD else "MISSED"
        out.append(f"sharc compiled / torch.compile step time: {sharc_row['step_ratio']}x "
                   f"(target <= {TARGET_OVERHEAD}x: {met})")
    if BASELINE in by_name and len(by_name) > 1:
        agree = all(r["loss_match"] == "yes" for r in by_name.values())
        out.append(f"last losses {'agree' if agree else 'DISAGREE'} within rtol {rtol} "
                   f"of {BASELINE}'s ({by_name[BASELINE]['last_loss']})")
    elif BASELINE not in by_name:
        out.append(f"{BASELINE} did not run: no ratios and no loss comparison")
    return out


def _meta(opts: dict, results: list[dict]) -> dict:
    import torch

    meta = {"device": opts["device"], "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": next((r["gpu"] for r in results if r.get("gpu")), None),
            "model": TINY if opts["tiny"] else GPT_124M,
            "parameters": next((r["parameters"] for r in results if r.get("parameters")), None),
            "world_size": 1, "backend": "nccl" if opts["device"] == "cuda" else "gloo",
            "autocast": "bfloat16", "tf32": opts["device"] == "cuda", "optimizer":
            "AdamW(lr=3e-4, foreach=True)"}
    meta.update({k: opts[k] for k in ("batch", "seq", "warmup", "steps", "compile",
                                      "fresh_cache")})
    return meta


def _write(out: str, meta: dict, results: list[dict], rows: list[dict],
           verdicts: list[str]) -> str:
    """out/gpu.json (meta, raw results, table rows) and out/gpu.md."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "rows": rows, "verdicts": verdicts}, f,
                  indent=2)
    gpu = meta["gpu"] or meta["device"]
    text = (f"# sharc on one GPU: {gpu}\n\ntorch {meta['torch']}, CUDA {meta['cuda']}; "
            f"batch {meta['batch']} x {meta['seq']} tokens, {meta['warmup']} warm-up and "
            f"{meta['steps']} timed steps, compile={meta['compile']}, bf16 autocast, "
            f"world size 1.\nRatios are to {BASELINE} (lower is better).\n\n"
            f"{_markdown(rows)}\n\n" + "".join(f"- {v}\n" for v in verdicts)
            + f"\n```\n{json.dumps(meta)}\n```\n")
    with open(os.path.join(out, "gpu.md"), "w") as f:
        f.write(text)
    return text


def _options(args) -> dict:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu.py: no CUDA device visible (use --device cpu --tiny for a "
                             "smoke test without one)")
    small = args.tiny
    return {"device": args.device, "tiny": args.tiny, "compile": args.compile,
            "batch": args.batch or (2 if small else 8),
            "seq": args.seq or ((TINY if small else GPT_124M)["block_size"]),
            "warmup": args.warmup, "steps": args.steps, "fresh_cache": args.fresh_cache}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer 64-wide GPT (a smoke test, e.g. with --device cpu)")
    parser.add_argument("--rows", nargs="+", default=ROWS, metavar="ROW",
                        help=f"rows to run, of {ROWS} (or sharc, compile, fsdp2)")
    parser.add_argument("--compile", choices=["whole", "blocks"], default="whole",
                        help="whole: compile the whole model; blocks: compile each "
                             "transformer block in place (cheaper compile)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 8; tiny 2)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default block_size)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fresh-cache", action="store_true",
                        help="give each row empty Inductor and Triton caches (compile_s "
                             "then always measures a cold compile)")
    parser.add_argument("--loss-rtol", type=float, default=2e-2,
                        help="relative tolerance of the last losses against torch.compile's")
    parser.add_argument("--time-limit", type=float, default=315,
                        help="seconds for all rows together; a row still running then is "
                             "killed and shown failed")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results"))
    parser.add_argument("--_row", help=argparse.SUPPRESS)
    parser.add_argument("--_opts", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._row:
        return _child(args._row, json.loads(args._opts), args._result)

    names = [ALIASES.get(n.lower(), n) for n in args.rows]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {ROWS}")
    names = sorted(set(names), key=ROWS.index)  # the baseline first
    opts = _options(args)
    print(f"gpu.py: rows {names}, options {opts}", flush=True)
    deadline = time.monotonic() + args.time_limit
    results: list[dict] = []
    for name in names:
        left = deadline - time.monotonic()
        if left < 5:
            results.append({"row": name, "error": "not started: --time-limit spent"})
        else:
            start = time.monotonic()
            results.append(_spawn(name, opts, left))
            print(f"gpu.py: {name}: {'FAILED' if 'error' in results[-1] else 'done'} in "
                  f"{time.monotonic() - start:.1f}s", flush=True)
        rows = _table_rows(results, args.loss_rtol)
        verdicts = _verdicts(rows, args.loss_rtol)
        text = _write(args.out, _meta(opts, results), results, rows, verdicts)
    print("\n" + text, flush=True)
    failed = [r["row"] for r in rows if "error" in r]
    disagree = [r["row"] for r in rows if r.get("loss_match") == "NO"]
    if failed:
        print(f"gpu.py: failed rows: {failed}", flush=True)
    if disagree:
        print(f"gpu.py: last loss differs from {BASELINE}'s beyond rtol {args.loss_rtol}: "
              f"{disagree}", flush=True)
    return 1 if failed or disagree else 0


if __name__ == "__main__":
    sys.exit(main())
