"""Full state dicts through rank 0 alone: sharc.full_state_dict(rank0_only=True)
gathers to rank 0 only, and sharc.load_full_state_dict(from_rank0=True)
loads what only rank 0 holds (a dict, or a file on rank 0's host), into a
model built normally or on the meta device. Bad input on rank 0, and ranks
that choose differently, make every rank raise and change nothing."""

import os
import tempfile

import torch

from dist_harness import run_ranks
from models import global_batch, make_parity_model


def _shifted(full: dict) -> dict:
    return {k: v + 1.0 if v.is_floating_point() else v.clone() for k, v in full.items()}


def _through_rank0(rank, world):
    import sharc

    model = make_parity_model()
    sharc.shard(model)
    everyone = sharc.full_state_dict(model)
    on_rank0 = sharc.full_state_dict(model, rank0_only=True)
    offloaded = sharc.full_state_dict(model, rank0_only=True, cpu_offload=True)
    gathered_after = sharc.memory_stats()["gathered_bytes"]

    new = _shifted(everyone)
    sharc.load_full_state_dict(model, new if rank == 0 else None, from_rank0=True)
    from_dict = sharc.full_state_dict(model)

    path = None
    if rank == 0:  # a file only rank 0's host has
        path = os.path.join(tempfile.mkdtemp(), "weights.pt")
        torch.save(_shifted(new), path)
    sharc.load_full_state_dict(model, path, from_rank0=True)
    from_file = sharc.full_state_dict(model)

    with torch.device("meta"):
        meta_built = make_parity_model()
    sharc.shard(meta_built)
    sharc.load_full_state_dict(meta_built, new if rank == 0 else None, from_rank0=True)
    x, y = global_batch(0, 2)
    loss = meta_built(x, y)
    loss.backward()
    return dict(everyone=everyone, on_rank0=on_rank0, offloaded=offloaded,
                gathered_after=gathered_after, new=new, from_dict=from_dict,
                from_file=from_file, meta_values=sharc.full_state_dict(meta_built),
                meta_loss=loss.detach())


def _assert_same(got: dict, want: dict):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_full_state_dict_and_loads_through_rank0_alone():
    results = run_ranks(_through_rank0, 3)  # rank 2 owns nothing of the 0-dim temperature
    reference = make_parity_model()
    reference.load_state_dict(results[0]["new"])
    x, y = global_batch(0, 2)
    want_loss = reference(x, y).detach()
    for rank, r in enumerate(results):
        if rank == 0:
            _assert_same(r["on_rank0"], r["everyone"])
            _assert_same(r["offloaded"], r["everyone"])
        else:
            assert r["on_rank0"] == {} and r["offloaded"] == {}
        assert r["gathered_after"] == 0
        _assert_same(r["from_dict"], results[0]["new"])
        _assert_same(r["from_file"], _shifted(results[0]["new"]))
        _assert_same(r["meta_values"], results[0]["new"])
        torch.testing.assert_close(r["meta_loss"], want_loss)


def _attempt(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test reads which one
        return type(e).__name__, str(e)
    return None


def _bad_calls(rank, world):
    import sharc

    model = make_parity_model()
    sharc.shard(model)
    before = sharc.full_state_dict(model)
    new = _shifted(before)
    missing = {k: v for k, v in new.items() if k != "temperature"}
    outcomes = {
        "missing key on rank 0": _attempt(lambda: sharc.load_full_state_dict(
            model, missing if rank == 0 else None, from_rank0=True)),
        "no file on rank 0": _attempt(lambda: sharc.load_full_state_dict(
            model, "/nonexistent/weights.pt" if rank == 0 else None, from_rank0=True)),
        "one rank loads its own": _attempt(lambda: sharc.load_full_state_dict(
            model, new, from_rank0=rank == 0)),
        "one rank gathers to rank 0": _attempt(lambda: sharc.full_state_dict(
            model, rank0_only=rank == 0)),
        "not a bool": _attempt(lambda: sharc.full_state_dict(model, rank0_only="yes")),
    }
    after = sharc.full_state_dict(model)
    outcomes["read fails on rank 0"] = _attempt(lambda: sharc.load_full_state_dict(
        model, _FailsOnRead(new, "lm_head.bias") if rank == 0 else None, from_rank0=True))
    return outcomes, before, after


class _FailsOnRead(dict):
    """A state dict whose `key` can be checked (shape, dtype) but not read:
    a file cut short after its header, as rank 0 meets it."""

    def __init__(self, values, key):
        super().__init__(values)
        self.key, self.looks = key, 0

    def __getitem__(self, key):
        if key == self.key:
            self.looks += 1
            if self.looks > 3:  # check_tensor, shape and dtype, then the read
                raise OSError(f"'{key}' could not be read")
        return super().__getitem__(key)


def test_bad_input_on_rank0_and_mixed_choices_raise_on_every_rank_and_change_nothing():
    for rank, (outcomes, before, after) in enumerate(run_ranks(_bad_calls, 2)):
        _assert_same(after, before)
        kind, message = outcomes["missing key on rank 0"]
        assert kind == "KeyError" and "temperature" in message
        kind, message = outcomes["no file on rank 0"]
        if rank == 0:
            assert kind == "FileNotFoundError" and "/nonexistent/weights.pt" in message
        else:
            assert kind == "RuntimeError" and "rank 0 could not read" in message
            assert "FileNotFoundError" in message
        for case in ("one rank loads its own", "one rank gathers to rank 0"):
            kind, message = outcomes[case]
            assert kind == "RuntimeError" and "ranks disagree" in message, (case, message)
        assert outcomes["not a bool"][0] == "TypeError"
        kind, message = outcomes["read fails on rank 0"]
        if rank == 0:
            assert kind == "OSError"
        else:
            assert kind == "RuntimeError" and "rank 0 failed to read 'lm_head.bias'" in message


def _hybrid(rank, world):
    import sharc

    model = make_parity_model()
    sharc.shard(model, config=sharc.ShardConfig(replicate_groups=((0, 2), (1, 3))))
    full = sharc.full_state_dict(model, rank0_only=True)
    refused = _attempt(lambda: sharc.load_full_state_dict(
        model, full if rank == 0 else None, from_rank0=True))
    return sorted(full), refused


def test_under_hybrid_sharding_each_shard_groups_rank0_gathers_and_loads_from_rank0_refuse():
    # Shard groups {0, 1} and {2, 3}: global ranks 0 and 2 are their rank 0s.
    names = sorted(make_parity_model().state_dict())
    for rank, (full, refused) in enumerate(run_ranks(_hybrid, 4)):
        assert full == (names if rank in (0, 2) else [])
        assert refused[0] == "ValueError" and "hybrid sharding" in refused[1]
