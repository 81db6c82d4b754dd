"""Nothing derived from a full parameter (a view, an autocast downcast, a
copy) survives from forward to backward: backward gathers again. Measured
exactly, per storage: what is still alive when forward returns must be the
activations (tensors with the batch as their first dimension), the same
bytes as plain torch keeps on one process, and nothing else; and the
allocator's bytes on the forward's thread must be exactly those (so a
collective's input, a cast shard, is freed by the time its wait returns)."""

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dist_harness import run_ranks
from models import gathered_beyond_kept, shard_of

WIDTH = 256
BATCH = 3  # no parameter has a dimension of this size: activations are told by it


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, WIDTH, bias=False)
        self.b = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).float().pow(2).mean()


class CopiedWeight(TwoLayers):
    """A user clone of a weight inside forward, which the matmul saves (its
    other operand needs a gradient)."""

    def forward(self, x):
        return (self.b(x) @ self.a.weight.clone().t()).pow(2).mean()


class ViewsThenCast(nn.Module):
    """Weights that autocast casts after a view: of the transposed weight
    (`h @ w.t()`) and of a slice (`w[:, :]`); a plain Linear first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(48, 96)
        self.l2 = nn.Linear(96, 96, bias=False)
        self.l3 = nn.Linear(96, 48)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h = torch.relu(h @ self.l2.weight.t())
        return F.linear(h, self.l3.weight[:, :], self.l3.bias).float().pow(2).mean()


# scenario -> (model, input width, under autocast)
SCENARIOS = {"autocast": (TwoLayers, WIDTH, True), "copy": (CopiedWeight, WIDTH, False),
             "views_then_cast": (ViewsThenCast, 48, True)}


class _NewStorages(TorchDispatchMode):
    """Every storage an op returns while active (eager code only: compiled
    kernels allocate below the dispatcher), held weakly."""

    def __init__(self):
        super().__init__()
        self.weak: dict[int, tuple[int, tuple[int, ...]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                s = t.untyped_storage()
                self.weak.setdefault(s._cdata, (s._weak_ref(), tuple(t.shape)))
        return out

    def alive(self) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Storage -> (bytes now, the shape it was first returned in)."""
        out = {}
        for key, (ref, shape) in self.weak.items():
            if not torch.UntypedStorage._expired(ref):
                out[key] = (torch.UntypedStorage._new_with_weak_ptr(ref).nbytes(), shape)
        return out


def _saved_by_compiled(loss) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Storage -> (bytes, shape) of every tensor a compiled graph saved for
    backward (the compiled autograd functions' saved tensors)."""
    out, seen, stack = {}, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            for t in node.saved_tensors:
                out[t.untyped_storage()._cdata] = (t.untyped_storage().nbytes(), tuple(t.shape))
        stack += [f for f, _ in node.next_functions]
    return out


def _allocated_on_this_thread(fn):
    """(result, bytes the CPU allocator handed out on this thread while fn
    ran and did not take back)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return out, sum(e.nbytes() for e in events)


def _kept_after_forward(model, step, x, compiled):
    """(loss, bytes of activations, bytes of anything else alive after
    forward, bytes the allocator handed out on this thread)."""
    own = {t.untyped_storage()._cdata for t in [x, *model.parameters(), *model.buffers()]}
    storages = _NewStorages()
    with contextlib.nullcontext() if compiled else storages:  # an eager forward's every op
        loss, allocated = _allocated_on_this_thread(lambda: step(x))
    kept = _saved_by_compiled(loss) if compiled else storages.alive()
    kept.pop(loss.untyped_storage()._cdata, None)  # the caller's
    kept = {k: v for k, v in kept.items() if k not in own and v[0] > 0}
    activations = sum(n for n, shape in kept.values() if shape[:1] == (BATCH,))
    others = sum(n for n, shape in kept.values() if shape[:1] != (BATCH,))
    return loss, activations, others, allocated - loss.untyped_storage().nbytes()


def _forward_leftover(rank, world, mode, scenario):
    import sharc

    make, width, autocast = SCENARIOS[scenario]
    model = make()
    if mode != "single":
        sharc.shard(model)
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))
    out = []
    for _ in range(2):  # the first compiled step compiles
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, activations, others, allocated = _kept_after_forward(
                model, step, x, mode == "compiled")
        gathered = gathered_beyond_kept() if mode != "single" else 0
        loss.backward()
        out.append((activations, others, allocated, gathered, loss.item()))
    grads = [p.grad.clone() for p in model.parameters()]  # both steps' sum
    return out, grads


@functools.cache
def _run(mode, scenario):
    """One launch per configuration, shared by the tests that read it;
    "single": rank r's half of the batch on one unsharded process."""
    if mode == "single":
        return [_forward_leftover(rank, 2, mode, scenario) for rank in range(2)]
    return run_ranks(_forward_leftover, 2, mode, scenario)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_no_parameter_copy_survives_forward(mode, scenario):
    single = _run("single", scenario)
    for (steps, _), (single_steps, _) in zip(_run(mode, scenario), single):
        activations, others, allocated, gathered, _ = steps[-1]
        assert gathered == 0
        assert others == 0, f"{others} B derived from parameters survive forward"
        assert activations > 0  # what is measured is there
        if mode == "eager":  # what plain torch keeps, less its copies of weights
            assert activations == single_steps[-1][0]
            assert allocated == activations, (allocated, activations)


@pytest.mark.parametrize("scenario", ["autocast", "views_then_cast"])
def test_autocast_gradients_equal_single_process_eager_and_compiled(scenario):
    single = _run("single", scenario)
    for mode in ("eager", "compiled"):
        for rank, (steps, grads) in enumerate(_run(mode, scenario)):
            want_steps, _ = single[rank]
            assert [s[-1] for s in steps] == pytest.approx([s[-1] for s in want_steps],
                                                           rel=2e-2)
            # The mean of both ranks' unsharded gradients, as rank's shard.
            for got, want0, want1 in zip(grads, single[0][1], single[1][1]):
                torch.testing.assert_close(got, shard_of((want0 + want1) / 2, rank, 2),
                                           rtol=5e-2, atol=1e-3)
