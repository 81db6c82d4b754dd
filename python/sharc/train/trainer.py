"""The main job: train a small GPT on Tiny Shakespeare, sharded over N ranks.

    python -m sharc.train                      # 2 local gloo ranks
    torchrun --nproc-per-node 2 -m sharc.train # the same under torchrun
    python -m sharc.train --resume runs/X      # continue run X from its last checkpoint

Every --log-every steps a JSON line (step, loss, tokens/s, per-rank memory)
goes to RUN_DIR/metrics.jsonl, every --eval-every steps the validation loss
too; a checkpoint is saved every --checkpoint-every steps and at the end.
--dtype bf16 / fp16 trains in mixed precision (sharc.MixedPrecision).
--init meta builds the model on the meta device and initialises it into
its shards (sharc.init_weights): the path for models bigger than one rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

import sharc
from sharc.data import CharDataset
from sharc.launch import configure_threads, launch
from sharc.models.gpt import GPT, GPTConfig
from sharc.run_dir import RunDir
from sharc.train import report

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""--dtype's choices: the dtype parameters are gathered in and forward and
backward compute in."""


INITS = ("normal", "meta")
"""--init's choices: how the model gets its initial values."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 800
    """Optimizer steps in total (a resumed run continues up to this)."""
    batch_per_rank: int = 16
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    lr: float = 3e-3
    """Peak learning rate: linear warm-up, then cosine decay to lr / 10."""
    warmup_steps: int = 50
    weight_decay: float = 0.1
    seed: int = 0
    log_every: int = 25
    eval_every: int = 200
    """Validation loss (held-out last 10% of the text) every this many steps."""
    eval_batches: int = 8
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    run_dir: str = ""
    """Where metrics and checkpoints go (default runs/<date-time>)."""
    compile: bool = True
    """torch.compile(backend="sharc"): measured about 25-40% more tokens/s than
    eager for the default model on 2 CPU cores, which repays its compile time
    within the run (docs/training.md). --eager / --no-compile override."""
    sample_chars: int = 300
    """Characters of text generated at the end (0: none)."""
    plot: bool = False
    """Draw RUN_DIR/metrics.png at the end (sharc.plot)."""
    init: str = dataclasses.field(default="normal", metadata={"choices": INITS})
    """normal: every rank builds the whole model, then shards it. meta: the
    model is built on the meta device (no memory), sharded (each rank
    allocates only its shards) and initialised into the shards one module
    at a time (sharc.init_weights): the same values, and so the same losses,
    for the same seed; the way to train a model bigger than one rank."""
    dtype: str = dataclasses.field(default="fp32", metadata={"choices": tuple(DTYPES)})
    """fp32, or mixed precision: bf16 / fp16 parameters gathered and computed
    with, gradients reduced in fp32, shards and AdamW state kept in fp32
    (sharc.MixedPrecision). fp16 also scales the loss (torch.amp.GradScaler)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_per_rank", "seq_len", "log_every", "eval_every",
                     "eval_batches", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.warmup_steps < 0 or self.sample_chars < 0:
            raise ValueError("--warmup-steps and --sample-chars must not be negative")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {', '.join(INITS)}, got {self.init!r}")


def _parse(argv=None) -> tuple[TrainConfig, int, str | None]:
    p = argparse.ArgumentParser(prog="sharc-train", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks (ignored under torchrun)")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue RUN_DIR from its last checkpoint, with its saved config "
                        "(options given here override it)")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        flag, value = f"--{field.name.replace('_', '-')}", getattr(defaults, field.name)
        shown = "runs/<date>-<time>" if value == "" else value  # run_dir is the only ""
        if isinstance(value, bool):
            p.add_argument(flag, default=None, action=argparse.BooleanOptionalAction,
                           help=f"default: {'on' if value else 'off'}")
        else:
            # Choices are listed, not enforced here: TrainConfig checks them,
            # also for a resumed run's saved config.
            choices = field.metadata.get("choices")
            extra = f"; one of {', '.join(choices)}" if choices else ""
            p.add_argument(flag, type=type(value), default=None,
                           help=f"default: {shown}{extra}")
    p.add_argument("--eager", dest="compile", action="store_false", default=None,
                   help="same as --no-compile")
    a = vars(p.parse_args(argv))
    nproc, resume = a.pop("nproc"), a.pop("resume")
    given = {k: v for k, v in a.items() if v is not None}  # explicitly on the command line
    base = RunDir(resume).read_config() if resume else {}
    base.update(given)
    if resume:
        base["run_dir"] = resume
    return TrainConfig(**base), nproc, resume


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _progress(rank: int, start: int, total: int):
    if rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(initial=start, total=total, desc="sharc train", unit="step",
                dynamic_ncols=True)


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(step_fn, data: CharDataset, cfg: TrainConfig) -> float:
    """Mean loss over a fixed set of held-out batches (the same every time).
    Collective: every rank evaluates its slice."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(())
    for i in range(cfg.eval_batches):
        x, y = data.rank_batch(i, cfg.batch_per_rank, cfg.seq_len, rank, world,
                               seed=cfg.seed + 1, split="val")
        total += step_fn(x, y)
    return _mean_over_ranks(total / cfg.eval_batches)


@dataclass
class _Trainee:
    """What trains: the sharded model, what runs its forward (the model or
    its compiled wrapper), the optimizer, and with --dtype fp16 the loss
    scaler."""

    model: torch.nn.Module
    step_fn: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    skipped_steps: int = 0
    """fp16 steps the scaler skipped (inf or NaN gradients) in this run."""

    def backward_and_step(self, loss: torch.Tensor) -> None:
        """Backward, then an optimizer step. With a scaler, the loss is
        scaled first and a step whose gradients hold an inf or NaN is
        skipped (and the scale lowered); sharc's reductions carry a
        non-finite flag, so every rank sees it and skips alike."""
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.skipped_steps += self.scaler.get_scale() < scale
        self.opt.zero_grad(set_to_none=True)


def _mixed_precision(cfg: TrainConfig) -> sharc.MixedPrecision | None:
    if DTYPES[cfg.dtype] is torch.float32:
        return None
    return sharc.MixedPrecision(param_dtype=DTYPES[cfg.dtype], reduce_dtype=torch.float32)


def _dtype_text(cfg: TrainConfig) -> str:
    if cfg.dtype == "fp32":
        return "fp32"
    return f"{cfg.dtype} mixed precision (fp32 shards and optimizer state)"


def _init_text(cfg: TrainConfig) -> str:
    if cfg.init == "meta":
        return "built on the meta device and initialised into shards; "
    return ""


def _sharded_model(cfg: TrainConfig, data: CharDataset) -> tuple[GPT, int, str]:
    """The GPT, sharded: built whole on every rank (--init normal), or built
    on the meta device and initialised into its shards (--init meta), with
    the same values from the same seed."""
    gpt_cfg = GPTConfig(vocab_size=data.vocab_size, block_size=cfg.seq_len,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
    torch.manual_seed(cfg.seed)
    with torch.device("meta") if cfg.init == "meta" else contextlib.nullcontext():
        model = GPT(gpt_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    savings = report.savings_line(model, dist.get_world_size())
    sharc.shard(model, config=sharc.ShardConfig(mixed_precision=_mixed_precision(cfg)))
    if cfg.init == "meta":  # GPT.__init__ ends with self.apply(self._init_weights)
        sharc.init_weights(model, init_fn=model._init_weights)
    return model, n_params, savings


def _build(cfg: TrainConfig, data: CharDataset) -> tuple[_Trainee, int, str]:
    model, n_params, savings = _sharded_model(cfg, data)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    step_fn = torch.compile(model, backend="sharc") if cfg.compile else model
    scaler = None
    if cfg.dtype == "fp16":  # bf16 has fp32's exponent range: no scaling needed
        scaler = torch.amp.GradScaler(next(model.parameters()).device.type)
    return _Trainee(model, step_fn, opt, scaler), n_params, savings


def _run_dir(cfg: TrainConfig) -> RunDir:
    """The run directory, named by rank 0 (ranks under torchrun do not share
    a clock reading) and created by it with the config."""
    name = [cfg.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))]
    dist.broadcast_object_list(name, src=0)
    run = RunDir(name[0])
    if dist.get_rank() == 0 and not run.config_file.exists():
        run.write_config(dataclasses.asdict(cfg) | {"run_dir": name[0]})
    dist.barrier()
    return run


class _Interval:
    """Loss, tokens and training time since the last log line."""

    def __init__(self):
        self.losses: list[torch.Tensor] = []  # fp32 whatever the compute dtype
        self.seconds = 0.0

    def take(self) -> tuple[torch.Tensor, float]:
        mean, seconds = torch.stack(self.losses).mean(), self.seconds
        self.losses, self.seconds = [], 0.0
        return mean, seconds


def train(cfg: TrainConfig, resume: bool = False) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    configure_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor")  # DCP's own
    data = CharDataset()
    t, n_params, savings = _build(cfg, data)
    run = _run_dir(cfg)
    start = _resume(run, t) if resume else {"step": 0, "train_seconds": 0.0}
    if rank == 0:
        print(f"sharc: {n_params / 1e6:.2f}M parameters, {world} ranks "
              f"({dist.get_backend()}), {cfg.batch_per_rank}x{cfg.seq_len} tokens per rank, "
              f"{'compiled' if cfg.compile else 'eager'}; {_dtype_text(cfg)}; {_init_text(cfg)}"
              f"run directory {run.path}", flush=True)
        print(savings, flush=True)
    last = _loop(cfg, run, data, t, start)
    _finish(cfg, run, data, t, last)


def _resume(run: RunDir, t: _Trainee) -> dict:
    step, path = run.latest_checkpoint()
    extra = sharc.load_checkpoint(path, t.step_fn, t.opt)
    if t.scaler is not None and "grad_scaler" in extra:  # absent: the run was not fp16
        t.scaler.load_state_dict(extra["grad_scaler"])
    if dist.get_rank() == 0:
        print(f"sharc: resumed from {path} at step {extra['step']}", flush=True)
    return extra


def _loop(cfg, run, data, t: _Trainee, start: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens_per_step = cfg.batch_per_rank * cfg.seq_len * world
    bar = _progress(rank, start["step"], cfg.steps)
    interval, train_seconds, comm = _Interval(), start["train_seconds"], _Comm()
    record, first_loss = {"step": start["step"]}, None
    for step in range(start["step"], cfg.steps):
        t0 = time.perf_counter()
        for group in t.opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        x, y = data.rank_batch(step, cfg.batch_per_rank, cfg.seq_len, rank, world, cfg.seed,
                               split="train")
        loss = t.step_fn(x, y)
        t.backward_and_step(loss)
        interval.losses.append(loss.detach().float())
        interval.seconds += time.perf_counter() - t0
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            record = _log(t, interval, done, tokens_per_step, comm)
            first_loss = record["loss"] if first_loss is None else first_loss
            train_seconds += record["interval_seconds"]
            record["train_seconds"] = train_seconds
            if done % cfg.eval_every == 0 or done == cfg.steps:
                record["val_loss"] = evaluate(t.step_fn, data, cfg)
            if rank == 0:
                run.append_metrics(record)
                bar.set_postfix_str(_postfix(record))
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            _checkpoint(cfg, run, t, done, train_seconds)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return record | {"comm": comm, "first_loss": first_loss,
                     "steps_run": cfg.steps - start["step"]}


class _Comm:
    """This rank's bytes sent, and every rank's peak gathered bytes, over the
    whole run (the runtime's counters are reset at every log line so that
    each line's figures are its interval's)."""

    def __init__(self):
        self.totals = {"allgather_bytes": 0, "reduce_scatter_bytes": 0}
        self.peaks: dict[int, int] = {}

    def add(self, memory: list[dict]) -> None:
        for key in self.totals:
            self.totals[key] += memory[dist.get_rank()][key]
        for m in memory:
            self.peaks[m["rank"]] = max(self.peaks.get(m["rank"], 0), m["peak_gathered_bytes"])


def _log(t: _Trainee, interval: _Interval, done: int, tokens_per_step: int,
         comm: _Comm) -> dict:
    steps = len(interval.losses)  # fewer than log_every right after a resume
    loss, seconds = interval.take()
    memory = report.all_rank_memory(t.opt)  # collective: every rank takes part
    comm.add(memory)
    sharc.reset_memory_stats()
    record = {"step": done, "loss": _mean_over_ranks(loss), "lr": t.opt.param_groups[0]["lr"],
              "tokens_per_s": steps * tokens_per_step / max(seconds, 1e-9),
              "interval_seconds": seconds, "memory": memory}
    if t.scaler is not None:
        record["loss_scale"] = t.scaler.get_scale()
    return record


def _postfix(record: dict) -> str:
    text = f"loss {record['loss']:.3f}"
    if "val_loss" in record:
        text += f" | val {record['val_loss']:.3f}"
    mem = " ".join(f"r{m['rank']}:{m['shard_bytes'] / 2**20:.1f}+"
                   f"{m['peak_gathered_bytes'] / 2**20:.1f}MiB" for m in record["memory"])
    return f"{text} | {record['tokens_per_s']:,.0f} tok/s | mem {mem}"


def _checkpoint(cfg, run: RunDir, t: _Trainee, done: int, train_seconds: float) -> None:
    # The data order is a pure function of (seed, step): the step is the data position.
    extra = {"step": done, "data_step": done, "train_seconds": train_seconds}
    if t.scaler is not None:  # a few numbers, JSON as they are
        extra["grad_scaler"] = t.scaler.state_dict()
    sharc.save_checkpoint(run.checkpoint(done), t.step_fn, t.opt, extra=extra)
    if dist.get_rank() == 0:
        run.prune_checkpoints(cfg.keep_checkpoints)


def _finish(cfg, run: RunDir, data: CharDataset, t: _Trainee, last: dict) -> None:
    sample = _sample(cfg, data, t.model) if cfg.sample_chars else None
    memory = report.all_rank_memory(t.opt)
    if dist.get_rank() != 0:
        return
    if sample is not None:
        print(f"sharc: sample:\n{sample}\n", flush=True)
    for m in memory:  # the run's peak, not the last interval's
        m["peak_gathered_bytes"] = max(m["peak_gathered_bytes"],
                                       last["comm"].peaks.get(m["rank"], 0))
    for line in report.totals_lines(memory, last["comm"].totals):
        print(line, flush=True)
    if "loss" in last:
        print(f"sharc: loss {last['first_loss']:.4f} -> {last['loss']:.4f} in "
              f"{last['steps_run']} steps (step {last['step']}), val loss "
              f"{last['val_loss']:.4f}, {last['train_seconds']:.1f}s training, {cfg.dtype}",
              flush=True)
    if t.scaler is not None:
        print(f"sharc: fp16 loss scaling: {t.skipped_steps} of {last['steps_run']} steps "
              f"skipped for inf/NaN gradients, final scale {t.scaler.get_scale():g}", flush=True)
    if cfg.plot:
        from sharc.plot import plot_run

        print(f"sharc: plot {plot_run(run.path)}", flush=True)


def _sample(cfg, data: CharDataset, model) -> str:
    """Text generated by the trained model; every rank samples the same
    (collective forwards, one seed), rank 0 prints it."""
    gen = torch.Generator().manual_seed(cfg.seed)
    prompt = data.encode("\n").view(1, 1)
    out = model.generate(prompt, cfg.sample_chars, temperature=0.8, top_k=20, generator=gen)
    return data.decode(out[0].tolist())


def main(argv=None) -> None:
    cfg, nproc, resume = _parse(argv)
    launch(train, nproc, "gloo", (cfg, resume is not None))
