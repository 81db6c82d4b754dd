"""Hybrid sharding over a 2-D mesh ("replicate", "shard"), 4 gloo ranks as 2
hosts x 2: parameters sharded within a host, gradients reduce-scattered in
the shard group and all-reduced over the replicate group. Each rank trains
on its own slice of the batch, and the result equals single-process
training on the whole batch, eager and compiled; the byte counters of each
group are exact; no_sync and no_sync(replicate_only=True) give the result
without accumulation; clipping and the non-finite flag work over the mesh."""

import math

import pytest
import torch

from dist_harness import run_ranks
from models import (global_batch, make_optimizer, make_parity_model, rank_slice, shard_of,
                    train_single)

WORLD = 4
HOSTS = 2
PER_HOST = 2
STEPS = 6
BATCH_PER_RANK = 2


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (HOSTS, PER_HOST), mesh_dim_names=("replicate", "shard"))


def _shard_hybrid(model, how):
    import sharc

    if how == "mesh":
        return sharc.shard(model, mesh=_mesh())
    # Rank r is shard r % 2 of host r // 2: replicas are (0, 2) and (1, 3).
    return sharc.shard(model, config=sharc.ShardConfig(replicate_groups=((0, 2), (1, 3))))


def _train_hybrid(rank, world, how, compile_options, on_arrival=False):
    import sharc
    from sharc.api import sharded_root

    model = make_parity_model()
    _shard_hybrid(model, how)
    if on_arrival:  # a device's way of settling (header_readback.h), forced here
        sharded_root(model).runtime.set_settle_on_arrival(True)
    step_fn = model
    if compile_options is not None:
        step_fn = torch.compile(model, backend="sharc", options=compile_options)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, BATCH_PER_RANK * world)
        loss = step_fn(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = sharc.memory_stats(model_group(model))
    full = sharc.full_state_dict(model)
    return losses, (full if rank == 0 else None), stats


def model_group(model):
    from sharc.api import sharded_root

    return sharded_root(model).group


def _check_matches_single(results):
    ref_losses, ref_state = train_single(STEPS, BATCH_PER_RANK * WORLD)
    for step in range(STEPS):
        got = sum(r[0][step] for r in results) / WORLD
        assert abs(got - ref_losses[step]) / abs(ref_losses[step]) < 1e-5, f"step {step}"
    full = results[0][1]
    assert set(full) == set(ref_state)
    for name, want in ref_state.items():  # atol: see test_parity.py
        torch.testing.assert_close(full[name], want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(full["wte.weight"], make_parity_model().wte.weight)


@pytest.mark.parametrize("how", ["mesh", "replicate_groups"])
def test_hybrid_eager_matches_single_process(how):
    results = run_ranks(_train_hybrid, WORLD, how, None)
    _check_matches_single(results)
    # The shards are the shard group's (2 ranks), not the world's (4).
    model = make_parity_model()
    want = sum(4 * math.ceil(p.numel() / PER_HOST) for p in model.parameters())
    for _, _, stats in results:
        assert stats["shard_bytes"] == want
        assert stats["replicate_size"] == HOSTS
        assert stats["all_reduce_calls"] > 0 and stats["all_reduce_bytes"] > 0


def test_hybrid_settled_on_arrival_matches_single_process():
    """Headers of the reduce-scatters and the replicate all-reduces read back
    on arrival, as on a GPU: the same training."""
    _check_matches_single(run_ranks(_train_hybrid, WORLD, "mesh", None, True))


def test_hybrid_compiled_matches_single_process():
    results = run_ranks(_train_hybrid, WORLD, "mesh", {"inductor": False}, timeout=420)
    _check_matches_single(results)
    for _, _, stats in results:
        assert stats["all_reduce_calls"] > 0


def _one_step_bytes(rank, world, compiled, dump):
    import sharc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    sharc.shard(model, mesh=_mesh())
    options = {"inductor": False, "dump_ir": f"{dump}/{rank}"}
    fn = torch.compile(model, backend="sharc", options=options) if compiled else model
    for _ in range(2):  # the second step runs a schedule the ranks know
        sharc.reset_memory_stats(model_group(model))
        fn(torch.randn(4, 5)).sum().backward()
    return sharc.memory_stats(model_group(model))


@pytest.mark.parametrize("compiled", [False, True])
def test_bytes_per_group_are_exact(compiled, tmp_path):
    results = run_ranks(_one_step_bytes, WORLD, compiled, str(tmp_path))
    if compiled:  # the backward's schedule holds the all_reduce the pass placed
        scheduled = [f.read_text() for f in tmp_path.rglob("*") if f.is_file()]
        assert any(" = all_reduce %" in text for text in scheduled)
    widths = [math.ceil(n / PER_HOST) for n in (15, 3, 6, 2)]  # each parameter's shard
    for stats in results:
        # One bucket, eager and compiled: every shard gradient and one
        # non-finite flag (the eager bucket holds modules up to 4 MiB).
        payloads = [sum(widths) + 1]
        # Reduce-scatter in the shard group: (S - 1) rows of the payload.
        assert stats["reduce_scatter_bytes"] == sum((PER_HOST - 1) * 4 * p for p in payloads)
        assert stats["reduce_scatter_calls"] == len(payloads)
        # All-reduce over the replicate group: a ring sends 2 (R-1)/R of the
        # payload from each rank, all of it for R = 2.
        assert stats["all_reduce_bytes"] == sum(2 * (HOSTS - 1) * 4 * p // HOSTS
                                                for p in payloads)
        assert stats["all_reduce_calls"] == len(payloads)
        assert stats["shard_bytes"] == 4 * sum(widths)


def _accumulate(rank, world, mode, compiled):
    import sharc

    model = make_parity_model()
    sharc.shard(model, mesh=_mesh())
    fn = torch.compile(model, backend="sharc", options={"inductor": False}) if compiled else model
    opt = make_optimizer(model.parameters())
    group = model_group(model)
    most_unreplicated = 0
    for step in range(3):
        x, y = global_batch(step, BATCH_PER_RANK * world)
        x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
        if mode == "none":
            fn(x, y).backward()
        else:
            halves = [(x[:1], y[:1]), (x[1:], y[1:])]
            ctx = (sharc.no_sync(model, replicate_only=True) if mode == "replicate_only"
                   else sharc.no_sync(model))
            sharc.reset_memory_stats(group)
            with ctx:
                (fn(*halves[0]) / 2).backward()
            most_unreplicated = max(most_unreplicated,
                                    sharc.memory_stats(group)["unreplicated_grad_bytes"])
            (fn(*halves[1]) / 2).backward()
            stats = sharc.memory_stats(group)
            assert stats["unreplicated_grad_bytes"] == 0
            if mode == "replicate_only":  # reduce-scattered twice, all-reduced once
                assert stats["reduce_scatter_calls"] == 2 * stats["all_reduce_calls"]
            else:
                assert stats["reduce_scatter_calls"] == stats["all_reduce_calls"]
        opt.step()
        opt.zero_grad()
    full = sharc.full_state_dict(model)
    return (full if rank == 0 else None), most_unreplicated


@pytest.mark.parametrize("compiled", [False, True])
def test_accumulation_matches_one_batch(compiled):
    want = run_ranks(_accumulate, WORLD, "none", compiled)[0][0]
    for mode in ("no_sync", "replicate_only"):
        results = run_ranks(_accumulate, WORLD, mode, compiled)
        for name, value in want.items():
            torch.testing.assert_close(results[0][0][name], value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name: f"{mode} {name}: {m}")
        if mode == "replicate_only":  # the shard sums waited, one flag each
            n_params = sum(1 for p in make_parity_model().parameters() if p.requires_grad)
            shard_elems = sum(math.ceil(p.numel() / PER_HOST)
                              for p in make_parity_model().parameters() if p.requires_grad)
            assert all(r[1] == 4 * (shard_elems + n_params) for r in results), \
                [r[1] for r in results]


def _clip_and_flag(rank, world):
    import sharc

    model = make_parity_model()
    sharc.shard(model, mesh=_mesh())
    x, y = global_batch(0, BATCH_PER_RANK * world)
    model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
    norm = sharc.clip_grad_norm_(model, 0.1)
    clipped = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    # A non-finite gradient on one rank of the other host poisons every rank.
    loss = model(rank_slice(x, rank, world), rank_slice(y, rank, world))
    (loss * (math.inf if rank == 3 else 1.0)).backward()
    all_nan = all(bool(p.grad.isnan().all()) for p in model.parameters() if p.grad is not None)
    return float(norm), all_nan, None, clipped


def test_clip_and_nonfinite_flag_over_the_mesh():
    results = run_ranks(_clip_and_flag, WORLD)
    ref = make_parity_model()
    x, y = global_batch(0, BATCH_PER_RANK * WORLD)
    ref(x, y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    for norm, all_nan, _, _ in results:
        assert abs(norm - float(want)) / float(want) < 1e-5, (norm, float(want))
        assert all_nan
    # Replicas hold the same clipped shards (ranks 0 and 2, 1 and 3).
    for a, b in ((0, 2), (1, 3)):
        for ga, gb in zip(results[a][3], results[b][3]):
            assert torch.equal(ga, gb)


def _bad_inputs(rank, world):
    import sharc
    from torch.distributed.device_mesh import init_device_mesh

    errors = []

    def expect(fragment, fn):
        try:
            fn()
        except (TypeError, ValueError) as e:
            assert fragment in str(e), str(e)
            errors.append(str(e))
        else:
            raise AssertionError(f"no error for {fragment!r}")

    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    named = init_device_mesh("cpu", (HOSTS, PER_HOST), mesh_dim_names=("shard", "replicate"))
    mesh = _mesh()
    lin = lambda: torch.nn.Linear(2, 2)  # noqa: E731
    expect("mesh must be 2-D", lambda: sharc.shard(lin(), mesh=flat))
    expect("must be named ('replicate', 'shard') in that order",
           lambda: sharc.shard(lin(), mesh=named))
    expect("mesh must be a torch.distributed.device_mesh.DeviceMesh",
           lambda: sharc.shard(lin(), mesh=[[0, 1], [2, 3]]))
    expect("pass group= or mesh=, not both",
           lambda: sharc.shard(lin(), mesh.get_group("shard"), mesh=mesh))
    expect("pass mesh= or ShardConfig.replicate_groups, not both",
           lambda: sharc.shard(lin(), mesh=mesh,
                               config=sharc.ShardConfig(replicate_groups=((0, 2), (1, 3)))))
    expect("misses ranks [3]", lambda: sharc.shard(
        lin(), config=sharc.ShardConfig(replicate_groups=((0, 2), (1, 4)))))
    expect("leave group= unset (the world)", lambda: sharc.shard(
        lin(), mesh.get_group("shard"), config=sharc.ShardConfig(replicate_groups=((0, 1),))))
    model = sharc.shard(lin(), mesh=mesh)
    expect("replicate_only must be a bool",
           lambda: sharc.no_sync(model, replicate_only=1).__enter__())
    return errors


def test_bad_mesh_input_errors():
    for errors in run_ranks(_bad_inputs, WORLD):
        assert len(errors) == 8


def _train_and_save(rank, world, path, hybrid):
    import torch.distributed.checkpoint as dcp

    import sharc

    model = make_parity_model()
    if hybrid:
        sharc.shard(model, mesh=_mesh())
    else:
        sharc.shard(model)
    opt = make_optimizer(model.parameters())
    for step in range(2):  # Adam state and moved weights, from distinct data per rank
        x, y = global_batch(step, BATCH_PER_RANK * world)
        model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = sharc.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full = sharc.full_state_dict(model)
    moments = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in model.named_parameters()
               if p in opt.state}
    return (full if rank == 0 else None), moments


def _load_flat(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import sharc

    model = make_parity_model(seed=1)  # other values: all of them must come from the file
    sharc.shard(model)
    opt = make_optimizer(model.parameters())
    model_sd, optim_sd = sharc.get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    sharc.set_state_dict(model, opt, model_state_dict=state["model"],
                         optim_state_dict=state["optim"])
    full = sharc.full_state_dict(model)
    moments = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in model.named_parameters()
               if p in opt.state}
    return (full if rank == 0 else None), moments


def _saved_elements(path) -> tuple[int, int]:
    """(elements the checkpoint's tensor chunks hold, elements of the tensors)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata()
    held = whole = 0
    for item in meta.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            whole += math.prod(item.size)
            held += sum(math.prod(c.sizes) for c in item.chunks)
    return held, whole


def _shards_of(moments: dict, per: int, world: int) -> dict:
    """Each parameter's whole flat exp_avg_sq from the ranks' shards."""
    return {n: torch.cat([moments[r][n] for r in range(world)]) for n in moments[0]}


def test_checkpoint_from_a_2x2_mesh_loads_flat_bitwise(tmp_path):
    path = tmp_path / "hybrid"
    saved = run_ranks(_train_and_save, WORLD, str(path), True)
    want = saved[0][0]
    # One copy per replicate group: every element of every tensor once,
    # exactly what a flat save of the same model holds.
    held, whole = _saved_elements(path)
    assert held == whole
    flat_path = tmp_path / "flat"
    run_ranks(_train_and_save, 2, str(flat_path), False)
    assert _saved_elements(flat_path) == (held, whole)
    # The optimizer state as the shard group holds it (ranks 0, 1 of host 0).
    want_moments = _shards_of([saved[0][1], saved[1][1]], PER_HOST, PER_HOST)
    for world in (2, 4):
        loaded = run_ranks(_load_flat, world, str(path))
        got = loaded[0][0]
        assert set(got) == set(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), f"{world} ranks: {name}"
        got_moments = _shards_of([r[1] for r in loaded], world, world)
        for name, value in want_moments.items():
            n = make_parity_model().get_parameter(name).numel()
            assert torch.equal(got_moments[name][:n], value[:n]), f"{world} ranks: {name}"


class _TwoPaths(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, skip_b: bool):
        h = self.a(x)
        return (h if skip_b else self.b(h)).sum()


def _hosts_diverge(rank, world, verify):
    import sharc

    torch.manual_seed(0)
    model = _TwoPaths()
    sharc.shard(model, mesh=_mesh(), config=sharc.ShardConfig(verify_schedule=verify))
    try:
        for step in range(3):
            # In the last step the second host skips `b` (both of its ranks
            # alike, so its shard group agrees): only the replicas differ.
            model(torch.randn(2, 4), step == 2 and rank >= PER_HOST).backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("verify", [False, True])
def test_hosts_that_diverge_raise_instead_of_hanging(verify):
    # verify_schedule: found by a header exchange before the all-reduce.
    for rank, error in enumerate(run_ranks(_hosts_diverge, WORLD, verify, timeout=120)):
        assert error is not None, f"rank {rank} did not raise"
        assert "the hosts diverged" in error, error
        if verify:
            assert "is about to all-reduce" in error, error


def _hosts_diverge_on_arrival(rank, world):
    import sharc
    from sharc.api import sharded_root

    torch.manual_seed(0)
    model = _TwoPaths()
    sharc.shard(model, mesh=_mesh())
    runtime = sharded_root(model).runtime
    runtime.set_settle_on_arrival(True)
    try:
        for step in range(3):
            model(torch.randn(2, 4), step == 2 and rank >= PER_HOST).backward()
        runtime.settle_all()  # what a checkpoint save does first
    except RuntimeError as e:
        return str(e)
    return None


def test_hosts_that_diverge_raise_when_settled_on_arrival():
    for rank, error in enumerate(run_ranks(_hosts_diverge_on_arrival, WORLD, timeout=120)):
        assert error is not None, f"rank {rank} did not raise"
        assert "the hosts diverged" in error, error


def _replicas_diverge_at_an_all_reduce_left_in_flight(rank, world):
    """Two all-reduces over the replicas in flight, waited out of their start
    order (a schedule may wait a later bucket first). On the last lap the
    second host reduces `b` where the first reduces `a` (its own shard group
    agrees; only the replicas differ). The second host waits on that
    all-reduce, judges it and raises; the first waits on the later one,
    which the second host never starts."""
    from sharc._library import Runtime

    mesh = _mesh()
    group = mesh.get_group("shard").group_name
    rt = Runtime.for_group(group)
    rt.set_replicate_group(mesh.get_group("replicate").group_name)
    a = rt.register_param(torch.arange(8.0), "a")
    b = rt.register_param(torch.arange(8.0) + 100, "b")
    c = rt.register_param(torch.arange(6.0), "c")
    ops = torch.ops.sharc

    def start(param, numel):
        token = ops.start_reduce_scatter([torch.ones(numel)], group, [param])
        return ops.start_replicate_all_reduce(token, group, [param])

    for _ in range(8):  # laps alike everywhere, until the schedule is known
        first, later = start(a, 8), start(c, 6)
        ops.wait_reduce_scatter(later, group, [c])
        ops.wait_reduce_scatter(first, group, [a])
    second_host = rank >= PER_HOST
    mine = b if second_host else a
    try:
        first = start(mine, 8)
        if second_host:
            ops.wait_reduce_scatter(first, group, [mine])
        else:
            later = start(c, 6)
            ops.wait_reduce_scatter(later, group, [c])
            ops.wait_reduce_scatter(first, group, [mine])
    except Exception as error:  # noqa: BLE001  (the message is the result)
        return str(error)
    return None


def test_replicas_judge_an_earlier_all_reduce_before_waiting_on_a_later_one():
    # Without that order the first host waits for an all-reduce the second
    # never starts, and ends on gloo's "connection closed" (or its timeout)
    # instead of the divergence.
    messages = run_ranks(_replicas_diverge_at_an_all_reduce_left_in_flight, WORLD, timeout=120)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise"
        assert "the hosts diverged" in message, (rank, message)


def _accumulate_skipping_b(rank, world, mode, reset=False):
    """Two micro-batches, the first through `b` and the last not (every rank
    alike): what `b` held back (the full gradient, or with replicate_only its
    shard sums) must reach this step's gradient, not a later one's. With
    `reset`, every .grad is set to None by hand between them: what was held
    must go, as the first micro-batch's gradient goes in one process."""
    import sharc

    torch.manual_seed(0)
    model = _TwoPaths()
    sharc.shard(model, mesh=_mesh())
    group = model_group(model)
    grads = []
    for step in range(2):
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + 4 * m + rank))
              for m in range(2)]
        ctx = sharc.no_sync(model, replicate_only=mode == "replicate_only")
        with ctx:
            (model(xs[0], skip_b=step == 1) / 2).backward()
        if reset:
            for p in model.parameters():
                p.grad = None
        (model(xs[1], skip_b=step == 0) / 2).backward()
        stats = sharc.memory_stats(group)
        assert stats["unreduced_grad_bytes"] == 0 and stats["unreplicated_grad_bytes"] == 0, stats
        grads.append({n: None if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()})
        model.zero_grad()
    return grads


@pytest.mark.parametrize("reset", [False, True], ids=["kept", "grad_set_to_none"])
@pytest.mark.parametrize("mode", ["no_sync", "replicate_only"])
def test_accumulation_keeps_what_a_skipped_module_held(mode, reset):
    results = run_ranks(_accumulate_skipping_b, WORLD, mode, reset)
    torch.manual_seed(0)
    ref = _TwoPaths()
    for step in range(2):
        for m in range(2):
            if reset and m == 1:
                ref.zero_grad(set_to_none=True)
            for r in range(WORLD):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + 4 * m + r))
                (ref(x, skip_b=step == (0 if m == 1 else 1)) / (2 * WORLD)).backward()
        for rank, grads in enumerate(results):
            shard = rank % PER_HOST
            for name, p in ref.named_parameters():
                if p.grad is None:  # reset, and the last micro-batch skipped it
                    assert grads[step][name] is None, (mode, name)
                    continue
                torch.testing.assert_close(grads[step][name], shard_of(p.grad, shard, PER_HOST),
                                           msg=lambda m, name=name: f"{mode} {name}: {m}")
        ref.zero_grad()
