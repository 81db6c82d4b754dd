"""Changing parameters after shard(): sharc.unsharded(model, writeback=True)
reaches the shards; writes that cannot reach them raise instead of
vanishing."""

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks


def _model():
    import sharc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    sharc.shard(model)
    return model


def _writeback(rank, world):
    import sharc

    model = _model()
    with sharc.unsharded(model, writeback=True):
        nn.init.zeros_(model[0].bias)
        model[2].weight.copy_(torch.arange(21.0).reshape(3, 7))
        model[0].weight.data.fill_(0.5)
        model[2].bias.data = torch.full((3,), 4.0)  # a new tensor swapped in
        assert model[0].weight is model[0].weight  # one tensor per parameter inside
        inside = sharc.memory_stats()["gathered_bytes"]
    full = sharc.full_state_dict(model)
    out = model(torch.ones(2, 5))  # forward sees the new values
    return full, out, inside, sharc.memory_stats()["gathered_bytes"]


def test_writeback_reaches_the_shards():
    for full, out, inside, after in run_ranks(_writeback, 2):
        assert torch.equal(full["0.bias"], torch.zeros(7))
        assert torch.equal(full["0.weight"], torch.full((7, 5), 0.5))
        assert torch.equal(full["2.weight"], torch.arange(21.0).reshape(3, 7))
        assert torch.equal(full["2.bias"], torch.full((3,), 4.0))
        hidden = torch.tanh(torch.full((2, 7), 2.5))
        assert torch.allclose(out, hidden @ full["2.weight"].T + full["2.bias"])
        assert inside == 0 and after == 0  # copies of their own, not the runtime's buffers



def _state_dicts_inside(rank, world):
    import sharc

    model = _model()
    with sharc.unsharded(model, writeback=True):
        model[0].weight.fill_(1.0)
        seen = {"state_dict": model.state_dict()["0.weight"].clone(),
                "full_state_dict": sharc.full_state_dict(model)["0.weight"]}
        loaded = model.state_dict()
        loaded["2.bias"] = torch.full((3,), 2.0)
        model.load_state_dict(loaded)
        seen["read_after_load"] = model[2].bias.clone()
    seen["after"] = sharc.full_state_dict(model)
    model = _model()
    try:
        with sharc.unsharded(model):  # no writeback: a load is a change like any other
            model.load_state_dict({**model.state_dict(), "2.bias": torch.zeros(3)})
        seen["no_writeback"] = None
    except RuntimeError as e:
        seen["no_writeback"] = str(e)
    return seen


def test_state_dicts_inside_unsharded_speak_its_full_tensors():
    """Inside the block its full tensors are the parameters: what was
    written there shows in state_dict() and full_state_dict() (a
    save_pretrained there saves it), and load_state_dict() writes them."""
    for seen in run_ranks(_state_dicts_inside, 2):
        assert torch.equal(seen["state_dict"], torch.ones(7, 5))
        assert torch.equal(seen["full_state_dict"], torch.ones(7, 5))
        assert torch.equal(seen["read_after_load"], torch.full((3,), 2.0))
        assert torch.equal(seen["after"]["0.weight"], torch.ones(7, 5))
        assert torch.equal(seen["after"]["2.bias"], torch.full((3,), 2.0))
        assert "'2.bias' was changed inside sharc.unsharded(model) without writeback=True" \
            in seen["no_writeback"], seen["no_writeback"]


def _save_pretrained_inside(rank, world, directory):
    import json
    import os

    import sharc
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40,
                                       n_positions=16))
    sharc.shard(model)
    with sharc.unsharded(model):
        if rank == 0:
            model.save_pretrained(directory)
    dist.barrier()
    with open(os.path.join(directory, "config.json")) as f:
        architectures = json.load(f)["architectures"]
    saved = GPT2LMHeadModel.from_pretrained(directory).state_dict()
    full = sharc.full_state_dict(model)
    return architectures, repr(model).split("(")[0], all(
        torch.equal(saved[k], v) for k, v in full.items())


def test_save_pretrained_inside_unsharded_names_the_original_class(tmp_path):
    """transformers writes type(model).__name__ into config.json's
    "architectures", which loaders read to find the class: shard() keeps
    the model's class name (sharc's subclass of it takes its names)."""
    for architectures, shown, same in run_ranks(_save_pretrained_inside, 2, str(tmp_path)):
        assert architectures == ["GPT2LMHeadModel"]
        assert shown == "GPT2LMHeadModel"  # repr too
        assert same


def _one_element_writeback(rank, world):
    import sharc

    torch.manual_seed(0)
    # A value head: its bias is one element, its full tensor a (1,) view of
    # a padded buffer, whose stride is the buffer's.
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    sharc.shard(model)
    model(torch.randn(2, 8)).sum().backward()
    with sharc.unsharded(model, writeback=True):
        model[1].bias.fill_(3.0)
    return sharc.full_state_dict(model)["1.bias"]


def test_writeback_of_a_one_element_parameter():
    for bias in run_ranks(_one_element_writeback, 2):
        assert torch.equal(bias, torch.tensor([3.0]))


def _reinit_by_parameters(rank, world):
    import sharc

    model = _model()
    with sharc.unsharded(model, writeback=True):
        shapes = [tuple(p.shape) for p in model.parameters()]
        torch.manual_seed(1)
        for name, p in model.named_parameters():  # the usual re-init loop
            if name.endswith("weight"):
                nn.init.normal_(p, std=0.02)
            else:
                p.zero_()
                p.requires_grad_(False)  # autograd's flags are the shard's own
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return shapes, sharc.full_state_dict(model), frozen


def test_a_loop_over_parameters_inside_unsharded_writes_the_full_parameters():
    # model.parameters() yields the shards; inside unsharded() they stand
    # for the full tensors, so the loop draws what it draws on one process.
    want = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    torch.manual_seed(1)
    for name, p in want.named_parameters():
        with torch.no_grad():
            nn.init.normal_(p, std=0.02) if name.endswith("weight") else p.zero_()
    for shapes, full, frozen in run_ranks(_reinit_by_parameters, 2):
        assert shapes == [(7, 5), (7,), (3, 7), (3,)]
        assert frozen == ["0.bias", "2.bias"]
        for name, value in want.state_dict().items():
            assert torch.equal(full[name], value), name


def _errors(rank, world):
    import sharc

    errors = {}
    model = _model()
    initial = sharc.full_state_dict(model)
    try:
        with sharc.unsharded(model):  # no writeback
            nn.init.zeros_(model[0].bias)
    except RuntimeError as e:
        errors["no_writeback"] = str(e)
    try:
        nn.init.ones_(model[2].weight)  # outside forward: a copy, would be lost
    except RuntimeError as e:
        errors["outside"] = str(e)
    # Through views of the copy: .data (no version counter of its own to
    # see), detach, indexing.
    for name, write in (("data", lambda w: w.data.fill_(7.0)),
                        ("detach", lambda w: w.detach().zero_()),
                        ("index", lambda w: w.view(-1).__setitem__(0, 1.0))):
        try:
            write(model[2].weight)
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    # Assigning .data swaps the copy's storage, at the same shape or
    # another (transformers' resize_token_embeddings).
    for name, new in (("data=", torch.zeros(3, 7)), ("data=shape", torch.zeros(4, 7))):
        try:
            model[2].weight.data = new
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    # The initialisers users call after construction: torch.nn.init hands
    # the tensor over by keyword (`tensor=`), eye_ writes through `out=`,
    # and a module's reset_parameters() calls them on its own attributes.
    for name, write in (("init.normal_", lambda w: nn.init.normal_(w)),
                        ("init.kaiming_uniform_", lambda w: nn.init.kaiming_uniform_(w)),
                        ("init.eye_", lambda w: nn.init.eye_(w)),
                        ("reset_parameters", lambda w: model[2].reset_parameters())):
        try:
            write(model[2].weight)
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    # Freezing through the copy would freeze nothing the optimizer holds;
    # unfreezing a frozen one would silently leave it frozen.
    for name, toggle in (("requires_grad_", lambda w: w.requires_grad_(False)),
                         ("requires_grad=", lambda w: setattr(w, "requires_grad", True))):
        try:
            toggle(model[2].weight)
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    logged = model[2].weight
    errors["reads"] = (logged.norm().item() > 0, type(logged * 2) is torch.Tensor)
    errors["own_copy"] = type(logged.clone()) is torch.Tensor  # a clone is the user's own
    errors["sparse"] = torch.equal(logged.to_sparse().to_dense(), logged)  # no storage to view
    try:
        with sharc.unsharded(model, writeback=True):
            if rank == 1:
                nn.init.zeros_(model[0].weight)  # one rank only
    except RuntimeError as e:
        errors["one_rank"] = str(e)
    try:
        model[0].weight = nn.Parameter(torch.zeros(7, 5))
    except RuntimeError as e:
        errors["assign"] = str(e)
    after = sharc.full_state_dict(model)
    errors["unchanged"] = all(torch.equal(after[k], v) for k, v in initial.items())
    return errors


def test_lost_or_diverging_writes_raise():
    for errors in run_ranks(_errors, 2):
        assert "'0.bias' was changed inside sharc.unsharded(model) without writeback=True" \
            in errors["no_writeback"]
        assert "'2.weight' read outside forward is a copy" in errors["outside"]
        assert "fill_ on it would change the copy only" in errors["outside"]
        assert "fill_ on it would change the copy only" in errors["data"]
        assert "zero_ on it would change the copy only" in errors["detach"]
        assert "__setitem__ on it would change the copy only" in errors["index"]
        for name in ("data=", "data=shape"):
            assert "'2.weight' read outside forward is a copy" in errors[name], errors[name]
            assert "assigning `.data` on it would change the copy only" in errors[name]
            assert "sharc.unsharded(model, writeback=True)" in errors[name]
        assert "change shapes" not in errors["data="]  # unsharded() can do this one
        assert "The new shape ([4, 7] for [3, 7]) cannot reach the shards" in errors["data=shape"]
        for name in ("init.normal_", "init.kaiming_uniform_", "init.eye_", "reset_parameters"):
            assert "'2.weight' read outside forward is a copy" in errors[name], (name, errors)
        for name in ("requires_grad_", "requires_grad="):
            assert "freezing or unfreezing it would change the copy only" in errors[name]
            assert "dict(model.named_parameters())['2.weight']" in errors[name]
        assert errors["reads"] == (True, True)  # reading it works, results are tensors
        assert errors["own_copy"]
        assert errors["sparse"]
        assert "sharc.unsharded(model, writeback=True)" in errors["outside"]
        assert "changed the parameters differently (first: '0.weight')" in errors["one_rank"]
        assert "cannot assign a new tensor to the sharded parameter '0.weight'" in \
            errors["assign"]
        assert errors["unchanged"]  # nothing written back


def _gradient_on_the_copy(rank, world):
    import sharc

    model = _model()
    model(torch.ones(2, 5) * (rank + 1)).sum().backward()
    errors = {}
    accesses = {
        "register_hook": lambda w: w.register_hook(lambda g: g * 0),
        "post_accumulate": lambda w: w.register_post_accumulate_grad_hook(lambda p: None),
        "retain_grad": lambda w: w.retain_grad(),
        "grad=": lambda w: setattr(w, "grad", torch.zeros(3, 7)),
        "grad": lambda w: w.grad.norm(),
        "detach.grad": lambda w: w.detach().grad,  # a view of the copy is one too
        # torch's own clipping reads `.grad` of what it is given: it found
        # None and silently clipped nothing
        "torch_clip": lambda w: torch.nn.utils.clip_grad_norm_([w], 1.0),
    }
    for name, access in accesses.items():
        try:
            access(model[2].weight)
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    shard = dict(model.named_parameters())["2.weight"]
    errors["shard_grad"] = shard.grad is not None and shard.grad.shape == shard.shape
    return errors


def test_gradient_access_on_a_copy_read_outside_forward_raises():
    """A hook, retain_grad() or `.grad` on the copy `model.fc.weight` gives
    outside forward would silently see nothing of training's gradient,
    which lives on the shard: each raises, naming the shard."""
    for errors in run_ranks(_gradient_on_the_copy, 2, timeout=120):
        effects = {"register_hook": "a hook registered on it would see only gradients that "
                                    "flow through this copy, never the model's",
                   "post_accumulate": "a hook registered on it would never be called",
                   "retain_grad": "retain_grad() on it would keep only gradients",
                   "grad=": "assigning its `.grad` would set a gradient no optimizer sees",
                   "grad": "its `.grad` is None whatever backward computed",
                   "detach.grad": "its `.grad` is None whatever backward computed",
                   "torch_clip": "its `.grad` is None whatever backward computed"}
        for name, effect in effects.items():
            error = errors[name]
            assert error.startswith("sharc: '2.weight' read outside forward is a copy of the "
                                    "sharded parameter"), (name, error)
            assert effect in error, (name, error)
            assert "`dict(model.named_parameters())['2.weight'].grad` is this rank's flat " \
                "shard of the averaged gradient" in error, (name, error)
            assert "sharc.clip_grad_norm_(model, max_norm)" in error
        assert errors["shard_grad"]


def _differentiating_with_respect_to_the_copy(rank, world):
    model = _model()
    x = torch.ones(2, 5) * (rank + 1)
    calls = {
        "backward(inputs=)": lambda loss, w: loss.backward(inputs=[w]),
        "autograd.backward": lambda loss, w: torch.autograd.backward(loss, inputs=[w]),
        "autograd.grad": lambda loss, w: torch.autograd.grad(loss, w),
        "allow_unused": lambda loss, w: torch.autograd.grad(loss, [w], allow_unused=True),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call(model(x).sum(), model[2].weight)
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    no_grads = all(p.grad is None for p in model.parameters())
    # A gradient with respect to a copy the outputs were computed from.
    w = model[2].weight
    (penalty,) = torch.autograd.grad(model(x).sum() + w.pow(2).sum(), w)
    shards = dict(model.named_parameters())
    model(x).sum().backward(inputs=[shards["2.weight"]])  # the shard: trains
    return errors, no_grads, torch.equal(penalty, 2 * w), shards["2.weight"].grad is not None


def test_differentiating_with_respect_to_a_copy_read_outside_forward_raises():
    """`loss.backward(inputs=[model.fc.weight])` (plain torch: that weight's
    gradient) stopped backward at the copy, leaving every gradient None
    silently, and `autograd.grad(loss, model.fc.weight)` failed with torch's
    "appears to not have been used in the graph" (None under allow_unused):
    each raises, naming the shard; a penalty on the copy differentiates."""
    for errors, no_grads, penalty, shard_trains in run_ranks(
            _differentiating_with_respect_to_the_copy, 2, timeout=120):
        for name, error in errors.items():
            assert error.startswith("sharc: '2.weight' read outside forward is a copy of the "
                                    "sharded parameter"), (name, error)
            assert "dict(model.named_parameters())['2.weight'].grad" in error, (name, error)
        for name in ("backward(inputs=)", "autograd.backward"):
            assert "naming it in backward(inputs=...) would stop backward at this copy" \
                in errors[name], errors[name]
        for name in ("autograd.grad", "allow_unused"):
            assert "torch.autograd.grad with respect to it finds no gradient" in errors[name]
        assert no_grads and penalty and shard_trains


def _copy_to_compiled_function(rank, world):
    import sharc

    model = _model()
    model(torch.ones(2, 5)).sum().backward()
    logged = torch.compile(lambda t: t.abs().sum(), backend="eager")(model[2].weight)
    return torch.allclose(logged, sharc.full_state_dict(model)["2.weight"].abs().sum())


def test_a_copy_read_outside_forward_can_be_handed_to_a_compiled_function():
    """Dynamo follows the copy's `_base` (once an endless chain of copies: a
    RecursionError) and reads its `.grad` making its fake tensor (None for
    torch's tracing, though a user's read raises)."""
    assert run_ranks(_copy_to_compiled_function, 2, timeout=120) == [True, True]


def test_writeback_must_be_a_bool():
    import sharc

    with pytest.raises(TypeError, match="writeback must be a bool"):
        with sharc.unsharded(nn.Linear(2, 2), writeback="yes"):
            pass
    with pytest.raises(TypeError, match="with_grads must be a bool"):
        with sharc.unsharded(nn.Linear(2, 2), with_grads=1):
            pass


class _WritesInForward(nn.Module):
    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.how = nn.Linear(5, 5), how

    def forward(self, x):
        w = self.lin.weight
        if self.how == "method":
            w.mul_(2)
        elif self.how == "operator":
            w += 1
        elif self.how == "view":
            w.t()[0].zero_()
        elif self.how == "embedding_max_norm":  # renormalises the rows it looks up, in place
            x = x + nn.functional.embedding(torch.tensor([0, 1]), w, max_norm=0.1)
        return x @ w.t()


def _write_in_forward(rank, world, how, mode, grad):
    import sharc

    model = _WritesInForward(how)
    sharc.shard(model)
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    try:
        with torch.set_grad_enabled(grad):
            out = step(torch.ones(2, 5))
        if grad:
            out.sum().backward()
        message = "no error"
    except Exception as e:  # noqa: BLE001  (compiled: wrapped by Dynamo)
        message = str(e)
    model.how = "none"  # the model still works, and nothing reached the shards
    out = model(torch.ones(2, 5))
    return message, sharc.full_state_dict(model)["lin.weight"]


@pytest.mark.parametrize("mode,grad", [("eager", False), ("eager", True), ("compiled", True)])
@pytest.mark.parametrize("how", ["method", "operator", "view", "embedding_max_norm"])
def test_a_write_to_a_gathered_parameter_inside_forward_raises(how, mode, grad):
    torch.manual_seed(0)
    initial = nn.Linear(5, 5).weight.detach()
    for message, weight in run_ranks(_write_in_forward, 2, how, mode, grad):
        if mode == "eager":
            assert "sharc: 'lin.weight' was changed in place inside forward" in message, message
        else:
            assert "the compiled forward writes in place to a gathered parameter" in message, \
                message
        assert "sharc.unsharded(model, writeback=True)" in message
        if how == "embedding_max_norm":
            assert "max_norm" in message, message  # named, with the out-of-place way
        assert torch.equal(weight, initial)


def _with_grads(rank, world):
    import sharc

    from models import global_batch, make_parity_model, rank_slice

    model = make_parity_model()
    sharc.shard(model)
    x, y = global_batch(0, 6)
    model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
    shard_grads = {n: None if p.grad is None else p.grad.clone()
                   for n, p in model.named_parameters()}
    with sharc.unsharded(model, with_grads=True):
        by_loop = {n: None if p.grad is None else p.grad.clone()
                   for n, p in model.named_parameters()}
        by_attribute = model.temperature.grad.clone()
    left_alone = {n: None if p.grad is None else p.grad.clone()
                  for n, p in model.named_parameters()}
    try:
        with sharc.unsharded(model, with_grads=True):
            model.lm_head.bias.grad.mul_(3)
        unkept = None
    except RuntimeError as e:
        unkept = str(e)
    with sharc.unsharded(model, writeback=True, with_grads=True):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(2)
        model.temperature.grad = None
    written = {n: None if p.grad is None else p.grad.clone()
               for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refused = {}
    for what, act in (("step", opt.step),
                      ("clip", lambda: sharc.clip_grad_norm_(model, 1.0)),
                      ("get_state_dict", lambda: sharc.get_state_dict(model, opt))):
        try:
            with sharc.unsharded(model, with_grads=True):
                act()
            refused[what] = None
        except (RuntimeError, ValueError) as e:
            refused[what] = str(e)
    refused["state made"] = bool(opt.state)
    return shard_grads, by_loop, by_attribute, left_alone, unkept, written, refused


def test_with_grads_gives_the_whole_gradient_writes_changes_back_and_refuses_steps_inside():
    from models import global_batch, make_parity_model, shard_of

    reference = make_parity_model()
    x, y = global_batch(0, 6)
    reference(x, y).backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    assert want["wpe.weight"] is None  # frozen: None on every side
    for rank, (shard_grads, by_loop, by_attribute, left_alone, unkept,
               written, refused) in enumerate(run_ranks(_with_grads, 3)):
        # Acting on the shards themselves inside raises, and changes nothing.
        for what in ("step", "clip", "get_state_dict"):
            assert refused[what] is not None and "inside sharc.unsharded()" in refused[what], what
        assert not refused["state made"]
        assert by_loop.keys() == want.keys()
        for name, grad in want.items():
            if grad is None:
                assert by_loop[name] is None and written[name] is None
                continue
            torch.testing.assert_close(by_loop[name], grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(left_alone[name], shard_grads[name], rtol=0, atol=0)
            if name == "temperature":
                assert written[name] is None
            else:  # doubled inside, written back to this rank's slice
                torch.testing.assert_close(written[name], 2 * shard_of(grad, rank, 3),
                                           rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(by_attribute, want["temperature"], rtol=1e-5, atol=1e-6)
        assert "the gradient of 'lm_head.bias'" in unkept and "writeback=True" in unkept
