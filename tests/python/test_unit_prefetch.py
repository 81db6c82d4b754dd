"""Gather units ahead ([Note: gather units ahead] in eager_prefetch.h): from
the second step on, gathering a unit starts the unit that followed it, in
forward and in backward, so each unit after the first is in flight when
its forward begins. Training is bitwise the same as without prefetch, with
no more collectives, on ranks whose routing differs and whose batch size
changes from step to step, eager and compiled; a forward that raised
inside a unit, a write to the shards and a forward without backward in
between change nothing of that."""

import pytest
import torch

from dist_harness import run_ranks
from models import ThreeMoELayers

WIDTH, EXPERTS, LAYERS = 8, 3, 3  # ThreeMoELayers calls LAYERS layers
UNITS = tuple(f"layers.{i}" for i in range(LAYERS))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3 + step % 3, 4, generator=g)  # rows change per step


def _watch_units(model, root, seen):
    """Whether a unit's parameters are gathering or gathered (started ahead)
    before its own gather: in forward, as its forward begins (this pre-hook
    runs before sharc's); in backward, as the gradient of its output's
    consumer's input arrives (unit k's input is unit k-1's output, through
    a tanh), before the gradient reaches the unit."""
    refs = {id(r.shard): r for r in root.refs_by_shard.values()}

    def ahead(layer):
        states = {root.runtime.state(refs[id(p)].pid) for p in layer.parameters()}
        return bool(states & {"gathering", "gathered"})

    def watcher(index):
        @torch.compiler.disable
        def hook(module, args):
            seen.append((index, ahead(module)))
            if index > 0 and args[0].requires_grad:
                before = model.layers[index - 1]
                args[0].register_hook(lambda g: seen.append((f"bw{index - 1}", ahead(before))))
        return hook

    for index, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(watcher(index), prepend=True)


def _train(rank, world, mode, prefetch, plan):
    import sharc
    from sharc._state import sharded_root

    torch.manual_seed(0)
    model = ThreeMoELayers(WIDTH, EXPERTS)
    # Small units would stay gathered into backward (unit_keep_bytes): 0
    # has backward gather them, ahead, as large ones are.
    sharc.shard(model, config=sharc.ShardConfig(gather_units=UNITS, eager_prefetch=prefetch,
                                                unit_keep_bytes=0))
    seen = []
    _watch_units(model, sharded_root(model), seen)
    step_fn = torch.compile(model, backend="sharc") if mode == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"losses": [], "calls": [], "ahead": []}
    for step, what in enumerate(plan):
        x = _batch(step, rank)
        seen.clear()
        sharc.reset_memory_stats()
        if what == "fail":  # raises inside the second unit, after it gathered
            model.layers[1].fail = True
            with pytest.raises(RuntimeError, match="planned failure"):
                step_fn(x)
            model.layers[1].fail = False
        elif what == "scale":  # a write to every shard, outside any step
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.9)
        elif what == "eval":
            with torch.no_grad():
                out["losses"].append(step_fn(x).item())
        else:
            loss = step_fn(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
        out["calls"].append(sharc.memory_stats()["allgather_calls"])
        out["ahead"].append(sorted(set(seen), key=lambda s: str(s[0])))
    out["params"] = sharc.full_state_dict(model)
    return out


TRAIN = ["train"] * 4
# (unit, ahead) in forward; ("bwK", ahead) for unit K in backward, whose
# first unit is the last.
NOTHING_AHEAD = [(0, False), (1, False), (2, False), ("bw0", False), ("bw1", False)]
ALL_BUT_THE_FIRST_AHEAD = [(0, False), (1, True), (2, True), ("bw0", True), ("bw1", True)]
DETOURS = ["train", "train", "fail", "scale", "train", "eval", "train", "train"]


def _trained_alike(mode, plan):
    """Each rank's run with prefetch on and off, checked bitwise equal."""
    on = run_ranks(_train, 2, mode, True, plan)
    off = run_ranks(_train, 2, mode, False, plan)
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
    return on, off


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_units_after_the_first_are_gathered_ahead_and_training_is_unchanged(mode):
    on, off = _trained_alike(mode, TRAIN)
    for a, b in zip(on, off):
        # Started earlier, not more often (eager prefetch also buckets the
        # other modules, hence fewer with it on).
        assert len(set(a["calls"][1:])) == 1 and a["calls"][1] <= b["calls"][1]
        assert a["ahead"][0] == NOTHING_AHEAD
        assert b["ahead"][-1] == NOTHING_AHEAD
        for step in a["ahead"][1:]:
            assert step == ALL_BUT_THE_FIRST_AHEAD
    assert on[0]["losses"] != on[1]["losses"]  # the ranks did train on their own rows


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_failed_forward_a_shard_write_and_an_eval_forward_change_nothing(mode):
    on, _ = _trained_alike(mode, DETOURS)
    # Ahead again once a whole step ran after the detours.
    assert on[0]["ahead"][-1] == ALL_BUT_THE_FIRST_AHEAD
