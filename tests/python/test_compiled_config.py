"""The backend's options: bucket sizes change how many collectives run but not
the numbers; a pass may be switched off only if the schedule stays valid;
bad options fail with a message that says what to fix; the backend is found
through torch's entry point."""

import importlib.metadata

import pytest
import torch

from dist_harness import RankFailure, run_ranks
from models import global_batch, make_parity_model, rank_slice
from scenario import in_own_groups


def _step(rank, world, options, group=None):
    import sharc

    model = make_parity_model()
    sharc.shard(model, group)
    compiled = torch.compile(model, backend="sharc", options=options)
    x, y = global_batch(0, 2 * world)
    loss = compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, sharc.memory_stats(group)


def test_bucket_sizes_change_collective_counts_not_results():
    # The three in one launch, each a fresh model on its own process group
    # (its collective counts its own), compiled anew.
    runs = run_ranks(in_own_groups, 2, _step,
                     [({"gather_bucket_bytes": 1 << 20, "reduce_bucket_bytes": 1 << 20},),
                      ({"gather_bucket_bytes": 0, "reduce_bucket_bytes": 0},),
                      ({"disable_passes": ("bucket_allgathers",)},)])
    for (loss_f, grads_f, stats_f), (loss_s, grads_s, stats_s), (_, _, stats_u) in runs:
        assert stats_f["reduce_scatter_calls"] == 1  # the whole model fits one bucket
        assert stats_s["reduce_scatter_calls"] == len(grads_s)
        assert stats_f["allgather_calls"] < stats_s["allgather_calls"]
        assert stats_u["allgather_calls"] == stats_s["allgather_calls"]
        assert stats_f["allgather_bytes"] == stats_s["allgather_bytes"]
        assert abs(loss_f - loss_s) <= 1e-6 * abs(loss_s)
        for name, grad in grads_s.items():
            torch.testing.assert_close(grads_f[name], grad, rtol=1e-5, atol=1e-7)


def test_switching_off_a_required_pass_is_refused():
    with pytest.raises(RankFailure, match="insert_gather_release"):
        run_ranks(_step, 2, {"disable_passes": ("insert_gather_release",)})


@pytest.mark.parametrize("options, message", [
    ({"bucket": 1}, "unknown sharc compile option 'bucket'"),
    ({"disable_passes": ("fuse_everything",)}, "unknown pass 'fuse_everything'"),
    ({"gather_bucket_bytes": -1}, "gather_bucket_bytes must be an int >= 0"),
    ({"inductor": "yes"}, "inductor must be a bool"),
])
def test_bad_options_are_named(options, message):
    from sharc.config import CompileConfig

    with pytest.raises((ValueError, TypeError), match=message):
        CompileConfig.from_options(options)


def test_backend_is_registered_through_the_entry_point():
    points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(p.name == "sharc" and p.value == "sharc._compile:sharc_backend" for p in points)
    from torch._dynamo import list_backends

    import sharc  # noqa: F401
    assert "sharc" in list_backends(exclude_tags=())
