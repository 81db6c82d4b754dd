"""The remaining corners of ordinary training code, each on 2 gloo ranks in
eager and compiled mode against one unsharded process: several backward
passes over one forward, gradients with respect to inputs only, gradient
accumulation (with and without reducing every micro-batch), layers frozen
and unfrozen between steps, forwards without backward (no_grad, eval,
dropped; a TransformerEncoder's padded eval path), part of the model
compiled, and debug mode naming a parameter read after its release."""

import functools

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks
from models import gathered_beyond_kept, shard_of
from scenario import in_own_groups

MODES = ["eager", "compiled"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 5)
        self.c = nn.Linear(5, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def make_net():
    torch.manual_seed(0)
    return Net()


def batch(step, rank, world):
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(4, 6, generator=g),)


def _sharded(mode, group=None):
    import sharc

    model = make_net()
    sharc.shard(model, group)
    return model, (model if mode == "eager" else torch.compile(model, backend="sharc"))


def _cases_in_one_launch(fn, mode, cases):
    """{case: per-rank results} of fn(rank, world, mode, case, group) for
    every case, one after the other in one launch (compiled mode pays the
    first compile's warm-up once), each a fresh model sharded over its own
    process group, so its counters, warnings and leftovers are its own."""
    runs = run_ranks(in_own_groups, 2, fn, [(mode, case) for case in cases])
    return {case: [r[i] for r in runs] for i, case in enumerate(cases)}


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _check_grads(got_per_rank, want):
    for rank, got in enumerate(got_per_rank):
        for name, ref in want.items():
            torch.testing.assert_close(got[name], shard_of(ref, rank, 2), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# -- several backward passes over one forward -----------------------------------
def _losses(out):
    return out.pow(2).mean(), out.abs().mean(), out.mean() * 0.5


def _retain(rank, world, mode, zero_between, group=None):
    model, step = _sharded(mode, group)
    results = []
    for it in range(2):  # the second iteration runs on compiled graphs, not the trace
        model.zero_grad()
        out = step(*batch(it, rank, world))
        losses = _losses(out)
        for i, loss in enumerate(losses):
            loss.backward(retain_graph=i < len(losses) - 1)
            if zero_between and i < len(losses) - 1:
                model.zero_grad()
        results.append((_grads(model), gathered_beyond_kept(group)))
    return results


@functools.cache
def _retain_runs(mode):
    return _cases_in_one_launch(_retain, mode, (False, True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("zero_between", [False, True])
def test_three_backward_passes_over_one_forward(mode, zero_between):
    results = _retain_runs(mode)[zero_between]
    for it in range(2):
        ref = make_net()
        x = torch.cat([batch(it, r, 2)[0] for r in range(2)])
        losses = _losses(ref(x))
        for i, loss in enumerate(losses):
            loss.backward(retain_graph=True)
            if zero_between and i < len(losses) - 1:
                ref.zero_grad()
        _check_grads([r[it][0] for r in results], {n: p.grad for n, p in ref.named_parameters()})
        assert all(r[it][1] == 0 for r in results)


# -- gradients with respect to inputs only ---------------------------------------
def _input_grad(rank, world, mode):
    import sharc

    model, step = _sharded(mode)
    outs = []
    for it in range(2):
        x = batch(it, rank, world)[0].requires_grad_()
        (gx,) = torch.autograd.grad(step(x).pow(2).sum(), x)
        outs.append((gx, [p.grad for p in model.parameters()], gathered_beyond_kept()))
    return outs


@pytest.mark.parametrize("mode", MODES)
def test_autograd_grad_with_respect_to_inputs(mode):
    results = run_ranks(_input_grad, 2, mode)
    ref = make_net()
    for rank, outs in enumerate(results):
        for it, (gx, param_grads, gathered) in enumerate(outs):
            x = batch(it, rank, 2)[0].requires_grad_()
            (want,) = torch.autograd.grad(ref(x).pow(2).sum(), x)
            torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-6)
            assert all(g is None for g in param_grads) and gathered == 0


def _gradient_penalty(rank, world):
    """A penalty on the input gradient (autograd.grad with create_graph=True,
    then backward through it): the error, and a plain step afterwards."""
    import sharc

    model, step = _sharded("eager", None)
    x = batch(0, rank, world)[0].requires_grad_()
    out = step(x).pow(2).sum()
    try:  # refused at the first backward, the one that would build the graph
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        (out + gx.pow(2).sum()).backward()
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    model.zero_grad()
    step(*batch(1, rank, world)).pow(2).sum().backward()
    return error, [p.grad is not None for p in model.parameters()]


def test_a_double_backward_through_sharded_parameters_is_refused_clearly():
    """Before: torch's "setStorage ... out of bounds for storage of size 0"
    from the engine (a parameter gathered for the first backward, freed, then
    read by the second)."""
    for error, have_grads in run_ranks(_gradient_penalty, 2):
        assert "a backward with create_graph=True" in error, error
        assert "is not supported" in error
        assert all(have_grads)  # the next ordinary step still trains


# -- gradient accumulation --------------------------------------------------------
MICRO = 3


def _accumulate(rank, world, mode, sync_each, group=None):
    import sharc

    model, step = _sharded(mode, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = []
    for it in range(2):
        sharc.reset_memory_stats(group)
        for m in range(MICRO):
            last = m == MICRO - 1
            with sharc.no_sync(model, enabled=not (sync_each or last)):
                (step(*batch(it * MICRO + m, rank, world)).pow(2).mean() / MICRO).backward()
        grads = _grads(model)
        opt.step()
        opt.zero_grad()
        stats.append(sharc.memory_stats(group))
    return grads, sharc.full_state_dict(model), stats


@functools.cache
def _accumulate_runs(mode):
    return _cases_in_one_launch(_accumulate, mode, (True, False))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sync_each", [True, False])
def test_accumulation_equals_one_step_on_the_concatenated_batch(mode, sync_each):
    results = _accumulate_runs(mode)[sync_each]
    ref = make_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for it in range(2):
        x = torch.cat([batch(it * MICRO + m, r, 2)[0] for m in range(MICRO) for r in range(2)])
        ref(x).pow(2).mean().backward()
        if it == 1:
            want = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
    _check_grads([r[0] for r in results], want)
    for _, params, stats in results:
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-6)
        assert stats[-1]["gathered_bytes"] == stats[-1]["kept_gathered_bytes"]
        assert stats[-1]["unreduced_grad_bytes"] == 0
        assert stats[-1]["reduce_scatter_calls"] > 0


# -- freezing and unfreezing between steps ------------------------------------------
# Fine-tuning freezes layers for some steps and unfreezes them later: step
# -> the prefixes of the parameters frozen in it (all trainable otherwise).
FROZEN = {2: ("b.",), 3: ("a.", "b.")}
FREEZE_STEPS = 6


def _set_frozen(model, step):
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN.get(step, ())))


def _freezing(rank, world, mode, group=None):
    import sharc

    model, step_fn = _sharded(mode, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads, left = [], [], []
    for step in range(FREEZE_STEPS):
        _set_frozen(model, step)
        loss = step_fn(*batch(step, rank, world)).pow(2).mean()
        loss.backward()
        grads.append(_grads(model))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        left.append(gathered_beyond_kept(group))
    return losses, grads, sharc.full_state_dict(model), left


@pytest.mark.parametrize("mode", MODES)
def test_freezing_and_unfreezing_layers_between_steps_matches_single_process(mode):
    """requires_grad toggled between steps (the compiled graph recompiles on
    the change): frozen shards get no gradient and stay put, with their
    momentum kept for when they train again; every step matches one process."""
    results = run_ranks(_freezing, 2, mode)
    ref = make_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want_losses, want_grads = [], []
    for step in range(FREEZE_STEPS):
        _set_frozen(ref, step)
        x = torch.cat([batch(step, r, 2)[0] for r in range(2)])
        loss = ref(x).pow(2).mean()
        loss.backward()
        want_grads.append(_grads(ref))
        opt.step()
        opt.zero_grad()
        want_losses.append(loss.item())
    for step, want in enumerate(want_losses):
        got = sum(r[0][step] for r in results) / 2
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (step, got, want)
    for step, want in enumerate(want_grads):
        frozen = [name for name, grad in want.items() if grad is None]
        assert all(r[1][step][name] is None for r in results for name in frozen), (step, frozen)
        _check_grads([r[1][step] for r in results],
                     {name: grad for name, grad in want.items() if grad is not None})
    for _, _, params, left in results:
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-6)
        assert left == [0] * FREEZE_STEPS, left


def test_no_sync_sends_a_third_of_the_reduce_scatter_bytes():
    each = run_ranks(_accumulate, 2, "eager", True)[0][2][-1]["reduce_scatter_bytes"]
    last = run_ranks(_accumulate, 2, "eager", False)[0][2][-1]["reduce_scatter_bytes"]
    assert last * MICRO == each


class Branchy(Net):
    """Net with a side branch that some micro-batches take and others skip
    (every rank alike): what the branch's parameters held back under no_sync
    must reach the step even when the last micro-batch skips it."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(8, 8)

    def forward(self, x, side: bool):
        h = torch.relu(self.a(x))
        if side:
            h = h + self.side(h)
        return self.c(torch.tanh(self.b(h)))


def make_branchy():
    torch.manual_seed(0)
    return Branchy()


def _sides(it):
    """Which micro-batches take the side branch: the first only, then the
    last only, so that it is held back, then reduced as usual."""
    return [m == 0 if it == 0 else m == MICRO - 1 for m in range(MICRO)]


def _accumulate_branch(rank, world, mode):
    import sharc

    model = make_branchy()
    sharc.shard(model)
    step = model if mode == "eager" else torch.compile(model, backend="sharc")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, held = [], []
    for it in range(2):
        for m, side in enumerate(_sides(it)):
            with sharc.no_sync(model, enabled=m < MICRO - 1):
                (step(*batch(it * MICRO + m, rank, world), side).pow(2).mean() / MICRO).backward()
        grads.append(_grads(model))
        held.append(sharc.memory_stats()["unreduced_grad_bytes"])
        opt.step()
        opt.zero_grad()
    return grads, held, sharc.full_state_dict(model)


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_keeps_what_a_branch_held_when_the_last_micro_batch_skips_it(mode):
    results = run_ranks(_accumulate_branch, 2, mode)
    ref = make_branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for it in range(2):
        for m, side in enumerate(_sides(it)):
            x = torch.cat([batch(it * MICRO + m, r, 2)[0] for r in range(2)])
            (ref(x, side).pow(2).mean() / MICRO).backward()
        _check_grads([r[0][it] for r in results], {n: p.grad for n, p in ref.named_parameters()})
        opt.step()
        opt.zero_grad()
    for _, held, params in results:
        assert held == [0, 0]
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-6)


def _discard_held(rank, world, mode, how, group=None):
    """A micro-batch accumulated under no_sync, then discarded by
    zero_grad() (as a loop that skips a micro-batch with a non-finite loss
    does), then a synced backward: the step sees the last batch alone."""
    import sharc

    model, step = _sharded(mode, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sharc.no_sync(model):
        (step(*batch(0, rank, world)).pow(2).mean() * 100).backward()
    held = sharc.memory_stats(group)["unreduced_grad_bytes"]
    if how == "module":
        model.zero_grad()
    elif how == "param_none":  # by hand, as a loop that skips a micro-batch may
        for p in model.parameters():
            p.grad = None
    elif how == "param_replaced":  # a gradient of the user's own choosing
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    else:
        opt.zero_grad(set_to_none=how == "optimizer")
    after = sharc.memory_stats(group)["unreduced_grad_bytes"]
    step(*batch(1, rank, world)).pow(2).mean().backward()
    return _grads(model), held, after, sharc.memory_stats(group)["unreduced_grad_bytes"]


@pytest.mark.parametrize("mode", MODES)
def test_zero_grad_discards_what_no_sync_held(mode):
    """Before: the held sums lived on in the runtime past zero_grad() and
    were added into the next reduction (here 100 times the kept batch's
    gradient), whichever zero_grad ran; past `p.grad = None` or a .grad
    replaced by hand too, until the fix of both."""
    runs = _cases_in_one_launch(_discard_held, mode, ("optimizer", "optimizer_zeros", "module",
                                                      "param_none", "param_replaced"))
    ref = make_net()
    ref(torch.cat([batch(1, r, 2)[0] for r in range(2)])).pow(2).mean().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for how, results in runs.items():
        _check_grads([grads for grads, _, _, _ in results], want)
        for _, held, after, at_end in results:
            # zero_grad() drops the sums at once; a .grad set by hand is
            # only seen at the next reduction, which drops them then.
            assert held > 0 and at_end == 0, (how, held, at_end)
            assert after == (held if how.startswith("param_") else 0), (how, held, after)


def _step_over_held(rank, world, mode, group=None):
    import sharc

    model, step = _sharded(mode, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sharc.no_sync(model):
        step(*batch(0, rank, world)).pow(2).mean().backward()
    before = {k: v.clone() for k, v in sharc.full_state_dict(model).items()}
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = str(e)
    unchanged = all(torch.equal(v, before[k]) for k, v in sharc.full_state_dict(model).items())
    step(*batch(1, rank, world)).pow(2).mean().backward()  # what was held is still there
    return error, unchanged, _grads(model)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_while_no_sync_holds_gradients_is_refused(mode):
    """Before: the step ran on zeros (the shards' .grad while held), changed
    nothing but the optimizer's state, and the held sums went into the next
    step, silently."""
    results = run_ranks(_step_over_held, 2, mode)
    ref = make_net()
    for b in range(2):
        ref(torch.cat([batch(b, r, 2)[0] for r in range(2)])).pow(2).mean().backward()
    _check_grads([grads for _, _, grads in results], {n: p.grad for n, p in ref.named_parameters()})
    for error, unchanged, _ in results:
        assert error is not None and error.startswith("sharc: SGD.step() while sharc.no_sync() "
                                                      "holds back the gradient of '"), error
        assert "Run the last micro-batch's backward outside no_sync()" in error
        assert unchanged


def _no_sync_beside_another_model(rank, world, inside):
    import sharc

    model, _ = _sharded("eager")
    torch.manual_seed(1)
    other = nn.Linear(6, 2)
    sharc.shard(other)  # over the same group
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x = batch(0, rank, world)[0]
    with sharc.no_sync(model):
        (model(x).pow(2).mean() / 2).backward()
        if inside:  # held back too, until a backward outside no_sync
            other(x).pow(2).mean().backward()
    if not inside:
        other(x).pow(2).mean().backward()
    try:
        other_opt.step()  # its own step, between the model's micro-batches
    except RuntimeError as e:
        return str(e)
    (model(x * 0.5).pow(2).mean() / 2).backward()
    opt.step()
    return sharc.full_state_dict(model), sharc.full_state_dict(other)


def test_no_sync_holds_back_another_model_of_its_group_and_the_refusal_says_so():
    # Before, the refusal named only the other model's parameters and "run
    # the last micro-batch's backward outside no_sync()", which the caller
    # had done for the model given to it.
    for error in run_ranks(_no_sync_beside_another_model, 2, True):
        assert "holds back the gradient of 'weight' (and 1 more)" in error
        assert "holds back the gradients of every model sharded over that group" in error
    # The way out: the other model's backward outside no_sync, as one process.
    model = make_net()
    torch.manual_seed(1)
    other = nn.Linear(6, 2)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    x = torch.cat([batch(0, r, 2)[0] for r in range(2)])
    (model(x).pow(2).mean() / 2 + model(x * 0.5).pow(2).mean() / 2 +
     other(x).pow(2).mean()).backward()
    opt.step()
    for got_model, got_other in run_ranks(_no_sync_beside_another_model, 2, False):
        for name, want in model.state_dict().items():
            torch.testing.assert_close(got_model[name], want)
        for name, want in other.state_dict().items():
            torch.testing.assert_close(got_other[name], want)


# -- what code set on a parameter ----------------------------------------------------
def _tagged_net():
    """Biases marked as Mamba marks its A_log and D (`_no_weight_decay`),
    the mark an optimizer's groups are built from."""
    net = make_net()
    for name, p in net.named_parameters():
        if name.endswith("bias"):
            p._no_weight_decay = True
    return net


def _decay_groups(model):
    params = list(model.parameters())
    return torch.optim.AdamW([
        {"params": [p for p in params if not getattr(p, "_no_weight_decay", False)]},
        {"params": [p for p in params if getattr(p, "_no_weight_decay", False)],
         "weight_decay": 0.0}], lr=0.05, weight_decay=0.5)


def _train_tagged(rank, world):
    import sharc

    model = _tagged_net()
    sharc.shard(model)
    opt = _decay_groups(model)
    for it in range(2):
        model(*batch(it, rank, world)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [len(g["params"]) for g in opt.param_groups], sharc.full_state_dict(model)


def test_attributes_set_on_a_parameter_go_on_to_its_shard():
    """Before: the shards had none of them, so every bias landed in the
    decayed group and trained to other values, silently."""
    ref = _tagged_net()
    opt = _decay_groups(ref)
    for it in range(2):
        ref(torch.cat([batch(it, r, 2)[0] for r in range(2)])).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for sizes, params in run_ranks(_train_tagged, 2):
        assert sizes == [3, 3]
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-6)


# -- forwards without backward ------------------------------------------------------
def _no_backward(rank, world, mode):
    import sharc

    model, step = _sharded(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for it in range(3):
        with torch.no_grad():
            step(*batch(it, rank, world))
        model.eval()
        step(*batch(it, rank, world))
        model.train()
        step(*batch(it, rank, world))  # a training forward dropped without backward
        seen.append((gathered_beyond_kept(),
                     sharc.memory_stats()["reduce_scatter_calls"],
                     [p.grad for p in model.parameters()]))
        step(*batch(it, rank, world)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sharc.reset_memory_stats()
    return seen, sharc.full_state_dict(model)


@pytest.mark.parametrize("mode", MODES)
def test_forwards_without_backward_leave_nothing_behind(mode):
    results = run_ranks(_no_backward, 2, mode)
    ref = make_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for it in range(3):
        ref(torch.cat([batch(it, r, 2)[0] for r in range(2)])).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for seen, params in results:
        for gathered, reductions, grads in seen:
            assert gathered == 0 and reductions == 0 and all(g is None for g in grads)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-6)


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


def _padded(step, rank):
    """Each rank's own sequences, with padding at the end of two of them."""
    g = torch.Generator().manual_seed(10 * step + rank)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True
    mask[2, 1 + rank:] = True
    return torch.randn(3, 5, 16, generator=g), mask


def _dense(out):
    return out.to_padded_tensor(0.0) if out.is_nested else out


def _encoder_evaluated(rank, world, mode):
    """A training step, then the encoder evaluated under no_grad and
    inference_mode with a padding mask: its eval path for padded batches,
    where in eager torch turns the batch into nested tensors. (Its fused
    layer kernel is skipped for a layer with forward hooks, as sharc's
    sharded layers have: measured, the layers then take their ordinary
    path.)"""
    import sharc

    model = _encoder()
    sharc.shard(model)
    step = model if mode == "eager" else torch.compile(model, backend="sharc")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, mask = _padded(0, rank)
    step(x, src_key_padding_mask=mask).masked_fill(mask[..., None], 0).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    x, mask = _padded(1, rank)
    outs = []
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            outs.append(_dense(step(x, src_key_padding_mask=mask)).clone())
    return outs, gathered_beyond_kept()


@pytest.mark.parametrize("mode", MODES)
def test_a_transformer_encoder_evaluates_padded_batches_like_one_process(mode):
    results = run_ranks(_encoder_evaluated, 2, mode)
    ref = _encoder()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    parts = [_padded(0, r) for r in range(2)]
    x, mask = (torch.cat(t) for t in zip(*parts))
    loss = ref(x, src_key_padding_mask=mask).masked_fill(mask[..., None], 0).pow(2)
    # The mean over both ranks' rows, as the ranks' averaged gradients give.
    loss.mean().backward()
    opt.step()
    ref.eval()
    for rank, (outs, left) in enumerate(results):
        x, mask = _padded(1, rank)
        with torch.no_grad():
            want = _dense(ref(x, src_key_padding_mask=mask))
        for out in outs:
            torch.testing.assert_close(out[~mask], want[~mask], rtol=1e-4, atol=1e-5)
        assert left == 0, left


# -- part of the model compiled -----------------------------------------------------
def _partial(rank, world):
    import sharc

    model = make_net()
    sharc.shard(model)
    model.b = torch.compile(model.b, backend="sharc")
    model.c.forward = torch.compile(model.c.forward, backend="sharc")
    return scenario_like(model, rank, world)


def scenario_like(model, rank, world):
    import sharc

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for it in range(3):
        loss = model(*batch(it, rank, world)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), gathered_beyond_kept()))
    return losses, sharc.full_state_dict(model)


def test_part_of_the_model_compiled():
    results = run_ranks(_partial, 2)
    ref = make_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for it in range(3):
        loss = ref(torch.cat([batch(it, r, 2)[0] for r in range(2)])).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        got = sum(r[0][it][0] for r in results) / 2
        assert got == pytest.approx(loss.item(), rel=1e-5)
    for losses, params in results:
        assert all(g == 0 for _, g in losses)
        for name, value in ref.state_dict().items():
            key = name.replace("b.", "b._orig_mod.") if name.startswith("b.") else name
            torch.testing.assert_close(params.get(key, params.get(name)), value,
                                       rtol=1e-4, atol=1e-6)


# -- a gathered weight kept past its forward stays valid ----------------------------
def _kept_weight(rank, world):
    import warnings

    import sharc

    model, _ = _sharded("eager")
    kept = {}

    def keep(mod, inputs, output):
        kept["w"] = mod.weight  # a user hook holding on to a gathered weight
        kept["view"] = mod.weight.t()[0]  # a view of it
        kept["array"] = mod.weight.detach().numpy()  # an array over its memory

    model.b.register_forward_hook(keep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(*batch(0, rank, world)).sum().backward()
    full = sharc.full_state_dict(model)["b.weight"]
    gathered_after = sharc.memory_stats()["gathered_bytes"]
    return (torch.equal(kept["w"].detach(), full), torch.equal(kept["view"].detach(), full.t()[0]),
            bool((kept["array"] == full.numpy()).all()), gathered_after,
            [str(w.message) for w in caught if "sharc" in str(w.message)])


def test_kept_weight_stays_valid_and_is_reported():
    for same, same_view, same_array, gathered, messages in run_ranks(_kept_weight, 2):
        assert same and same_view and same_array
        assert gathered == 0  # handed over to the user's references, not the runtime's
        assert len(messages) == 1 and "'b.weight' was still referenced" in messages[0]


# -- a reference kept past release: an error on read (eager), a copy (compiled) ---
def _escaped_reference(rank, world, mode, how, group=None):
    import warnings

    import sharc

    model = make_net()
    kept = {}

    def keep(mod, inputs, output):
        kept["w"] = mod.weight.detach()  # a new tensor over the gathered bytes

    if how == "hook before shard":
        model.b.register_forward_hook(keep)
    sharc.shard(model, group)
    if how in ("hook after shard", "hook, no_grad"):
        model.b.register_forward_hook(keep)
    if how == "attribute":
        inner = model.forward

        def forward(x):
            kept["w"] = model.b.weight.detach()
            return inner(x)
        model.forward = forward
    step = model if mode == "eager" else torch.compile(model, backend="sharc")
    errors, same = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for it in range(2):
            if how == "hook, no_grad":  # an inference graph
                with torch.no_grad():
                    step(*batch(it, rank, world))
            else:
                step(*batch(it, rank, world)).pow(2).mean().backward()
            full = sharc.full_state_dict(model)["b.weight"]
            for touch in (lambda w: same.append(torch.equal(w, full)), lambda w: repr(w),
                          lambda w: w.add_(1)):
                try:
                    touch(kept["w"])
                    errors.append(None)
                except RuntimeError as e:
                    errors.append(str(e))
    loss = step(*batch(2, rank, world)).pow(2).mean()  # training goes on unharmed
    loss.backward()
    warned = [str(w.message) for w in caught if "a compiled graph returns" in str(w.message)]
    return errors, same, warned, loss.item(), sharc.memory_stats(group)


ESCAPES = ("hook before shard", "hook after shard", "attribute", "hook, no_grad")


@functools.cache
def _escaped_runs(mode):
    return _cases_in_one_launch(_escaped_reference, mode, ESCAPES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ESCAPES)
def test_a_weight_kept_past_release_raises_on_read_or_is_a_copy(mode, how):
    """Eager: a `.detach()` escapes sharc's tracking of handed-out tensors,
    so its storage is freed at release and every read or write raises,
    naming the parameter. Compiled: the graph returns a copy (with a
    warning), valid while held. Never freed memory read as if valid."""
    results = _escaped_runs(mode)[how]
    for errors, same, warned, loss, stats in results:
        assert len(errors) == 6, errors
        if mode == "eager":
            for e in errors:
                assert e is not None, errors
                assert "sharc: 'b.weight' was read after sharc released its gathered value" in e
                assert "detach().clone()" in e
        else:
            assert errors == [None] * 6 and same == [True, True]
            assert warned and "'b.weight'" in warned[0] and "full-size copy" in warned[0]
        assert stats["gathered_bytes"] == stats["kept_gathered_bytes"]
    assert results[0][3] == pytest.approx(results[1][3], rel=10)  # both finite, ran on


# -- an optimizer created before shard() ---------------------------------------------
def _optimizer_first(rank, world):
    import sharc

    model = make_net()
    early = torch.optim.AdamW(model.parameters())
    sharc.shard(model)
    model(*batch(0, rank, world)).sum().backward()
    try:
        early.step()
    except RuntimeError as e:
        message = str(e)
    late = torch.optim.AdamW(model.parameters())
    late.step()  # the right order still works
    return message


def test_an_optimizer_created_before_shard_is_refused_at_its_first_step():
    for message in run_ranks(_optimizer_first, 2):
        assert "created before sharc.shard()" in message and "'a.weight'" in message


# -- optimizers that compute over whole parameters --------------------------------------
_WHOLE_PARAMETER_OPTIMIZERS = {
    "LBFGS": lambda params: torch.optim.LBFGS(params, max_iter=2),
    "Adafactor": lambda params: torch.optim.Adafactor(params),
}


class Lamb(torch.optim.Optimizer):
    """LAMB as other libraries write it (timm's, apex's): each update scaled
    by the whole parameter's norm over the update's. Refused by its name."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = p.grad / (p.grad.abs() + 1e-8)
                    p.add_(update, alpha=-group["lr"] * float(p.norm() / update.norm()))
        return loss


def _loss_closure(model, rank, world):
    def closure():
        model.zero_grad()
        loss = model(*batch(0, rank, world)).pow(2).mean()
        loss.backward()
        return loss

    return closure


def _steps(model, make, rank, world):
    """Two steps of a new optimizer over `model`: each one's error, or None."""
    opt = make(model.parameters())
    errors = []
    for _ in range(2):  # the second step is checked again, not waved through
        try:
            opt.step(_loss_closure(model, rank, world))
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return errors


def _moved(model, before):
    return any(not torch.equal(p, before[n]) for n, p in model.state_dict().items())


def _whole_parameter_optimizers(rank, world):
    import sharc

    model = make_net()
    sharc.shard(model)
    plain = make_net()  # unsharded, in the same process: its optimizers step as ever
    sharded_errors, plain_errors, plain_moved = {}, {}, {}
    for name, make in _WHOLE_PARAMETER_OPTIMIZERS.items():
        sharded_errors[name] = _steps(model, make, rank, world)
        before = {n: p.clone() for n, p in plain.state_dict().items()}
        plain_errors[name] = _steps(plain, make, rank, world)
        plain_moved[name] = _moved(plain, before)
    sharded_errors["SparseAdam"] = _steps(model, torch.optim.SparseAdam, rank, world)
    if hasattr(torch.optim, "Muon"):  # refuses a 1-D parameter when it is built
        try:
            torch.optim.Muon(model.parameters())
        except ValueError as e:
            sharded_errors["Muon"] = [str(e)]
        weights = [p for n, p in plain.named_parameters() if n.endswith("weight")]
        before = {n: p.clone() for n, p in plain.state_dict().items()}
        plain_errors["Muon"] = _steps(plain, lambda _: torch.optim.Muon(weights), rank, world)
        plain_moved["Muon"] = _moved(plain, before)
    from transformers.optimization import Adafactor as HFAdafactor  # not torch's class

    sharded_errors["transformers Adafactor"] = _steps(
        model, lambda params: HFAdafactor(params, lr=1e-3, relative_step=False), rank, world)
    sharded_errors["another library's Lamb"] = _steps(model, Lamb, rank, world)
    before = {n: p.clone() for n, p in plain.state_dict().items()}
    plain_errors["another library's Lamb"] = _steps(plain, Lamb, rank, world)
    plain_moved["another library's Lamb"] = _moved(plain, before)
    before = sharc.full_state_dict(model)
    adamw_errors = _steps(model, torch.optim.AdamW, rank, world)
    adamw_moved = any(not torch.equal(v, before[n])
                      for n, v in sharc.full_state_dict(model).items())
    return sharded_errors, plain_errors, plain_moved, adamw_errors, adamw_moved


def test_optimizers_over_whole_parameters_are_refused_on_shards_and_step_elsewhere():
    """LBFGS, Adafactor and other libraries' LAMB compute over whole
    parameters (or all of them together): on flat shards they would silently give other numbers, so
    their first step over a shard raises, naming them and what to use.
    Over an unsharded model in the same process they step as ever, and an
    element-wise optimizer still trains the shards."""
    for sharded, plain, plain_moved, adamw_errors, adamw_moved in run_ranks(
            _whole_parameter_optimizers, 2):
        names = ["LBFGS", "Adafactor", "SparseAdam"] + (
            ["Muon"] if hasattr(torch.optim, "Muon") else [])
        assert sorted(sharded) == sorted(
            names + ["transformers Adafactor", "another library's Lamb"]), sharded
        for message in sharded.pop("another library's Lamb"):  # by its name: timm's, apex's
            assert message is not None and message.startswith(
                "sharc: test_corners.Lamb (Lamb) cannot train sharded parameters"), message
            assert "a ratio of that whole parameter's norms" in message, message
            assert "without its trust ratio, LAMB is AdamW" in message, message
        for message in sharded.pop("transformers Adafactor"):  # refused by its name
            assert message is not None and message.startswith(
                "sharc: transformers.optimization.Adafactor (Adafactor) cannot train sharded "
                "parameters"), message
        for name in names:
            for message in sharded[name]:
                assert message is not None, name
                assert message.startswith(
                    f"sharc: torch.optim.{name} cannot train sharded parameters (after "
                    "sharc.shard() every parameter it holds is this rank's flat 1-D shard): "
                ), message
                assert "torch.optim.AdamW" in message, message
        assert "of all parameters together" in sharded["LBFGS"][0]
        assert "train a model for LBFGS unsharded" in sharded["LBFGS"][0]
        assert "rows and columns" in sharded["Adafactor"][0]
        assert "sharding already divides the optimizer state" in sharded["Adafactor"][0]
        assert "dense shard" in sharded["SparseAdam"][0]
        for name, errors in plain.items():
            assert errors == [None, None] and plain_moved[name], (name, errors)
        assert adamw_errors == [None, None] and adamw_moved


# -- weight-decay groups chosen by dimension ----------------------------------------------
def _groups_by_dim(model, decay=0.1):
    """nanoGPT's configure_optimizers: matrices decayed, vectors not."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _groups_by_name(model, decay=0.1):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": decay},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _decay_group_warnings(rank, world):
    import warnings

    import sharc

    model = make_net()
    sharc.shard(model)
    plain = make_net()
    warned = {}
    head = torch.nn.Linear(3, 2)  # unsharded, beside the sharded model
    undecayed_backbone = [{"params": list(model.parameters()), "weight_decay": 0.0},
                          {"params": list(head.parameters()), "weight_decay": 0.1}]
    for name, net, groups in (("by dim, sharded", model, _groups_by_dim),
                              ("by name, sharded", model, _groups_by_name),
                              ("by dim, unsharded", plain, _groups_by_dim),
                              ("a decayed unsharded head", model, lambda _: undecayed_backbone)):
        opt = torch.optim.AdamW(groups(net), lr=1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # warned once, not at every step
                net(*batch(0, rank, world)).sum().backward()
                opt.step()
                opt.zero_grad()
        warned[name] = [str(w.message) for w in caught if "weight decay" in str(w.message)]
    return warned


def test_weight_decay_groups_chosen_by_the_dimension_of_shards_are_warned_of():
    """nanoGPT's and timm's groups (`p.dim() >= 2` decayed) put every flat
    shard in the group without decay: training silently ran with none. Now
    the first step warns, naming a matrix left undecayed and to choose by
    name; groups chosen by name, unsharded models, and a sharded backbone
    left undecayed beside a decayed unsharded head are not warned of."""
    for warned in run_ranks(_decay_group_warnings, 2):
        (message,) = warned["by dim, sharded"]
        assert message.startswith(
            "sharc: this AdamW has a param group with weight decay, yet no parameter of two "
            "or more dimensions is decayed ('"), message
        assert "Choose the groups from model.named_parameters() by name" in message
        assert warned["by name, sharded"] == [] and warned["by dim, unsharded"] == []
        assert warned["a decayed unsharded head"] == []


# -- dtype and device changes, deep copies after shard() ------------------------------
def _after_shard_changes(rank, world):
    import copy

    model, _ = _sharded("eager")
    errors = {}
    for name, change in {"double": lambda: model.to(torch.float64),
                         "bfloat16": lambda: model.bfloat16(),
                         "deepcopy": lambda: copy.deepcopy(model)}.items():
        try:
            change()
        except RuntimeError as e:
            errors[name] = str(e)
    model.to("cpu")  # no change: allowed
    loss = model(*batch(0, rank, world)).pow(2).mean()  # and nothing was half-converted
    loss.backward()
    return errors, {n: p.dtype for n, p in model.named_parameters()}


def test_dtype_changes_and_deepcopy_after_shard_are_refused_before_changing_anything():
    for errors, dtypes in run_ranks(_after_shard_changes, 2):
        assert "before shard()" in errors["double"] and "torch.float64" in errors["double"]
        assert "torch.bfloat16" in errors["bfloat16"]
        assert "deep-" in errors["deepcopy"] and "full_state_dict" in errors["deepcopy"]
        assert set(dtypes.values()) == {torch.float32}


# -- an EMA copy (torch.optim.swa_utils.AveragedModel) ---------------------------------
def _ema_outputs(rank, world, sharded):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    import sharc

    model = make_net()
    refused = None
    if sharded:
        sharc.shard(model)
        try:
            AveragedModel(model)  # deep-copies the sharded model
        except RuntimeError as e:
            refused = str(e)
        model = make_net()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))  # before shard()
    if sharded:
        sharc.shard(model)
        sharc.shard(ema)  # the recipe the refusal names
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for step in range(3):
        x = batch(step, rank, world)[0] if sharded else torch.cat(
            [batch(step, r, world)[0] for r in range(world)])
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
        with torch.no_grad():
            outputs.append(ema(torch.ones(2, x.size(1))))
    return refused, outputs


def test_an_ema_copy_is_refused_after_shard_and_trains_made_before_and_sharded_too():
    # Before, the refusal said only "deep-copy the model before shard()":
    # an AveragedModel made so but left whole failed at update_parameters
    # with torch's "The size of tensor a (8) must match the size of tensor b".
    _, want = _ema_outputs(0, 2, False)
    for refused, outputs in run_ranks(_ema_outputs, 2, True):
        assert "AveragedModel" in refused and "shard it too (sharc.shard(ema))" in refused
        for got, expected in zip(outputs, want):
            torch.testing.assert_close(got, expected)


# -- a submodule converted to its own dtype inside forward ----------------------------
class _ConvertsInForward(nn.Module):
    """HF's SwitchTransformers router does `self.classifier =
    self.classifier.to(self.dtype)` on every call: a no-op conversion that a
    compiled forward must trace through, not break its graph on."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)
        self.to_dtype = torch.float32

    def forward(self, x):
        self.inner = self.inner.to(self.to_dtype)
        return self.out(torch.relu(self.inner(x)))


def _converts_in_forward(rank, world, mode, to_dtype):
    import torch._dynamo.utils as dynamo_utils

    import sharc

    torch.manual_seed(0)
    model = _ConvertsInForward()
    sharc.shard(model)
    model.to_dtype = to_dtype
    step = model if mode == "eager" else torch.compile(model, backend="sharc")
    dynamo_utils.counters.clear()
    try:
        for it in range(2):
            model.zero_grad()
            step(*batch(it, rank, world)).pow(2).mean().backward()
    except RuntimeError as e:
        return "error", str(e)
    return _grads(model), sum(dynamo_utils.counters["graph_break"].values())


@pytest.mark.parametrize("mode", MODES)
def test_a_no_op_conversion_inside_forward_neither_breaks_the_graph_nor_changes_training(mode):
    torch.manual_seed(0)
    ref = _ConvertsInForward()
    ref.zero_grad()
    ref(torch.cat([batch(1, r, 2)[0] for r in range(2)])).pow(2).mean().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    results = run_ranks(_converts_in_forward, 2, mode, torch.float32)
    _check_grads([grads for grads, _ in results], want)
    for _, graph_breaks in results:
        assert graph_breaks == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_real_conversion_inside_forward_is_refused(mode):
    for result in run_ranks(_converts_in_forward, 2, mode, torch.float64):
        assert result[0] == "error", result
        assert "cannot move or cast the sharded parameter 'inner.weight'" in result[1]


# -- optimizers whose writes leave the version counter alone ----------------------------
class _DataSGD(torch.optim.Optimizer):
    """Plain SGD written the old way, through `.data` (no version bump)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


_UNSEEN_WRITERS = {
    # CPU's fused kernels do not move the parameters' version counters.
    "fused_adam": lambda params: torch.optim.Adam(params, lr=0.05, fused=True),
    "data_sgd": lambda params: _DataSGD(params, lr=0.2),
}
_UNSEEN_STEPS = 4


def _unseen_writes(rank, world, mode, optimizer, group=None):
    import sharc

    model = make_net()
    # Kept gathered between steps: every parameter (eager), or what the
    # compiled schedule keeps on its own (selective unsharding).
    config = sharc.ShardConfig(keep_gathered=("*",)) if mode == "eager" else None
    sharc.shard(model, group, config=config)
    step = model if mode == "eager" else torch.compile(model, backend="sharc")
    opt = _UNSEEN_WRITERS[optimizer](model.parameters())
    losses, kept = [], []
    for it in range(_UNSEEN_STEPS):
        loss = step(*batch(it, rank, world)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        kept.append(sharc.memory_stats(group)["kept_gathered_bytes"])
    return losses, kept, sharc.full_state_dict(model)


@pytest.mark.parametrize("mode", MODES)
def test_parameters_kept_gathered_see_optimizer_writes_the_version_counter_misses(mode):
    runs = _cases_in_one_launch(_unseen_writes, mode, tuple(_UNSEEN_WRITERS))
    for optimizer, results in runs.items():
        ref = make_net()
        opt = _UNSEEN_WRITERS[optimizer](ref.parameters())
        want = []
        for it in range(_UNSEEN_STEPS):
            x = torch.cat([batch(it, r, 2)[0] for r in range(2)])
            loss = ref(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            want.append(float(loss))
        for losses, kept, full in results:
            assert min(kept) > 0, f"{optimizer}: nothing kept gathered, the test proves nothing"
            got = [sum(r[0][i] for r in results) / 2 for i in range(_UNSEEN_STEPS)]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{optimizer} losses: {m}")
            for name, value in ref.state_dict().items():
                torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{optimizer} {name}: {m}")
