"""A release frees a gathered buffer only after every kernel that reads it
has run, in the order Inductor's generated code really runs (it fuses and
reorders): checked on the generated wrapper code, and by training results
equal to single-process training.

The case that once crashed: `x * w[0] + w[1:].sum()`. The first use is
inlined into the final add, which Inductor emitted after the release that
followed the last use in graph order. And one that read a released bias: a
layer run under no_grad and again with grad, on one row, whose first use
(`bias * 1`) a value lowered before the release inlined, used after it
([Note: a release waits for the values computed from its buffer])."""

import functools

import pytest
import torch
import torch.nn as nn

import scenario
from dist_harness import run_ranks
from inductor_code import reads_after_release, release_count


class MultiUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.5, -2.0, 3.0]))

    def forward(self, x):
        w = self.w
        return (x * w[0] + w[1:].sum()).pow(2).mean()


class ViewsAndSlices(nn.Module):
    """Uses through transposes, slices, selects and reshapes of one weight,
    plus an ordinary single-use linear layer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        w = self.w
        h = x @ w.t()[:, :4]            # a view of a view
        h = h + w[2] * w[:, 1:].sum()   # a select and a slice, fused pointwise
        h = self.lin(torch.tanh(h)) + w.reshape(-1)[7]
        return h.pow(2).mean()


class NoGradThenGrad(nn.Module):
    """A target computed under no_grad by the layer that then runs with
    grad: on one row Inductor's CPU addmm becomes `(x.T * w).sum() + bias * 1`,
    and `bias * 1` is inlined into `h + target`, computed after the bias's
    release."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():
            target = self.lin(x[:, :1])
        h = self.lin(x)
        return self.head(h + target).pow(2).mean()


def make_no_grad_then_grad():
    torch.manual_seed(0)
    return NoGradThenGrad()


def make_multi_use():
    torch.manual_seed(0)
    return MultiUse()


def make_views():
    torch.manual_seed(0)
    return ViewsAndSlices()


def batch_1d(step, rank, world):
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(4, generator=g),)


def batch_2d(step, rank, world):
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(3, 4, generator=g),)


def batch_one_row(step, rank, world):
    """One sequence a rank, its length changing by step (the no_grad
    branch's first position stays one row)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(1, (5, 7, 3, 5)[step % 4], 4, generator=g),)


CASES = {
    "no_grad_then_grad": (make_no_grad_then_grad, batch_one_row, None),
    "multi_use": (make_multi_use, batch_1d, None),
    "views": (make_views, batch_2d, None),
    # A shell-style pattern: "w*" names w and not lin.weight (the kept
    # bytes below are w's alone).
    "keep_gathered": (make_views, batch_2d, ("w*",)),
}


def _compiled_with_code(rank, world, case, group=None):
    import sharc
    from torch._inductor.utils import run_and_get_code

    make_model, batch, keep = CASES[case]
    config = sharc.ShardConfig(keep_gathered=keep) if keep else None
    # First step under run_and_get_code to read the wrapper code of both graphs.
    codes = []

    def first_step(step_fn, inputs):
        def run():
            loss = step_fn(*inputs)
            loss.backward()
            return loss.detach()
        if codes:
            return run()
        loss, sources = run_and_get_code(run)
        codes.extend(sources)
        return loss

    out = scenario.run_sharded(rank, world, make_model, batch, "compiled", 4,
                               shard_config=config, train_step=first_step, group=group)
    out["codes"] = codes
    return out


@functools.cache
def _runs():
    """Every case compiled and trained in one launch, one after the other,
    each sharded over its own process group: {case: per-rank results}."""
    cases = sorted(CASES)
    runs = run_ranks(scenario.in_own_groups, 2, _compiled_with_code, [(c,) for c in cases])
    return {case: [r[i] for r in runs] for i, case in enumerate(cases)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_release_runs_after_every_read_in_generated_code(case):
    make_model, batch, _ = CASES[case]
    reference = scenario.run_reference(make_model, batch, 2, 4)
    results = _runs()[case]
    kept = 5 * 4 * 4 if case == "keep_gathered" else 0  # w stays gathered
    scenario.assert_matches_reference(results, reference, 2, kept=kept)
    for r in results:
        assert r["codes"], "no Inductor code was generated"
        assert sum(release_count(c) for c in r["codes"]) > 0
        for code in r["codes"]:
            assert reads_after_release(code) == []


def test_code_checker_sees_a_read_after_release():
    """The checker itself: the order the crash had is reported."""
    bad = ("def call(args):\n    buf3 = buf2[0]\n    k0(buf3, buf4)\n"
           "    torch.ops.sharc.release.default(buf3, [buf4], '0', 0)\n"
           "    k1(buf6, primals_2, buf3)\n    return (buf6, )\n\nrunner = Runner()\n")
    assert reads_after_release(bad) == ["after release of buf3: k1(buf6, primals_2, buf3)"]
    reuse = bad.replace("    k1(buf6, primals_2, buf3)\n", "    buf9 = buf3; del buf3  # reuse\n")
    assert len(reads_after_release(reuse)) == 1
    good = bad.replace("    k1(buf6, primals_2, buf3)\n", "    del buf3\n")
    assert reads_after_release(good) == []
