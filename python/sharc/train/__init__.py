"""The main job: `python -m sharc.train` (or `sharc-train`) trains a small
GPT on Tiny Shakespeare, sharded over N ranks. The loop is trainer.py, its
memory figures report.py; see docs/training.md."""

from sharc.train.trainer import TrainConfig, main, train

__all__ = ["TrainConfig", "main", "train"]
