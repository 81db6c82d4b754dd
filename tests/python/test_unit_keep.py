"""Small gather units stay gathered from forward to backward
(ShardConfig.unit_keep_bytes): their backward gathers nothing, the bytes
they hold are reported as kept, a forward dropped without backward leaves
them only until the next forward (and never serve it once the shards
changed), and training is bitwise the same as with
every unit released after its forward, on ranks whose routing differs,
eager and compiled (where profiling is on, so the schedule keeps what it
keeps: never a unit's members)."""

import warnings

import pytest
import torch

from dist_harness import run_ranks
from models import ThreeMoELayers

WIDTH, EXPERTS = 8, 3
UNITS = tuple(f"layers.{i}" for i in range(3))


def _batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4 + step % 2, 4, generator=g)


def _train(rank, world, mode, keep_bytes, units=UNITS):
    import sharc

    torch.manual_seed(0)
    model = ThreeMoELayers(WIDTH, EXPERTS)
    unit_bytes = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    sharc.shard(model, config=sharc.ShardConfig(gather_units=units, unit_keep_bytes=keep_bytes))
    fn = torch.compile(model, backend="sharc") if mode == "compiled" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"unit_bytes": unit_bytes, "losses": [], "kept_after_forward": [],
           "backward_gather_bytes": [], "after_step": []}
    for step in range(4):
        loss = fn(_batch(step, rank))
        out["kept_after_forward"].append(sharc.memory_stats()["kept_gathered_bytes"])
        sharc.reset_memory_stats()
        loss.backward()
        out["backward_gather_bytes"].append(sharc.memory_stats()["allgather_bytes"])
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["after_step"].append(_gathered_unit_members(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no buffer handed over to a reference
        dropped = fn(_batch(4, rank))
        out["kept_after_dropped"] = sharc.memory_stats()["kept_gathered_bytes"]
        del dropped
        with torch.no_grad():  # the shards change while the units are kept
            for p in model.parameters():
                p.mul_(0.5)
        loss = fn(_batch(5, rank))
        loss.backward()
        opt.step()
    out["last_loss"] = loss.item()
    out["after_last_step"] = _gathered_unit_members(model)
    out["params"] = sharc.full_state_dict(model)
    return out


def _gathered_unit_members(model):
    """The unit members whose buffer is gathered, or being gathered."""
    from sharc._state import sharded_root

    root = sharded_root(model)
    names = {f"layers.{n}" for n, _ in model.layers.named_parameters()}
    return [ref.fqn for ref in root.refs_by_shard.values()
            if ref.fqn in names and root.runtime.state(ref.pid) in ("gathering", "gathered")]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_small_units_stay_gathered_for_backward_and_train_the_same(mode):
    kept = run_ranks(_train, 2, mode, 1 << 20)
    released = run_ranks(_train, 2, mode, 0)
    for k, r in zip(kept, released):
        # Beyond what both keep: every unit member, in its gathered buffer
        # (padded to the shards), and none of them gathered in backward.
        for step in range(4):
            units = k["kept_after_forward"][step] - r["kept_after_forward"][step]
            assert k["unit_bytes"] <= units < 1.1 * k["unit_bytes"], (step, k, r)
            saved = r["backward_gather_bytes"][step] - k["backward_gather_bytes"][step]
            assert saved >= k["unit_bytes"] // 2, (step, k, r)  # each rank sends its half
        # Released at the end of backward, and after a dropped forward by
        # the next forward.
        assert k["after_step"] == [[]] * 4 and k["after_last_step"] == [], k
        units = k["kept_after_dropped"] - r["kept_after_dropped"]
        assert k["unit_bytes"] <= units < 1.1 * k["unit_bytes"], (k, r)
        # The forward after the write reads the new values, not the kept ones.
        assert k["losses"] == r["losses"] and k["last_loss"] == r["last_loss"], (k, r)
        for name, value in k["params"].items():
            assert torch.equal(value, r["params"][name]), name


def test_the_root_as_a_unit_is_gathered_anew_after_its_shards_changed():
    """The root as the unit enters the unit before any scope opens, so the
    next forward's scope cannot drop what the dropped forward kept first:
    the unit itself sees that its shards changed."""
    kept = run_ranks(_train, 2, "eager", 1 << 20, ("",))
    released = run_ranks(_train, 2, "eager", 0, ("",))
    for k, r in zip(kept, released):
        assert k["backward_gather_bytes"] == [0] * 4, k["backward_gather_bytes"]
        assert k["losses"] == r["losses"] and k["last_loss"] == r["last_loss"], (k, r)
        for name, value in k["params"].items():
            assert torch.equal(value, r["params"][name]), name
