"""Gradients arrive reduce-scattered (averaged) in each rank's shard .grad,
match single-process gradients shard by shard, and accumulate."""

import torch

from dist_harness import run_ranks
from models import global_batch, make_parity_model, rank_slice, shard_of

WORLD = 2


def _reference_grads(batches):
    model = make_parity_model()
    for x, y in batches:
        model(x, y).backward()
    return {n: (p.grad.clone() if p.grad is not None else None)
            for n, p in model.named_parameters()}


def _sharded_grads(rank, world, batches, retain_two_losses=False):
    import sharc

    model = make_parity_model()
    sharc.shard(model)
    after_forward = []
    for x, y in batches:
        loss = model(rank_slice(x, rank, world), rank_slice(y, rank, world))
        stats = sharc.memory_stats()
        # Beyond what the schedule chose to keep for backward (the GPT's
        # tied embedding and head, which the head saved), counted as kept.
        after_forward.append(stats["gathered_bytes"] - stats["kept_gathered_bytes"])
        if retain_two_losses:
            (loss * 0.25).backward(retain_graph=True)
            (loss * 0.75).backward()
        else:
            loss.backward()
    grads = {n: (p.grad.clone() if p.grad is not None else None)
             for n, p in model.named_parameters()}
    return grads, after_forward, sharc.memory_stats()["gathered_bytes"]


def _check(results, ref):
    for rank, (grads, after_forward, after_backward) in enumerate(results):
        assert after_forward == [0] * len(after_forward), "full params survived forward"
        assert after_backward == 0, "full params survived backward"
        assert set(grads) == set(ref)
        for name, want in ref.items():
            if want is None:
                assert grads[name] is None, f"{name} is frozen but got a gradient"
                continue
            torch.testing.assert_close(grads[name], shard_of(want, rank, WORLD),
                                       rtol=1e-5, atol=1e-7, msg=name)


def test_one_backward_matches_single_process_shard_by_shard():
    batches = [global_batch(0, 4)]
    results = run_ranks(_sharded_grads, WORLD, batches)
    ref = _reference_grads(batches)
    assert ref["wpe.weight"] is None and ref["lm_head.bias"] is not None
    _check(results, ref)


def test_two_backwards_before_step_accumulate():
    batches = [global_batch(0, 4), global_batch(1, 4)]
    results = run_ranks(_sharded_grads, WORLD, batches)
    _check(results, _reference_grads(batches))


def test_two_backward_passes_over_one_forward():
    # Failure mode 3: retain_graph=True, two losses over one forward; the
    # second backward must re-gather what the first one released.
    batches = [global_batch(2, 4)]
    results = run_ranks(_sharded_grads, WORLD, batches, True)
    _check(results, _reference_grads(batches))


def _average_value(rank, world):
    import sharc

    lin = torch.nn.Linear(3, 1, bias=False)  # 3 elements over 2 ranks: padded
    with torch.no_grad():
        lin.weight.fill_(1.0)
    sharc.shard(lin)
    runtime = sharc.api.sharded_root(lin).runtime
    grad = torch.full((1, 3), float(rank + 1))
    direct = runtime.reduce_scatter(0, grad)
    lin(torch.full((1, 3), float(rank + 1))).sum().backward()
    return direct, lin._parameters["weight"].grad


def test_reduce_scatter_averages_not_sums():
    # Gloo may turn AVG into SUM silently; ranks contribute 1 and 2, so the
    # average is 1.5 and a sum would be 3.
    results = run_ranks(_average_value, WORLD)
    for rank, (direct, through_autograd) in enumerate(results):
        want = shard_of(torch.full((3,), 1.5), rank, WORLD)
        torch.testing.assert_close(direct, want)
        torch.testing.assert_close(through_autograd, want)
