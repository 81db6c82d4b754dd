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


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _mlp_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = (3, 5, 4)[step % 3]  # the ranks' sizes change by step
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def _in_modes(rank, world, modes):
    """Per mode: three SGD steps compiled in it (per-step losses, final full
    parameters, Inductor's max_autotune as each graph compiled under it)
    and the warnings sharc gave."""
    import warnings

    from torch._inductor import compile_fx
    from torch._inductor import config as inductor_config

    import sharc

    autotuned = []
    original = compile_fx.compile_fx_inner

    def recording(*args, **kwargs):
        autotuned.append(inductor_config.max_autotune)
        return original(*args, **kwargs)

    compile_fx.compile_fx_inner = recording
    out = {}
    for mode in modes:
        torch._dynamo.reset()
        autotuned.clear()
        model = _mlp()
        sharc.shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, backend="sharc", mode=mode)
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                x, y = _mlp_batch(step, rank)
                loss = torch.nn.functional.mse_loss(compiled(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item() * len(x))
        out[mode] = (losses, dict(sharc.full_state_dict(model)), list(autotuned),
                     [str(w.message) for w in caught if "mode=" in str(w.message)])
    return out


MODES = ("max-autotune-no-cudagraphs", "reduce-overhead", "lite")


def test_a_mode_reaches_inductor_with_what_sharc_cannot_take_left_off():
    """torch.compile(mode=...) reaches a backend other than Inductor as a
    keyword: sharc once dropped it silently. max-autotune-no-cudagraphs
    now compiles every graph (forward and backward) under its settings;
    reduce-overhead's CUDA graphs are left off on the CPU without a word,
    as Inductor leaves them off there; lite's settings, which skip sharc's
    joint-graph pass, are left off and warned of. Each trains as one
    process does."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for step in range(3):
        parts = [_mlp_batch(step, r) for r in range(2)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item() * len(x))
    results = run_ranks(_in_modes, 2, MODES, timeout=300)
    for mode in MODES:
        for step, total in enumerate(want):
            got = sum(r[mode][0][step] for r in results)
            assert abs(got - total) <= 1e-4 * abs(total), (mode, step, got, total)
        for losses, params, autotuned, warned in (r[mode] for r in results):
            assert autotuned and all(autotuned) == (mode == MODES[0]), (mode, autotuned)
            for name, value in model.state_dict().items():
                torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5)
            if mode == "lite":
                (message,) = warned
                assert message.startswith("sharc: torch.compile(mode='lite') with "
                                          "backend='sharc' leaves off "), message
                assert "use_joint_graph_passes" in message, message
            else:
                assert warned == [], (mode, warned)
