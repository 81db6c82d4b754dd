"""Mixed precision (sharc.MixedPrecision): parameters cast shard-first and
gathered in bf16/fp16, gradients reduced in reduce_dtype and delivered to
fp32 shards; eager, compiled, and compiled with cast_before_gather off (the
naive order: gather fp32, then cast)."""

from __future__ import annotations

import copy
import re
import functools

import pytest
import torch
import torch.nn as nn

import scenario
from dist_harness import run_ranks
from models import global_batch, make_parity_model, rank_slice

BF16 = torch.bfloat16
NAIVE = {"disable_passes": ("cast_before_gather",)}


def _policy(param=BF16, reduce=torch.float32, output=None):
    import sharc

    return sharc.ShardConfig(mixed_precision=sharc.MixedPrecision(
        param_dtype=param, reduce_dtype=reduce, output_dtype=output))


# ------------------------------------------------ the fused gather, bitwise

SIZES = [(7,), (13, 3), (65,), (1,), (4, 4)]  # uneven over 2 and 4 ranks


def _gathers_in(rank, world, dtype):
    import torch.distributed as dist

    from sharc._library import Runtime

    group = dist.new_group()
    rt = Runtime.for_group(group.group_name)
    torch.manual_seed(0)
    ids = [rt.register_param(torch.randn(s), f"p{i}") for i, s in enumerate(SIZES)]
    for pid in ids:
        rt.set_spec(pid, dtype, torch.float32, torch.float32)
    reference = [rt.read_full(pid).to(dtype) for pid in ids]  # gather fp32, then cast
    single = [rt.gather(pid).clone() for pid in ids]  # one collective each
    for pid in ids:
        rt.release(pid, "free")
    sent_single = rt.stats()["allgather_bytes"]
    rt.start_gather(ids)  # one collective through a staging buffer
    bucket = [t.clone() for t in rt.wait_gather(ids)]
    for pid in ids:
        rt.release(pid, "free")
    return reference, single, bucket, sent_single, rt.stats()["gathered_bytes"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_then_gather_equals_gather_then_cast_bitwise(world, dtype):
    for reference, single, bucket, sent, left in run_ranks(_gathers_in, world, dtype):
        for want, a, b in zip(reference, single, bucket):
            assert a.dtype == b.dtype == dtype
            assert torch.equal(a, want) and torch.equal(b, want)
        assert left == 0
        # read_full sent fp32 shards once, the single gathers the small dtype
        fp32 = sum((world - 1) * -(-torch.Size(s).numel() // world) * 4 for s in SIZES)
        assert sent == fp32 + fp32 // 2


def _gathers_in_two_dtypes(rank, world):
    """One parameter gathered in fp32, released, then gathered in bf16 (and
    back), plain and persistent: what two compiled graphs that narrow it
    differently ask of the runtime."""
    import torch.distributed as dist

    from sharc._library import Runtime

    group = dist.new_group()
    rt = Runtime.for_group(group.group_name)
    torch.manual_seed(0)
    values = {}
    for persistent in (False, True):
        pid = rt.register_param(torch.randn(13, 3), f"w{persistent}")
        rt.set_persistent(pid, persistent)
        shard = rt.shard(pid)
        for dtype in (torch.float32, BF16, torch.float32):
            token = torch.ops.sharc.start_gather([shard], group.group_name, [pid], dtype, 0)
            full = torch.ops.sharc.wait_gather(token, group.group_name, [pid], dtype)[0]
            values.setdefault(persistent, []).append((full.clone(), rt.read_full(pid)))
            torch.ops.sharc.release(full, [], group.group_name, pid)
    return values


def test_a_parameter_gathered_in_another_dtype_than_last_time():
    for values in run_ranks(_gathers_in_two_dtypes, 2):
        for gathers in values.values():
            for (full, master), dtype in zip(gathers, (torch.float32, BF16, torch.float32)):
                assert full.dtype == dtype and torch.equal(full, master.to(dtype))


# ---------------------------------------------- parity with a bf16 reference

STEPS = 20
BATCH_PER_RANK = 4


def _batch(step, rank, world):
    x, y = global_batch(step, BATCH_PER_RANK * world)
    return rank_slice(x, rank, world), rank_slice(y, rank, world)


def _mp_run(rank, world, mode, options, config_fn=_policy):
    out = scenario.run_sharded(rank, world, make_parity_model, _batch, mode, STEPS,
                               shard_config=config_fn(), compile_options=options)
    return out


def _bf16_reference(world):
    """fp32 master weights; each step computes forward and backward in bf16
    on a bf16 copy, and the fp32 step uses its gradients."""
    master = make_parity_model()
    opt = torch.optim.SGD(master.parameters(), lr=scenario.LR)
    losses = []
    for step in range(STEPS):
        parts = [_batch(step, r, world) for r in range(world)]
        x, y = (torch.cat(t) for t in zip(*parts))
        low = copy.deepcopy(master).to(BF16)
        loss = low(x, y)
        loss.backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = None if q.grad is None else q.grad.float()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# The bound: bf16 keeps 8 significant bits, so each value is rounded by up to
# 2^-9 relative, and the loss itself is a bf16 number (steps of 0.4% near 4).
# The sharded run sums per-rank bf16 gradients in fp32 where the reference
# computes one bf16 gradient over the whole batch, so the two differ by a few
# bf16 roundings per step, compounded over 20 SGD steps. Measured: at most
# 0.8% (eager) and 0.7% (compiled) on 2 ranks; 2% (about five bf16 steps of
# the loss) leaves room for 4 ranks and other machines. The bound does not
# tell bf16 from fp32 training (their losses differ by about as much here):
# that the forward computes in bf16 is pinned separately, by each rank's
# loss being a bf16 value.
LOSS_RTOL = 2e-2


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_parity_with_single_process_reference(world):
    want = _bf16_reference(world)
    runs = {mode: run_ranks(_mp_run, world, mode, None) for mode in ("eager", "compiled")}
    for mode, results in runs.items():
        for step, ref in enumerate(want):
            got = sum(r["losses"][step] for r in results) / world
            assert abs(got - ref) <= LOSS_RTOL * abs(ref), (mode, step, got, ref)
        for r in results:
            assert all(torch.tensor(v).to(BF16).item() == v for v in r["losses"]), mode
            assert r["left"] == r["kept"]  # only what the schedule keeps
            # Master weights and gradients stay fp32.
            assert all(g is None or g.dtype == torch.float32 for g in r["grads"].values())
            assert all(p.dtype == torch.float32 for p in r["params"].values())
    assert want[-1] < want[0]  # it trains


def _fused_and_naive(rank, world):
    """Compiled with and without cast_before_gather: the same numbers. The
    scheduled graphs run op by op (inductor=False), so the two differ only in
    where the cast happens; Inductor may fuse the gradient casts of the two
    graphs differently, which is not the gather's doing."""
    return [scenario.run_sharded(rank, world, make_parity_model, _batch, "compiled", 3,
                                 shard_config=_policy(),
                                 compile_options={"inductor": False, **options})
            for options in ({}, NAIVE)]


def test_fused_and_naive_order_give_identical_training():
    for fused, naive in run_ranks(_fused_and_naive, 2):
        assert fused["losses"] == naive["losses"]
        for name, p in fused["params"].items():
            assert torch.equal(p, naive["params"][name]), name


# ---------------------------------------------- a weight copy returned under Inductor

class _ReturnsWeight(nn.Module):
    """Returns a copy of a gathered weight next to the logits. Under Inductor
    the copy is the weight's bf16 cast itself (Inductor drops the clone), a
    graph output, so the forward gathers out.weight in fp32 while the
    backward, which only reads the cast, gathers it in bf16."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x))), self.out.weight.detach().clone()


def _weight_batch(step, rank):
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def _returns_weight(rank, world, mode, dump_dir):
    import sharc

    model = _ReturnsWeight()
    sharc.shard(model, config=_policy())
    opt = torch.optim.SGD(model.parameters(), lr=scenario.LR)
    step = model if mode == "eager" else torch.compile(
        model, backend="sharc", options={"dump_ir": dump_dir})
    losses, copies = [], []
    for i in range(3):
        logits, weight = step(_weight_batch(i, rank))
        loss = logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        copies.append(weight)
    return losses, copies


def _returns_weight_reference(world):
    """fp32 master weights, each step computed on a bf16 copy of the model."""
    master = _ReturnsWeight()
    opt = torch.optim.SGD(master.parameters(), lr=scenario.LR)
    losses, copies = [], []
    for i in range(3):
        low = copy.deepcopy(master).to(BF16)
        logits, weight = low(torch.cat([_weight_batch(i, r) for r in range(world)]).to(BF16))
        loss = logits.float().pow(2).mean()
        loss.backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        copies.append(weight)
    return losses, copies


def test_a_weight_copy_returned_with_inductor_under_bf16(tmp_path):
    want_losses, want_copies = _returns_weight_reference(2)
    for mode in ("eager", "compiled"):
        results = run_ranks(_returns_weight, 2, mode, str(tmp_path))
        for step, want in enumerate(want_losses):
            got = sum(losses[step] for losses, _ in results) / 2
            assert abs(got - want) <= LOSS_RTOL * abs(want), (mode, step, got, want)
        for _, copies in results:
            assert all(c.dtype == BF16 for c in copies), mode
            assert torch.equal(copies[0], want_copies[0]), mode  # before any update
            for got, want in zip(copies[1:], want_copies[1:]):  # masters differ in rounding
                torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
    # What the test is about: the two graphs gather out.weight (id 2) in two dtypes.
    forward = (tmp_path / "rank0_000_forward.after.ir").read_text()
    backward = (tmp_path / "rank0_001_backward.after.ir").read_text()
    assert '/2" bytes=1024 dtype=float32' in forward, forward
    assert '/2" bytes=512 dtype=bfloat16' in backward, backward


# ---------------------------------------------- the saving, from exact counters

class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(33, 64)  # uneven sizes: padding in every shard
        self.b = nn.Linear(64, 17)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).float().pow(2).mean()


class _BrokenMlp(_Mlp):
    """Two compiled graphs and eager code between them."""

    def forward(self, x):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        h = h * self.b.weight.sum()  # read again after the break
        return self.b(h).float().pow(2).mean()


def _counters(rank, world, mode, param, reduce, options):
    import torch.distributed as dist

    import sharc

    # A group of its own: the counters are the runtime's of this group only,
    # untouched by the other policies run before it in this process.
    group = dist.new_group()
    model = _BrokenMlp() if mode == "graph_break" else _Mlp()
    sharc.shard(model, group, config=_policy(param, reduce) if param else None)
    step = model if mode == "eager" else torch.compile(model, backend="sharc", options=options)
    stats = []
    for i in range(3):
        sharc.reset_memory_stats(group)
        x = torch.randn(8, 33, generator=torch.Generator().manual_seed(10 * i + rank))
        step(x).backward()
        stats.append(sharc.memory_stats(group))
    return stats[-1]  # compiled by now


# policy name -> (param_dtype, reduce_dtype, compile options)
POLICIES = {"fp32": (None, None, None), "bf16": (BF16, torch.float32, None),
            "bf16_reduce": (BF16, BF16, None), "bf16_naive": (BF16, torch.float32, NAIVE)}


def _counters_of_policies(rank, world, mode, names):
    return {name: _counters(rank, world, mode, *POLICIES[name]) for name in names}


@functools.cache
def _policy_counters(mode):
    """Every policy's counters for `mode`, from one launch (each policy a
    fresh model, compiled anew, on its own process group): one rank's dict
    of policy name -> memory_stats per rank."""
    names = [n for n in POLICIES if mode == "compiled" or n != "bf16_naive"]
    return run_ranks(_counters_of_policies, 2, mode, names)


@pytest.mark.parametrize("mode", ["eager", "compiled", "graph_break"])
def test_bf16_halves_allgather_bytes_and_peak(mode):
    runs = _policy_counters(mode)
    fp32, bf16, bf16_reduce = ([r[name] for r in runs] for name in ("fp32", "bf16", "bf16_reduce"))
    bucket = 64 << 10  # CompileConfig's gather_bucket_bytes default
    for f, h, hr in zip(fp32, bf16, bf16_reduce):
        assert h["allgather_bytes"] * 2 == f["allgather_bytes"] > 0
        assert h["allgather_calls"] <= f["allgather_calls"]
        if mode == "eager":  # one parameter's buffer at a time: exactly half
            assert h["peak_gathered_bytes"] * 2 == f["peak_gathered_bytes"]
        else:  # bf16 buckets fit twice the parameters
            assert h["peak_gathered_bytes"] <= f["peak_gathered_bytes"] // 2 + bucket
        assert h["reduce_scatter_bytes"] == f["reduce_scatter_bytes"]  # reduced in fp32
        assert hr["reduce_scatter_bytes"] * 2 == f["reduce_scatter_bytes"]


def test_compiled_fusion_halves_bytes_against_the_naive_order():
    runs = _policy_counters("compiled")  # the same launch as the test above
    fused, naive = ([r[name] for r in runs] for name in ("bf16", "bf16_naive"))
    for f, n in zip(fused, naive):
        assert f["allgather_bytes"] * 2 == n["allgather_bytes"]
        assert f["peak_gathered_bytes"] < n["peak_gathered_bytes"]


def _peaks_without_keeping(rank, world, dump_dir):
    """Per policy: each step's peak gathered bytes of the compiled parity
    GPT, with selective unsharding off (kept parameters aside, what the
    schedule's buckets and prefetches hold)."""
    import torch.distributed as dist

    out = {}
    for name, param in (("fp32", None), ("bf16", BF16)):
        config = _policy(param) if param else None
        options = {"disable_passes": ("keep_gathered_params",),
                   "memory_budget_rule": "largest_param",  # the rule this pins
                   "dump_ir": f"{dump_dir}/{name}"}
        run = scenario.run_sharded(rank, world, make_parity_model, _batch, "compiled", 3,
                                   shard_config=config, compile_options=options,
                                   group=dist.new_group())
        out[name] = run["peaks"]
    return out


def _budgets(directory) -> list[int]:
    """The memory budget each dumped graph of rank 0 was scheduled under."""
    return [int(re.search(r"check_memory_budget\{budget=(\d+)", p.read_text()).group(1))
            for p in sorted(directory.glob("rank0_*.pipeline"))]


def test_compiled_bf16_never_gathers_more_than_fp32(tmp_path):
    """The default budget is four times the largest parameter in the dtype
    it is gathered in: counted in fp32 bytes, it gave bf16 graphs twice the
    room, which bigger buckets and earlier prefetches filled (bf16 peaked at
    1.04x fp32 here, the fp32 budget)."""
    runs = run_ranks(_peaks_without_keeping, 2, str(tmp_path))
    fp32, bf16 = _budgets(tmp_path / "fp32"), _budgets(tmp_path / "bf16")
    assert [2 * b for b in bf16] == fp32  # per graph, forward and backward
    for peaks in runs:
        assert max(peaks["bf16"]) <= max(bf16)  # the bound: the bf16 budget
        assert max(peaks["bf16"]) <= min(peaks["fp32"]), peaks


# ---------------------------------------------- autocast without a policy

class _Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)  # read in fp32 under autocast: not narrowed

    def forward(self, x):
        with torch.autocast("cpu", dtype=BF16):
            h = self.fc(x)
        return self.norm(h.float()).pow(2).mean()


def _autocast_ir(rank, world, dump_dir):
    import sharc

    model = _Autocast()
    sharc.shard(model)
    step = torch.compile(model, backend="sharc", options={"dump_ir": dump_dir})
    loss = step(torch.randn(4, 32))
    loss.backward()
    return float(loss)


def test_autocast_region_gathers_its_weights_in_bf16(tmp_path):
    run_ranks(_autocast_ir, 2, str(tmp_path))
    forward = (tmp_path / "rank0_000_forward.after.ir").read_text()
    params = [line for line in forward.splitlines() if line.startswith("param")]
    assert sum("dtype=bfloat16" in line for line in params) == 2, params  # fc weight, bias
    assert sum("dtype=float32" in line for line in params) == 2, params  # norm weight, bias


# ---------------------------------------------- the policy's edges

class _Edges(nn.Module):
    """A frozen float parameter, an integer parameter, a float buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 6)
        self.frozen = nn.Parameter(torch.randn(6), requires_grad=False)
        self.index = nn.Parameter(torch.arange(6), requires_grad=False)
        self.register_buffer("scale", torch.ones(6))
        self.seen = {}

    def forward(self, x, n):
        self.seen = {"x": x.dtype, "n": n.dtype, "weight": self.fc.weight.dtype,
                     "frozen": self.frozen.dtype, "index": self.index.dtype,
                     "scale": self.scale.dtype}
        return self.fc(x) * self.frozen * self.scale.to(x.dtype) + self.index[n, None].to(x.dtype)


def _edges(rank, world, output):
    import sharc

    model = _Edges()
    sharc.shard(model, config=_policy(output=output))
    out = model(torch.randn(2, 6), torch.tensor([1, 2]))
    out.float().sum().backward()
    grads = {n: (p.dtype, None if p.grad is None else p.grad.dtype)
             for n, p in model.named_parameters()}
    return model.seen, out.dtype, grads


def test_inputs_frozen_integer_and_buffers():
    seen, out_dtype, grads = run_ranks(_edges, 2, None)[0]
    assert seen == {"x": BF16, "n": torch.int64, "weight": BF16, "frozen": BF16,
                    "index": torch.int64, "scale": torch.float32}
    assert out_dtype == BF16
    assert grads["fc.weight"] == (torch.float32, torch.float32)
    assert grads["index"] == (torch.int64, None) and grads["frozen"] == (torch.float32, None)
    _, out_dtype, _ = run_ranks(_edges, 2, torch.float32)[0]
    assert out_dtype == torch.float32  # output_dtype


class _CastsItsOwnInput(nn.Module):
    """Records the dtype its forward is given, then casts the input itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.seen = None

    def forward(self, x):
        self.seen = x.dtype
        return self.fc(x.to(self.fc.weight.dtype))


def _input_casts(rank, world, cast, mode):
    import sharc

    model = _CastsItsOwnInput()
    sharc.shard(model, config=sharc.ShardConfig(mixed_precision=sharc.MixedPrecision(
        param_dtype=BF16, cast_forward_inputs=cast)))
    run = torch.compile(model, backend="sharc") if mode == "compiled" else model
    out = run(torch.randn(2 + rank, 4))
    out.float().sum().backward()
    return model.seen, out.dtype, dict(model.named_parameters())["fc.weight"].grad.dtype


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_cast_forward_inputs_false_hands_inputs_over_as_given(mode):
    for cast, given in ((True, BF16), (False, torch.float32)):
        for seen, out_dtype, grad_dtype in run_ranks(_input_casts, 2, cast, mode):
            assert seen == given, (cast, seen)
            assert out_dtype == BF16 and grad_dtype == torch.float32


def _bad_policies(rank, world):
    import sharc

    errors = []
    for param, reduce, model in [(torch.float64, None, nn.Linear(2, 2)),
                                 (None, torch.float64, nn.Linear(2, 2)),
                                 (torch.int32, None, nn.Linear(2, 2)),
                                 (torch.bool, None, nn.Linear(2, 2)),
                                 (torch.float32, None, nn.Linear(2, 2).to(BF16))]:
        try:
            sharc.shard(model, config=_policy(param, reduce))
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_widening_or_integer_dtypes_are_refused_at_shard():
    wide, wide_reduce, integer, boolean, wider_than_bf16 = run_ranks(_bad_policies, 2)[0]
    assert "param_dtype=torch.float64 is wider than parameter 'weight' (torch.float32)" in wide
    assert "reduce_dtype=torch.float64 is wider than parameter 'weight'" in wide_reduce
    assert "param_dtype=torch.int32 is not a floating-point dtype" in integer
    assert "'weight'" in integer and "torch.bfloat16" in integer
    assert "param_dtype=torch.bool is not a floating-point dtype" in boolean
    assert "wider than parameter 'weight' (torch.bfloat16)" in wider_than_bf16


def test_policy_fields_must_be_dtypes():
    import sharc

    with pytest.raises(TypeError, match="MixedPrecision.param_dtype must be a torch.dtype"):
        sharc.MixedPrecision(param_dtype="bf16")
    with pytest.raises(ValueError, match="output_dtype must be a floating-point dtype"):
        sharc.MixedPrecision(output_dtype=torch.int64)
    with pytest.raises(TypeError, match="cast_forward_inputs must be a bool"):
        sharc.MixedPrecision(cast_forward_inputs="no")


# ---------------------------------------------- fp16 with a loss scaler

class _TwoVectors(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(8))
        self.b = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x):
        return (self.a * x).sum() + (self.b * x).pow(2).sum()


def _scaled(rank, world, mode):
    import sharc

    model = _TwoVectors()
    sharc.shard(model, config=_policy(torch.float16))
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    history = []
    for i in range(4):
        x = torch.linspace(0.1, 0.8, 8) * (rank + 1)
        if i == 2 and rank == 1:
            x[0] = float("inf")  # one rank, one element: lands in rank 0's shard only
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(step(x)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        history.append((moved, scaler.get_scale()))
    return history, sharc.full_state_dict(model)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_grad_scaler_skips_the_same_steps_on_every_rank(mode):
    (h0, params0), (h1, params1) = run_ranks(_scaled, 2, mode)
    assert h0 == h1  # the same steps taken and skipped, the same scale
    assert [moved for moved, _ in h0] == [True, True, False, True]
    assert h0[2][1] == h0[1][1] / 2  # the inf halved the scale
    for name in params0:
        assert torch.equal(params0[name], params1[name]), name


class _ConvBN(nn.Module):
    """A conv net with batch norms: their running statistics are fp32 buffers."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)
        self.bn1 = nn.BatchNorm1d(5)

    def forward(self, x):
        self.seen = {"conv": self.conv.weight.dtype, "bn": self.bn.weight.dtype}
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.bn1(self.fc(h))


def _conv_bn_batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 3, 6, 6, generator=g)


def _conv_bn(rank, world, mode, modules):
    import sharc

    torch.manual_seed(0)
    model = _ConvBN()
    policy = sharc.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    if modules is not None:
        policy = sharc.MixedPrecision(param_dtype=BF16, full_precision_modules=modules)
    sharc.shard(model, config=sharc.ShardConfig(mixed_precision=policy))
    fn = model if mode == "eager" else torch.compile(model, backend="sharc")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    try:
        for step in range(3):
            loss = fn(_conv_bn_batch(step, rank)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    except RuntimeError as e:
        return str(e)
    return losses, model.seen, sharc.full_state_dict(model)


def test_batch_norms_keep_their_dtype_eager_and_compiled():
    """Batch norms are gathered in fp32 beside their fp32 running statistics
    (torch's kernels take a bf16 input with fp32 weights, not bf16 weights
    with fp32 statistics), in eager as in compiled mode, which agree."""
    torch.manual_seed(0)
    ref = _ConvBN()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for step in range(3):
        losses = [ref(_conv_bn_batch(step, r)).pow(2).mean() for r in range(2)]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
        want.append([x.item() for x in losses])
    for mode in ("eager", "compiled"):
        for rank, (losses, seen, params) in enumerate(run_ranks(_conv_bn, 2, mode, None)):
            assert seen == {"conv": BF16, "bn": torch.float32}, (mode, seen)
            torch.testing.assert_close(losses, [w[rank] for w in want], rtol=LOSS_RTOL, atol=1e-3)
            assert params["bn.running_mean"].dtype == torch.float32
            assert params["bn.weight"].dtype == torch.float32
    # Casting them too is torch's own error in eager mode (narrow weights,
    # wide statistics).
    error = run_ranks(_conv_bn, 2, "eager", ())[0]
    assert isinstance(error, str) and "BFloat16" in error, error


def test_full_precision_modules_must_be_module_classes():
    import sharc

    with pytest.raises(TypeError, match="full_precision_modules must be a tuple"):
        sharc.MixedPrecision(full_precision_modules=(nn.BatchNorm1d, "LayerNorm"))
    with pytest.raises(TypeError, match="full_precision_modules must be a tuple"):
        sharc.MixedPrecision(full_precision_modules=nn.BatchNorm1d)
