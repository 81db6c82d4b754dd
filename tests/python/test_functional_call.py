"""torch.func.functional_call on a sharded model computes with the tensors
it is given, not the model's own (it swaps `module._parameters` for the
call, which sharc's full-parameter properties once ignored: silently the
model's own output). Eager and compiled, on 2 gloo ranks, against the same
call on an unsharded copy; a tensor of the wrong shape is refused."""

import pytest
import torch
import torch.nn as nn

from dist_harness import RankFailure, run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _swapped(model):
    """Other weights for every parameter, deterministic on every rank."""
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=g, requires_grad=True)
            for k, v in model.state_dict().items()}


def _call(rank, world, mode):
    import sharc

    plain, model = _model(), _model()
    sharc.shard(model)
    fn = model if mode == "eager" else torch.compile(model, backend="sharc")
    prefix = "" if mode == "eager" else "_orig_mod."
    x = torch.randn(5 + rank, 4,  # the ranks' sizes differ
                    generator=torch.Generator().manual_seed(rank))
    weights = _swapped(plain)
    want = torch.func.functional_call(plain, weights, (x,))
    want.square().sum().backward()
    want_grads = {k: v.grad.clone() for k, v in weights.items()}
    weights = _swapped(plain)
    got = torch.func.functional_call(fn, {prefix + k: v for k, v in weights.items()}, (x,),
                                     strict=True)
    got.square().sum().backward()
    own = fn(x[:3])  # own weights again, at another size (compiled: no stale graph)
    return {"got": got.detach(), "want": want.detach(),
            "grads": {k: v.grad for k, v in weights.items()}, "want_grads": want_grads,
            "own": own.detach(), "plain_own": plain(x[:3]).detach(),
            "shard_grads": [p.grad for p in model.parameters()]}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_functional_call_computes_with_the_tensors_it_is_given(mode):
    for out in run_ranks(_call, 2, mode):
        torch.testing.assert_close(out["got"], out["want"])
        for name, want in out["want_grads"].items():
            torch.testing.assert_close(out["grads"][name], want, msg=name)
        torch.testing.assert_close(out["own"], out["plain_own"])
        # The call read none of the shards: none got a gradient.
        assert all(g is None for g in out["shard_grads"]), out["shard_grads"]


def _wrong_shape(rank, world):
    import sharc

    model = _model()
    sharc.shard(model)
    torch.func.functional_call(model, {"0.weight": torch.zeros(6, 3)}, (torch.randn(2, 4),))


def test_a_tensor_of_another_shape_is_refused_naming_the_parameter():
    with pytest.raises(RankFailure, match=r"'0.weight' was replaced by a tensor of shape "
                                          r"\(6, 3\).*full shape \(6, 4\)"):
        run_ranks(_wrong_shape, 2)


def _dropped_and_cast(rank, world):
    """None for a parameter drops it, as torch does; under bf16 mixed
    precision the given fp32 tensors are cast as a read of the shard is."""
    import sharc

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    plain, model = _model(), _model()
    sharc.shard(model)
    dropped = torch.func.functional_call(model, {"2.bias": None}, (x,)).detach()
    want_dropped = torch.func.functional_call(plain, {"2.bias": None}, (x,)).detach()
    half = _model()
    bf16 = sharc.MixedPrecision(param_dtype=torch.bfloat16)
    sharc.shard(half, config=sharc.ShardConfig(mixed_precision=bf16))
    weights = _swapped(plain)
    cast = torch.func.functional_call(half, weights, (x,)).detach()
    want_cast = torch.func.functional_call(plain, weights, (x,)).detach()
    return dropped, want_dropped, cast, want_cast


def test_none_drops_a_parameter_and_mixed_precision_casts_what_it_is_given():
    for dropped, want_dropped, cast, want_cast in run_ranks(_dropped_and_cast, 2):
        torch.testing.assert_close(dropped, want_dropped)
        assert cast.dtype == torch.bfloat16
        torch.testing.assert_close(cast.float(), want_cast, rtol=3e-2, atol=3e-2)
