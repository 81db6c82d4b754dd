"""What a user can see of a compiled step: profiler labels for every runtime
op, the IR of each graph before and after the passes, and exact per-step
communication counters."""

import os
import re
import tempfile

import torch

from dist_harness import run_ranks
from models import global_batch, make_parity_model, rank_slice


def _observe(rank, world, dump_dir):
    import sharc

    model = make_parity_model()
    sharc.shard(model)
    root = sharc.api.sharded_root(model)
    shard_bytes = {r.fqn: r.shard.numel() * r.shard.element_size()
                   for r in root.refs_by_shard.values()}
    trainable = {r.fqn for r in root.refs_by_shard.values() if r.shard.requires_grad}
    # Unprofiled: the counters pinned below are those of the plain schedule
    # (selective unsharding would skip the kept parameters' backward gathers).
    compiled = torch.compile(model, backend="sharc", options={"dump_ir": dump_dir,
                                                               "profile": False})
    x, y = global_batch(0, 2 * world)
    x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
    per_step = []
    for step in range(3):
        sharc.reset_memory_stats()
        with torch.profiler.profile() as prof:
            loss = compiled(x, y)
            after_forward = sharc.memory_stats()
            loss.backward()
        per_step.append((after_forward, sharc.memory_stats(),
                         sorted({e.name for e in prof.events() if e.name.startswith("sharc")})))
        model.zero_grad()
    return shard_bytes, trainable, per_step


def test_profiler_labels_ir_dumps_and_per_step_counters():
    with tempfile.TemporaryDirectory() as dump_dir:
        for rank, (shard_bytes, trainable, per_step) in enumerate(
                run_ranks(_observe, 2, dump_dir)):
            all_shards = sum(shard_bytes.values())
            trainable_shards = sum(b for n, b in shard_bytes.items() if n in trainable)
            for after_forward, after_step, labels in per_step[1:]:  # compiled by now
                # Forward gathers every parameter exactly once; ring volume (W-1)*shard.
                assert after_forward["allgather_bytes"] == all_shards
                # Every trainable gradient is reduced exactly once per step;
                # each collective adds one fp32 non-finite flag per rank.
                flags = after_step["reduce_scatter_calls"] * (2 - 1) * 4
                assert after_step["reduce_scatter_bytes"] == trainable_shards + flags
                assert after_step["allgather_bytes"] > after_forward["allgather_bytes"]
                # The ops and the runtime's labels inside them share their names.
                for label in ("sharc::start_gather", "sharc::wait_gather", "sharc::release",
                              "sharc::start_reduce_scatter", "sharc::wait_reduce_scatter"):
                    assert label in labels, f"{label} missing from {labels}"
            # The same traffic every step (the time spent waiting varies, and
            # the agreement's exchanges fall to none once the schedule has
            # repeated: test_collective_agreement.py pins that).
            timing = ("gather_wait_ns", "reduce_wait_ns", "agreement_calls")
            assert ({k: v for k, v in per_step[1][1].items() if k not in timing} ==
                    {k: v for k, v in per_step[2][1].items() if k not in timing})
            files = sorted(f for f in os.listdir(dump_dir) if f.startswith(f"rank{rank}_"))
            kinds = {f.split("_")[2].split(".")[0] for f in files}
            assert kinds == {"forward", "backward"}, files
            for name in files:
                text = open(os.path.join(dump_dir, name)).read()
                if name.endswith(".before.ir"):
                    assert " = gather @" not in text and "release @" not in text
                    assert " = compute " in text
                    assert ("grad=@" in text) == ("backward" in name)
                elif name.endswith(".after.ir"):
                    assert " = gather @" in text and "release @" in text
                    if "backward" in name:
                        assert " = reduce_scatter @" in text and " = wait_reduce %" in text
                elif name.endswith(".pipeline"):
                    # The pipeline that ran replays the schedule from the IR alone.
                    stem = os.path.join(dump_dir, name.removesuffix(".pipeline"))
                    replay = torch.classes.sharc.Scheduler.run(
                        open(stem + ".before.ir").read(), text,
                        torch.classes.sharc.ScheduleFacts())
                    assert replay.ir == open(stem + ".after.ir").read()
                else:
                    assert "# ---- before insert_gather_release" in text
                    assert re.search(r"# ---- after insert_gather_release \(.*rewrites=\d+",
                                     text)
                    # A safety net: the bridge's graphs never hand backward a full parameter.
                    assert "# ---- after regather_in_backward (rewrites=0)" in text
