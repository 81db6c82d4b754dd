"""sharc.clip_grad_norm_ clips by the norm of the whole gradient, the same on
every rank: the norm, the clipped gradients (shard by shard) and the
parameters after an SGD step match torch.nn.utils.clip_grad_norm_ on the
unsharded model in one process. The parity model has shards with padding,
a tied, a 0-dim, a zero-size and a frozen parameter."""

import math

import pytest
import torch

from dist_harness import run_ranks
from models import global_batch, make_parity_model, rank_slice, shard_of

WORLD = 2
NORMS = [2.0, 1.0, math.inf]
MAX_NORM = 0.05  # well below every norm here: clipping scales the gradients
LR = 0.5


def _reference(norm_type):
    model = make_parity_model()
    x, y = global_batch(0, 4)
    model(x, y).backward()
    # torch cannot take the inf-norm of the zero-size parameter's gradient;
    # it adds nothing to any norm, so leave it out (sharc skips it).
    params = [p for p in model.parameters() if p.numel()]
    total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return float(total), grads, model.state_dict()


def _sharded(rank, world):
    import sharc

    out = {}
    for i, norm_type in enumerate(NORMS):
        model = make_parity_model()
        sharc.shard(model)
        x, y = global_batch(0, 4)
        model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        # The module and its parameters are both accepted.
        target = model if i % 2 == 0 else model.parameters()
        total = sharc.clip_grad_norm_(target, MAX_NORM, norm_type)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        torch.optim.SGD(model.parameters(), lr=LR).step()
        out[norm_type] = (float(total), total.dtype, grads, sharc.full_state_dict(model))
    # torch's own functions, as a single-process loop calls them, on a
    # generator of the parameters ([Note: torch's clipping on shards]): the
    # name torch exports; torch's function itself, as code that bound it
    # before sharc wrapped it holds it; the norm, then the clipping.
    torch_clip = torch.nn.utils.clip_grad_norm_
    for via, clip in {"torch": torch_clip,
                      "torch, bound early": torch_clip._sharc_wraps,
                      "get_total_norm": _norm_then_clip}.items():
        for norm_type in NORMS:
            model = make_parity_model()
            sharc.shard(model)
            x, y = global_batch(0, 4)
            model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
            total = clip(model.parameters(), MAX_NORM, norm_type)
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
            torch.optim.SGD(model.parameters(), lr=LR).step()
            out[via, norm_type] = (float(total), total.dtype, grads,
                                   sharc.full_state_dict(model))
    # A module sharc does not hold still gets torch's function as it is.
    plain = make_parity_model()
    plain(*global_batch(0, 4)).backward()
    params = [p for p in plain.parameters() if p.numel()]
    out["plain"] = float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
    return out


def _norm_then_clip(parameters, max_norm, norm_type):
    params = list(parameters)
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None],
                                          norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


@pytest.fixture(scope="module")
def sharded():
    return run_ranks(_sharded, WORLD, timeout=180)


@pytest.mark.parametrize("via", ["sharc", "torch", "torch, bound early", "get_total_norm"])
@pytest.mark.parametrize("norm_type", NORMS)
def test_matches_unsharded_clipping(sharded, norm_type, via):
    ref_total, ref_grads, ref_state = _reference(norm_type)
    assert ref_total > 4 * MAX_NORM, "the reference must really clip"
    for rank, results in enumerate(sharded):
        total, dtype, grads, state = results[norm_type if via == "sharc" else (via, norm_type)]
        assert dtype == torch.float32
        assert total == pytest.approx(ref_total, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for name, want in ref_grads.items():
            # shard_of pads with zeros: the padding's gradients must be zeros too.
            torch.testing.assert_close(grads[name], shard_of(want, rank, WORLD),
                                       rtol=1e-5, atol=1e-8, msg=name)
        for name, want in ref_state.items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-7, msg=name)


def test_a_shard_based_norm_would_differ(sharded):
    # Guards the test itself: per-rank shard norms differ from the global one.
    import torch.nn.utils as nn_utils

    ref_total, ref_grads, _ = _reference(2.0)
    for rank in range(WORLD):
        shards = [shard_of(g, rank, WORLD) for g in ref_grads.values()]
        local = float(nn_utils.get_total_norm(shards, 2.0))
        assert abs(local - ref_total) > 1e-3 * ref_total


def test_torch_clipping_of_an_unsharded_module_is_torchs(sharded):
    ref_total, _, _ = _reference(2.0)
    for results in sharded:
        assert results["plain"] == pytest.approx(ref_total, rel=1e-6)


def _clip_models_of_two_groups(rank, world):
    import torch.distributed as dist

    import sharc

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    sharc.shard(a)  # over the world
    sharc.shard(b, pairs[rank // 2])  # over this rank's pair
    b(a(torch.ones(2, 4) * (rank + 1))).pow(2).sum().backward()
    errors = []
    for clip in (torch.nn.utils.clip_grad_norm_, sharc.clip_grad_norm_):
        try:
            clip([*a.parameters(), *b.parameters()], 1.0)
        except ValueError as e:
            errors.append(str(e))
    # The way out the error names; the ranks are still in step.
    norms = [float(sharc.clip_grad_norm_(m, math.inf)) for m in (a, b)]
    return errors, norms


def test_parameters_of_models_sharded_over_two_groups_are_refused_naming_why():
    # Before: "... are not shards of group '0' ... clip parameters that were
    # not sharded separately, with torch.nn.utils.clip_grad_norm_", which is
    # what the caller had called, on parameters that are shards.
    for rank, (errors, norms) in enumerate(run_ranks(_clip_models_of_two_groups, 4)):
        assert len(errors) == 2
        for error in errors:
            assert "2 of the 4 parameters given are shards of another process group" in error
            assert "Clip each sharded model over its own group" in error
        assert all(n > 0 for n in norms)
