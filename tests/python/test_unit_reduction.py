"""Gather units' reductions at the end of backward: the units backward
reached share one collective per batch of neighbours, a batch closing once
its full gradients reach ShardConfig.eager_reduce_bucket_bytes (0: a unit
each). Batching changes no sum: training is bitwise the same whatever the
batch size, eager and compiled, on ranks whose routing differs."""

import pytest
import torch

from dist_harness import run_ranks
from models import ThreeMoELayers

WIDTH, EXPERTS, LAYERS = 8, 3, 3
UNITS = tuple(f"layers.{i}" for i in range(LAYERS))
# One unit's full gradients: the router (WIDTH x EXPERTS + EXPERTS) and the
# experts (EXPERTS x (WIDTH x WIDTH + WIDTH)), fp32.
UNIT_BYTES = 4 * (WIDTH * EXPERTS + EXPERTS + EXPERTS * (WIDTH * WIDTH + WIDTH))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3 + step % 3, 4, generator=g)  # rows change per step


def _train(rank, world, mode, bucket_bytes):
    import sharc

    torch.manual_seed(0)
    model = ThreeMoELayers(WIDTH, EXPERTS)
    sharc.shard(model, config=sharc.ShardConfig(gather_units=UNITS,
                                                eager_reduce_bucket_bytes=bucket_bytes))
    step_fn = torch.compile(model, backend="sharc") if mode == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"losses": [], "unit_reductions": []}
    for step in range(4):
        loss = step_fn(_batch(step, rank))
        with torch.profiler.profile() as prof:
            loss.backward()
        out["unit_reductions"].append(
            sum(e.name == "sharc::flush_unit" for e in prof.events()))
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = sharc.full_state_dict(model)
    return out


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_units_share_a_reduction_per_bucket_and_train_the_same(mode):
    batched = run_ranks(_train, 2, mode, 4 << 20)  # the default: all three fit
    one_each = run_ranks(_train, 2, mode, 0)
    two_batches = run_ranks(_train, 2, mode, UNIT_BYTES * 3 // 2)  # closes after two units
    for a, b, c in zip(batched, one_each, two_batches):
        assert a["unit_reductions"] == [1] * 4, a["unit_reductions"]
        assert b["unit_reductions"] == [LAYERS] * 4, b["unit_reductions"]
        assert c["unit_reductions"] == [2] * 4, c["unit_reductions"]
        for other in (b, c):
            assert a["losses"] == other["losses"]
            for name in a["params"]:
                assert torch.equal(a["params"][name], other["params"][name]), name
    assert batched[0]["losses"] != batched[1]["losses"]  # the ranks trained on their own rows


class _TwoOfThreeExperts(torch.nn.Module):
    """Rows routed to the first two of three experts by their own values
    (so each rank's data picks its own); the third is never chosen."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, h):
        choice = h[:, :2].argmax(dim=1)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().flatten()
            if rows.numel():
                out = out.index_copy(0, rows, expert(h[rows]))
        return out


class _RoutedTwoOfThree(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, WIDTH)
        self.moe = _TwoOfThreeExperts()

    def forward(self, x):
        return self.moe(self.inp(x)).pow(2).mean()


def _routed_batch(step, rank):
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))


def _routed(rank, world, mode):
    import sharc

    torch.manual_seed(0)
    model = _RoutedTwoOfThree()
    sharc.shard(model, config=sharc.ShardConfig(gather_units=("moe",)))
    fn = torch.compile(model, backend="sharc") if mode == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    unused_grads = []
    for step in range(3):
        fn(_routed_batch(step, rank)).backward()
        unused_grads.append([p.grad is None for p in model.moe.experts[2].parameters()])
        opt.step()
        opt.zero_grad()
    return unused_grads, sharc.full_state_dict(model)


def _check_against_one_process(results, world, unused_grads_wanted):
    """Every rank ends as one process training the ranks' rows does, with
    the never-chosen expert bitwise at its initial values and no gradient
    after any backward."""
    torch.manual_seed(0)
    model = _RoutedTwoOfThree()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(3):
        (sum(model(_routed_batch(step, r)) for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    for unused_grads, params in results:
        assert unused_grads == unused_grads_wanted, unused_grads
        for name, want in model.state_dict().items():
            torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)
        for name in ("moe.experts.2.weight", "moe.experts.2.bias"):
            assert torch.equal(params[name], initial[name]), name


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_unit_member_no_rank_used_gets_no_gradient_and_is_not_stepped(mode):
    """One process leaves an expert that no row chose without a gradient,
    and AdamW then skips it; a unit's zeros would let weight decay and the
    moments move it."""
    results = run_ranks(_routed, 2, mode)
    _check_against_one_process(results, 2, [[True, True]] * 3)


def _routed_hybrid(rank, world, accumulate):
    """2 hosts x 2 ranks; with `accumulate`, each step's rows in two
    micro-batches, the first under no_sync(replicate_only=True) (its shard
    sums held back until the last micro-batch's all-reduce)."""
    import sharc

    torch.manual_seed(0)
    model = _RoutedTwoOfThree()
    sharc.shard(model, config=sharc.ShardConfig(gather_units=("moe",),
                                                replicate_groups=((0, 2), (1, 3))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    unused_grads = []
    for step in range(3):
        x = _routed_batch(step, rank)
        if accumulate:
            with sharc.no_sync(model, replicate_only=True):
                (model(x[:2]) / 2).backward()
            unused_grads.append([p.grad is None for p in model.moe.experts[2].parameters()])
            (model(x[2:]) / 2).backward()
        else:
            model(x).backward()
        unused_grads.append([p.grad is None for p in model.moe.experts[2].parameters()])
        opt.step()
        opt.zero_grad()
    return unused_grads, sharc.full_state_dict(model)


@pytest.mark.parametrize("accumulate", [False, True], ids=["synced", "replicate_only"])
def test_under_hybrid_sharding_a_member_no_rank_used_gets_no_gradient(accumulate):
    """The used-by marks ride the replicas' all-reduce too, and a deferred
    all-reduce holds nothing back for a member its shard group left unused."""
    results = run_ranks(_routed_hybrid, 4, accumulate)
    _check_against_one_process(results, 4, [[True, True]] * (6 if accumulate else 3))


class _Repeated(torch.nn.Module):
    """`body` (a gather unit) runs a number of times the data decides."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 6)
        self.body = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(_repeats(x)):
            h = torch.tanh(self.body(h))
        return self.out(h).pow(2).mean()


def _repeats(x) -> int:
    return 1 + int(x.shape[0]) % 3  # rows 4, 5, 6 -> 2, 3, 1 calls


def _repeated_batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4 + (step + rank) % 3, 6, generator=g)


def _train_repeated(rank, world, mode):
    import sharc

    torch.manual_seed(0)
    model = _Repeated()
    sharc.shard(model, config=sharc.ShardConfig(gather_units=("body",)))
    run = torch.compile(model, backend="sharc") if mode == "compiled" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        run(_repeated_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    return sharc.full_state_dict(model)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_unit_run_a_different_number_of_times_on_each_rank_trains_as_one_process(mode):
    """The unit's reads join no reduction bucket: counted in them, a second
    read closed the bucket early on the rank that looped more, and the
    ranks' reductions of the parameters outside the unit parted."""
    torch.manual_seed(0)
    reference = _Repeated()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        (sum(reference(_repeated_batch(step, r)) for r in range(2)) / 2).backward()
        opt.step()
        opt.zero_grad()
    for state in run_ranks(_train_repeated, 2, mode):
        for name, want in reference.state_dict().items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=name)


def _reset_between_micro_batches(rank, world, mode):
    """A micro-batch under no_sync, every .grad set to None by hand, then a
    synced one: the units' held sums must go with the first micro-batch."""
    import sharc

    torch.manual_seed(0)
    model = ThreeMoELayers(WIDTH, EXPERTS)
    sharc.shard(model, config=sharc.ShardConfig(gather_units=UNITS))
    step_fn = torch.compile(model, backend="sharc") if mode == "compiled" else model
    with sharc.no_sync(model):
        (step_fn(_batch(0, rank)) * 100).backward()
    for p in model.parameters():
        p.grad = None
    step_fn(_batch(1, rank)).backward()
    held = sharc.memory_stats()["unreduced_grad_bytes"]
    return held, {n: None if p.grad is None else p.grad.clone()
                  for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_grad_set_to_none_by_hand_drops_what_units_held(mode):
    """Before: the first micro-batch's sums (100 times its gradient) came
    back in the units' reductions."""
    from models import shard_of

    results = run_ranks(_reset_between_micro_batches, 2, mode)
    torch.manual_seed(0)
    ref = ThreeMoELayers(WIDTH, EXPERTS)
    (sum(ref(_batch(1, r)) for r in range(2)) / 2).backward()
    for rank, (held, grads) in enumerate(results):
        assert held == 0
        for name, p in ref.named_parameters():
            if p.grad is None:
                assert grads[name] is None, name
                continue
            torch.testing.assert_close(grads[name], shard_of(p.grad, rank, 2), rtol=1e-4,
                                       atol=1e-6, msg=lambda m, name=name: f"rank {rank} {name}: {m}")
