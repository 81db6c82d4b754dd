"""Trains a model three ways and compares them: unsharded on one process,
sharded eager, sharded compiled (backend="sharc"), the sharded runs on real
gloo ranks. SGD, so that parameters that get no gradient stay exactly put.

A scenario is a module-level `make_model()` (seeded, the same on every rank)
and `batch(step, rank, world)` giving one rank's inputs; the model's forward
takes them and returns a mean loss. The reference sees every rank's batch
concatenated, so its loss is the mean of the ranks' losses.
"""

from __future__ import annotations

import torch

from models import shard_of

LR = 0.1


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def in_own_groups(rank, world, fn, args_list):
    """`fn(rank, world, *args, group)` for each args in turn, in one launch
    of the ranks (so compiled runs pay the first compile's warm-up once),
    each with a process group of its own: a run that shards its model over
    it has counters, kept parameters and leftovers of its own, and a model
    compiled anew. Returns one rank's results, in order."""
    import torch.distributed as dist

    return [fn(rank, world, *args, dist.new_group()) for args in args_list]


def run_sharded(rank, world, make_model, batch, mode, steps, shard_config=None,
                compile_options=None, train_step=None, group=None):
    """One rank's run: per-step losses, the shard gradients of the first
    step, per-step peak and leftover gathered bytes, final full parameters.
    The model is sharded over `group` (default: the world)."""
    import sharc

    model = make_model()
    sharc.shard(model, group, config=shard_config)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step_fn = model if mode == "eager" else torch.compile(
        model, backend="sharc", options=compile_options)
    train_step = train_step or _default_step
    out = {"losses": [], "peaks": [], "left": [], "grads": None}
    for step in range(steps):
        sharc.reset_memory_stats(group)
        loss = train_step(step_fn, batch(step, rank, world))
        if out["grads"] is None:
            out["grads"] = {n: None if p.grad is None else p.grad.clone()
                            for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        stats = sharc.memory_stats(group)
        out["losses"].append(float(loss))
        out["peaks"].append(stats["peak_gathered_bytes"])
        out["left"].append(stats["gathered_bytes"])
        out.setdefault("kept", []).append(stats["kept_gathered_bytes"])
    out["params"] = {k: v for k, v in sharc.full_state_dict(model).items()}
    return out


def _default_step(step_fn, inputs):
    loss = _loss(step_fn(*inputs))
    loss.backward()
    return loss.detach()


def run_reference(make_model, batch, world, steps, train_step=None):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    train_step = train_step or _default_step
    out = {"losses": [], "grads": None}
    for step in range(steps):
        parts = [batch(step, r, world) for r in range(world)]
        inputs = tuple(torch.cat(xs) for xs in zip(*parts))
        loss = train_step(model, inputs)
        if out["grads"] is None:  # sparse ones (sparse embeddings) compared dense
            out["grads"] = {n: None if p.grad is None else
                            p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
                            for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss))
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def assert_matches_reference(results, reference, world, rtol=1e-5, atol=1e-6, kept=0):
    """Every rank's run against the unsharded one: mean loss per step, each
    rank's first-step shard gradient, final parameters; and memory: nothing
    gathered after any step but the `kept` bytes of keep_gathered parameters,
    and no growth of the per-step peak."""
    for step, want in enumerate(reference["losses"]):
        got = sum(r["losses"][step] for r in results) / world
        assert abs(got - want) <= rtol * 10 * abs(want) + atol, (step, got, want)
    for rank, r in enumerate(results):
        for name, ref_grad in reference["grads"].items():
            grad = r["grads"][name]
            if ref_grad is None:
                assert grad is None or not grad.any(), name
                continue
            assert grad is not None, f"rank {rank}: no gradient for {name}"
            torch.testing.assert_close(grad, shard_of(ref_grad, rank, world), rtol=rtol * 10,
                                       atol=atol * 10, msg=lambda m: f"grad {name}: {m}")
        for name, want in reference["params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=rtol * 10, atol=atol * 10,
                                       msg=lambda m: f"param {name}: {m}")
        # Only what the schedule keeps (keep_gathered, selective unsharding).
        assert r["left"] == r["kept"], f"rank {rank} left bytes gathered: {r['left']}"
        assert min(r["kept"]) >= kept, f"rank {rank} kept {r['kept']}, expected {kept} at least"
        # Prefetch learns its orders over the first steps (a schedule that
        # changes, as after a failed forward, reaches its steady peak at
        # the third or fourth); a leak grows on, into the second half.
        learning = max(3, len(r["peaks"]) // 2)
        steady = r["peaks"][learning:]
        assert max(steady, default=0) <= max(r["peaks"][:learning]), \
            f"rank {rank}: per-step peak gathered bytes grew: {r['peaks']}"
