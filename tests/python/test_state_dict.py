"""Full (unsharded) state dicts under the original names round-trip."""

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
