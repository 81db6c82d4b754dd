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
