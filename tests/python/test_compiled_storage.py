"""Storage lifetime under Inductor. Inductor keeps its references to a fallback
kernel's outputs until the graph returns, so a release must free the gathered
bytes in place, at the point sharc's schedule puts it. A probe op inside the
compiled graph records each parameter's base storage as the graph runs:

- a gather runs where the schedule puts it: at the first use, or one
  bucket ahead with the prefetch pass;
- `a` is used once: its storage holds 0 bytes once that use is done;
- `b` is used twice: its storage survives the first use and is freed after
  the second;
- `c` is kept gathered (ShardConfig.keep_gathered): the same storage stays
  allocated across the step and across steps, and is gathered again after
  the optimizer changes its shard.
"""

import functools

import pytest
import torch
import torch.nn as nn

import scenario
from dist_harness import run_ranks

_WATCHED: dict[str, tuple[object, int]] = {}  # name -> (runtime, parameter id)
_RECORDS: list[tuple[str, dict[str, tuple[int, int]]]] = []


@torch.library.custom_op("sharc_test::probe", mutates_args=())
def probe(x: torch.Tensor, label: str) -> torch.Tensor:
    storages = {name: runtime.padded_base(pid).untyped_storage()
                for name, (runtime, pid) in _WATCHED.items()}
    # A released storage has no data pointer to read (reading it raises).
    _RECORDS.append((label, {n: (s.nbytes(), s.data_ptr() if s.nbytes() else 0)
                             for n, s in storages.items()}))
    return x.clone()


@probe.register_fake
def _(x, label):
    return torch.empty_like(x)


probe.register_autograd(lambda ctx, grad: (grad, None))


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16, bias=False)
        self.b = nn.Linear(16, 16, bias=False)
        self.c = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        h = probe(self.a(x), "after a")
        h = probe(self.b(h), "after b, first use")
        h = probe(self.c(h), "after c")
        h = self.b(h)
        return probe(h, "after b, second use").square().mean()


def _run(rank, world, prefetch, group=None):
    import sharc

    torch.manual_seed(0)
    model = Chain()
    eager = Chain()
    eager.load_state_dict(model.state_dict())
    sharc.shard(model, group, config=sharc.ShardConfig(keep_gathered=("c.weight",)))
    sharc.shard(eager, group=torch.distributed.new_group())
    root = sharc.api.sharded_root(model)
    _WATCHED.clear()
    for name in "abc":
        ref = next(r for r in root.refs_by_shard.values() if r.fqn == f"{name}.weight")
        _WATCHED[name] = (root.runtime, ref.pid)
    # No gather bucketing, so each gather stays its own collective; with
    # prefetch off, each sits right before its first use; unprofiled, so
    # nothing is kept gathered beyond c (selective unsharding would keep a).
    options = {"gather_bucket_bytes": 0, "profile": False}
    if not prefetch:
        options["disable_passes"] = ("prefetch_gathers",)
    compiled = torch.compile(model, backend="sharc", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    x = torch.randn(4, 16)
    losses = []
    for _ in range(3):
        _RECORDS.clear()
        loss = compiled(x)
        forward_records = list(_RECORDS)
        loss.backward()
        opt.step()
        opt.zero_grad()
        eager_loss = eager(x)
        eager_loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        losses.append((loss.item(), eager_loss.item(), forward_records))
    return losses


@functools.cache
def _runs():
    """Both schedules compiled and run in one launch, one after the other,
    each model sharded over its own process group: {prefetch: per-rank}."""
    runs = run_ranks(scenario.in_own_groups, 2, _run, [(False,), (True,)])
    return {prefetch: [r[i] for r in runs] for i, prefetch in enumerate((False, True))}


@pytest.mark.parametrize("prefetch", [False, True], ids=["at-use", "prefetched"])
def test_release_frees_storage_at_its_scheduled_point(prefetch):
    for losses in _runs()[prefetch]:
        c_pointers = set()
        for step, (loss, eager_loss, records) in enumerate(losses):
            # keep_gathered c sees every optimizer step: same losses as eager.
            assert abs(loss - eager_loss) <= 1e-6 * abs(eager_loss), f"step {step}"
            at = dict(records)
            assert list(at) == ["after a", "after b, first use", "after c",
                                "after b, second use"]
            assert at["after b, first use"]["a"][0] == 0  # single use: freed
            # b is gathered at its use, or prefetched while a's product runs:
            # in flight, its storage also holds every rank's collective
            # header (48 B each), dropped when the wait moves its rows.
            assert at["after a"]["b"][0] == (16 * 16 * 4 + 2 * 48 if prefetch else 0)
            assert at["after c"]["b"][0] == 16 * 16 * 4  # between b's two uses
            assert at["after b, second use"]["b"][0] == 0  # freed at the second
            for label in ("after c", "after b, second use"):
                nbytes, pointer = at[label]["c"]
                assert nbytes == 16 * 16 * 4
                c_pointers.add(pointer)
        assert len(c_pointers) == 1  # the same storage throughout
        assert losses[-1][0] < losses[0][0]
