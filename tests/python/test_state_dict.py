"""Full (unsharded) state dicts under the original names round-trip."""

import pytest
import torch

from dist_harness import run_ranks
from models import make_parity_model


def _round_trip(rank, world):
    import sharc

    model = make_parity_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sharc.shard(model)
    full = sharc.full_state_dict(model)
    new_values = {k: v + 1.0 if v.is_floating_point() else v for k, v in full.items()}
    sharc.load_full_state_dict(model, new_values)
    reloaded = sharc.full_state_dict(model)
    return before, full, new_values, reloaded, sharc.memory_stats()["gathered_bytes"]


def test_full_state_dict_round_trip():
    for before, full, new_values, reloaded, gathered in run_ranks(_round_trip, 2):
        assert list(full) == list(before)  # same names, same order, tied included
        for k in before:
            torch.testing.assert_close(full[k], before[k], rtol=0, atol=0)
            torch.testing.assert_close(reloaded[k], new_values[k], rtol=0, atol=0)
        assert gathered == 0


def _writes_into_state_dict_values(rank, world):
    """timm's ModelEmaV2 updates an EMA model through its state_dict's
    values, in place: in one process they are the parameters."""
    import copy
    import io

    import sharc

    torch.manual_seed(0)
    model, ema = torch.nn.Linear(5, 4), torch.nn.Linear(5, 4)
    plain = torch.nn.Linear(5, 4)
    sharc.shard(model)
    sharc.shard(ema)
    before = sharc.full_state_dict(ema)
    try:
        with torch.no_grad():
            for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
                ema_v.copy_(ema_v * 0.5 + model_v * 0.5)  # out of place on it is fine
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    try:  # timm's ModelEmaV3: all values at once
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.state_dict().values()),
                                 list(model.state_dict().values()), 0.5)
        foreach_error = "no error"
    except RuntimeError as e:
        foreach_error = str(e)
    # The copies as the source of a foreach write into tensors of the
    # caller's own (an EMA kept unsharded) stay allowed.
    own = [torch.zeros_like(v) for v in model.state_dict().values()]
    torch._foreach_lerp_(own, list(model.state_dict().values()), 0.5)
    foreach_error += " | own: " + str([type(t).__name__ for t in own])
    unchanged = all(torch.equal(v, before[k]) for k, v in sharc.full_state_dict(ema).items())
    buffer = io.BytesIO()
    torch.save(ema.state_dict(), buffer)  # a file of plain tensors, loadable without sharc
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    plain.load_state_dict(loaded)
    snapshot = copy.deepcopy(ema.state_dict())  # a best-model snapshot: plain, writable
    for v in snapshot.values():
        v.mul_(0.5)
    return error, foreach_error, unchanged, {k: type(v) for k, v in {**loaded, **snapshot}.items()}


def test_an_in_place_write_to_a_state_dict_value_raises():
    """Before: the values were plain gathered copies, so the write changed
    only them, and the EMA model never moved, silently; a foreach write
    (`torch._foreach_lerp_`, timm's ModelEmaV3) passed the check after that."""
    for error, foreach_error, unchanged, types in run_ranks(_writes_into_state_dict_values, 2):
        assert error.startswith("sharc: 'weight' read outside forward is a copy of the "
                                "sharded parameter; copy_ on it would change the copy only"), error
        assert "sharc.unsharded(model, writeback=True)" in error
        assert foreach_error.endswith(" | own: ['Tensor', 'Tensor']"), foreach_error
        assert foreach_error.startswith(
            "sharc: 'weight' read outside forward is a copy of the sharded parameter; "
            "_foreach_lerp_ on it would change the copy only"), foreach_error
        assert unchanged
        assert set(types.values()) == {torch.Tensor}, types  # saved and deep-copied


def _module_state_dict(rank, world, compiled):
    """model.state_dict() / load_state_dict() of a sharded model speak the
    full tensors of the unsharded model, also for a submodule and for the
    module torch.compile returns; a rank's own flat shard still loads."""
    import sharc

    model = make_parity_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sharc.shard(model)
    handle = torch.compile(model, backend="sharc") if compiled else model
    out = {"before": before, "sd": dict(handle.state_dict()),
           "sub": dict(model.blocks[0].state_dict())}
    handle.load_state_dict({k: v * 2 if v.is_floating_point() else v
                            for k, v in handle.state_dict().items()})
    out["doubled"] = sharc.full_state_dict(model)
    shard_sd = {k: (v.detach().clone() + 1) if v.is_floating_point() else v
                for k, v in dict(model.named_parameters()).items()}
    model.load_state_dict(shard_sd, strict=False)  # flat shards of this rank
    out["shard_loaded"] = {k: torch.equal(p, shard_sd[k])
                           for k, p in model.named_parameters()}
    out["gathered"] = sharc.memory_stats()["gathered_bytes"]
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_module_state_dict_is_full_and_loads_full(compiled):
    for out in run_ranks(_module_state_dict, 2, compiled):
        prefix = "_orig_mod." if compiled else ""
        assert list(out["sd"]) == [prefix + k for k in out["before"]]
        for k, v in out["before"].items():
            assert torch.equal(out["sd"][prefix + k], v), k
            doubled = v * 2 if v.is_floating_point() else v
            assert torch.equal(out["doubled"][k], doubled), k
        for k, v in out["sub"].items():
            assert torch.equal(v, out["before"]["blocks.0." + k]), k
        assert all(out["shard_loaded"].values())
        assert out["gathered"] == 0


class _NormNet(torch.nn.Module):
    """Parameters and buffers (running statistics), built where asked."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 3, bias=False)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x)))).pow(2).mean()


def _load_state_dict_forms(rank, world, compiled):
    """What a test written for one process does to copy a reference's
    weights in: `load_state_dict(ref.state_dict())`, with assign=True too,
    into a model sharded from real values and into one sharded from the meta
    device (its buffers included); then a training step on both."""
    import sharc

    torch.manual_seed(1)
    ref = _NormNet()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    out = {}
    for meta in (False, True):
        for assign in (False, True):
            torch.manual_seed(0)
            with torch.device("meta" if meta else "cpu"):
                model = _NormNet()
            sharc.shard(model)
            shards = [id(p) for p in model.parameters()]
            handle = torch.compile(model, backend="sharc") if compiled else model
            prefix = "_orig_mod." if compiled else ""
            # clones: assign=True makes the buffers the given tensors
            result = handle.load_state_dict(
                {prefix + k: v.clone() for k, v in ref.state_dict().items()}, assign=assign)
            full = sharc.full_state_dict(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loss = handle(x)
            loss.backward()
            opt.step()
            out[meta, assign] = {
                "keys": (result.missing_keys, result.unexpected_keys),
                "loaded": {k: torch.equal(full[k], v) for k, v in ref.state_dict().items()},
                "same_shards": [id(p) for p in model.parameters()] == shards,
                "loss": loss.item(), "after": sharc.full_state_dict(model)}
    torch.manual_seed(0)
    model = _NormNet()
    sharc.shard(model)
    bad = dict(ref.state_dict(), **{"out.weight": torch.zeros(4, 8)})
    with pytest.raises(RuntimeError) as err:
        model.load_state_dict(bad)
    out["bad_shape"] = str(err.value)
    with torch.device("meta"):
        model = _NormNet()
    sharc.shard(model)
    partial = {k: v for k, v in ref.state_dict().items() if k != "out.weight"}
    with pytest.raises(RuntimeError) as err:  # torch's own report
        model.load_state_dict(partial)
    out["meta_missing"] = str(err.value)
    torch.manual_seed(0)
    model = _NormNet()
    sharc.shard(model)
    with sharc.unsharded(model, writeback=True):
        model.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
    full = sharc.full_state_dict(model)
    out["unsharded_assign"] = {k: torch.equal(full[k], v) for k, v in ref.state_dict().items()}
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_load_state_dict_of_a_reference_with_assign_and_into_a_meta_built_model(compiled):
    results = run_ranks(_load_state_dict_forms, 2, compiled)
    for rank, out in enumerate(results):
        for meta in (False, True):
            for assign in (False, True):
                got = out[meta, assign]
                assert got["keys"] == ([], []), (meta, assign)
                assert all(got["loaded"].values()), (meta, assign, got["loaded"])
                assert got["same_shards"], (meta, assign)  # the optimizer's shards stay
                # one step from the loaded values, each rank its own batch
                ref_loss = results[rank][False, False]["loss"]
                assert got["loss"] == pytest.approx(ref_loss, rel=1e-6), (meta, assign)
                for k, v in results[rank][False, False]["after"].items():  # buffers: per rank
                    torch.testing.assert_close(got["after"][k], v, rtol=1e-6, atol=1e-7)
        # the parameter's own shape, not its flat shard's
        assert ("size mismatch for out.weight: copying a param with shape torch.Size([4, 8]) "
                "from checkpoint, the shape in current model is torch.Size([3, 8])"
                in out["bad_shape"]), out["bad_shape"]
        assert 'Missing key(s) in state_dict: "out.weight"' in out["meta_missing"]
        assert all(out["unsharded_assign"].values()), out["unsharded_assign"]
