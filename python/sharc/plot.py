"""Loss and memory over steps of a training run, drawn from its metrics.

    python -m sharc.plot RUN_DIR [--out FILE]     # default RUN_DIR/metrics.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sharc.run_dir import RunDir

MIB = 2**20


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draws training and validation loss, and each rank's memory figures,
    against the step; writes a PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    run = RunDir(run_dir)
    records = run.read_metrics()
    out = Path(out) if out is not None else run.path / "metrics.png"
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, sharex=True, figsize=(8, 7))
    _plot_losses(ax_loss, records)
    _plot_memory(ax_mem, records)
    ax_mem.set_xlabel("step")
    fig.suptitle(f"sharc run {run.path.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _series(records, key):
    points = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def _plot_losses(ax, records) -> None:
    for key, label in (("loss", "train"), ("val_loss", "validation")):
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, label=label, marker="." if key == "val_loss" else None)
    ax.set_ylabel("loss (nats / char)")
    ax.grid(alpha=0.3)
    ax.legend()


def _plot_memory(ax, records) -> None:
    with_memory = [r for r in records if "memory" in r]
    ranks = sorted({m["rank"] for r in with_memory for m in r["memory"]})
    figures = (("shard_bytes", "shards"), ("optimizer_state_bytes", "optimizer state"),
               ("peak_gathered_bytes", "peak gathered"), ("max_rss_bytes", "max RSS"))
    for rank in ranks:
        for key, label in figures:
            points = [(r["step"], m[key]) for r in with_memory for m in r["memory"]
                      if m["rank"] == rank and key in m]
            if points:
                ax.plot([s for s, _ in points], [v / MIB for _, v in points],
                        label=f"r{rank} {label}")
    ax.set_yscale("log")
    ax.set_ylabel("MiB per rank")
    ax.grid(alpha=0.3)
    if ranks:
        ax.legend(fontsize="small", ncol=2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="sharc-plot", description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG to write (default RUN_DIR/metrics.png)")
    a = p.parse_args(argv)
    print(plot_run(a.run_dir, a.out))


if __name__ == "__main__":
    main()
