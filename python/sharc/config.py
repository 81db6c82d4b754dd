"""User-facing configuration, validated once."""

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class ShardConfig:
    """How `sharc.shard` shards a module."""

    verify_replicas: bool = True
    """Check at shard() time, with one collective, that every rank holds the
    same parameters (names, shapes, dtypes and a value checksum). Ranks that
    start from different values would each keep a slice of a different model."""

    def __post_init__(self) -> None:
        if not isinstance(self.verify_replicas, bool):
            raise TypeError(
                f"ShardConfig.verify_replicas must be a bool, got {self.verify_replicas!r}")
