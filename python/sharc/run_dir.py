"""A training run's directory: what the trainer writes and `--resume` and
`sharc.plot` read.

    <run>/config.json            the TrainConfig the run started with
    <run>/metrics.jsonl          one JSON object per line (see train/trainer.py)
    <run>/checkpoints/step-N     sharc.save_checkpoint directories
    <run>/metrics.png            sharc.plot's figure
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_CHECKPOINT = re.compile(r"step-(\d+)")  # exact name: .partial/.previous never match


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def config_file(self) -> Path:
        return self.path / "config.json"

    def checkpoint(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step-{step:07d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every published checkpoint, oldest first."""
        root = self.path / "checkpoints"
        if not root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in root.iterdir()
                 if (m := _CHECKPOINT.fullmatch(p.name)) and p.is_dir()]
        return sorted(found)

    def latest_checkpoint(self) -> tuple[int, Path]:
        found = self.checkpoints()
        if not found:
            raise FileNotFoundError(f"no checkpoint in {self.path / 'checkpoints'}; a run "
                                    "writes one every --checkpoint-every steps and at the end")
        return found[-1]

    def prune_checkpoints(self, keep: int) -> None:
        """Deletes all but the newest `keep` checkpoints (rank 0 only)."""
        for _, path in self.checkpoints()[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def write_config(self, config: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(json.dumps(config, indent=2) + "\n")

    def read_config(self) -> dict:
        if not self.config_file.is_file():
            raise FileNotFoundError(f"{self.path} is not a run directory (no config.json)")
        return json.loads(self.config_file.read_text())

    def append_metrics(self, record: dict) -> None:
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict]:
        if not self.metrics_file.is_file():
            raise FileNotFoundError(f"no metrics in {self.path} (expected metrics.jsonl)")
        with self.metrics_file.open() as f:
            return [json.loads(line) for line in f if line.strip()]
