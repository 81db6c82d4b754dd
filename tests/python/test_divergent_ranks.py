"""Ranks that take different paths: a mixture-of-experts layer with learned
top-1 routing, where an expert gets no token on some rank at some step. With
the layer named in ShardConfig.gather_units every rank issues the same
collectives (the layer is gathered, re-gathered and reduced as one unit;
unused experts contribute zero gradients), and training matches one
unsharded process, eager and compiled."""

import re

import pytest
import torch
import torch.nn as nn

import scenario
from dist_harness import run_ranks
from models import small_switch_transformers

WIDTH, EXPERTS = 8, 3
SKIPPED = []  # (step, expert) pairs a rank routed no token to, in this process


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        choice = gate.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().flatten()
            if idx.numel() == 0:
                SKIPPED.append(e)
                continue
            out = out.index_add(0, idx, expert(x[idx]) * gate[idx, e:e + 1])
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.moe = MoE()
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.out(torch.relu(self.moe(self.inp(x)))).pow(2).mean()


def make():
    torch.manual_seed(0)
    return Net()


def batch(step, rank, world):
    g = torch.Generator().manual_seed(50 * step + rank)
    return (torch.randn(3, 4, generator=g),)


def _rank(rank, world, mode):
    import sharc

    config = sharc.ShardConfig(gather_units=("moe",))
    out = scenario.run_sharded(rank, world, make, batch, mode, 8, shard_config=config)
    out["skipped"] = len(SKIPPED)
    return out


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_moe_with_unused_experts_matches_single_process(mode):
    reference = scenario.run_reference(make, batch, 2, 8)
    results = run_ranks(_rank, 2, mode)
    assert sum(r["skipped"] for r in results) > 0, "no rank ever left an expert unused"
    scenario.assert_matches_reference(results, reference, 2)


def _bad_unit(rank, world):
    import sharc

    try:
        sharc.shard(make(), config=sharc.ShardConfig(gather_units=("mixture",)))
    except ValueError as e:
        return str(e)


def test_a_unit_name_that_matches_nothing_is_named():
    for message in run_ranks(_bad_unit, 2):
        assert "'mixture'" in message and "matches no module" in message


class _Scaled(nn.Module):
    """A ParameterList the root's forward indexes: never called either."""

    def __init__(self):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(WIDTH)) for _ in range(2))

    def forward(self, x):
        return x * self.scales[0] * self.scales[1]


def _unit_never_called(rank, world):
    import sharc

    messages = []
    for pattern, module in (("moe.experts", make()), ("*.experts", make()),
                            ("scales", _Scaled())):
        try:
            sharc.shard(module, config=sharc.ShardConfig(gather_units=(pattern,)))
            messages.append("accepted")
        except ValueError as e:
            messages.append(str(e))
            # Refused before anything changed: it shards with a unit that is called.
            sharc.shard(module, config=sharc.ShardConfig(gather_units=("moe",) if
                                                         pattern != "scales" else ()))
    return messages


def test_a_unit_that_is_never_called_is_refused_naming_its_caller():
    """`moe.experts` is a ModuleList: only its entries run, so a unit on it
    would never be gathered and the ranks' routing would still make them
    issue different collectives (gloo aborts). shard() refuses it before
    changing anything, naming the module to name instead."""
    for experts, pattern, scales in run_ranks(_unit_never_called, 2):
        assert experts.startswith("ShardConfig.gather_units names 'moe.experts', a ModuleList")
        assert "is never called" in experts and experts.endswith("instead: 'moe'")
        assert "'moe.experts' (matched by '*.experts')" in pattern
        assert "'scales', a ParameterList" in scales and scales.endswith("the root module ('')")


def test_a_pattern_names_its_outermost_matches_and_nested_units_are_refused():
    """`*` also matches dots: "blocks.*" matches each block and the modules
    inside it, and names the blocks (their experts ModuleList too would be
    refused as never called). Two patterns naming a unit and one inside it
    are refused."""
    from sharc._validate import resolve_gather_units

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(4)
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            return self.experts[0](self.ln(x))

    model = nn.Module()
    model.blocks = nn.ModuleList(Block() for _ in range(2))
    assert [n for n, _ in resolve_gather_units(model, ("blocks.*",))] == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match="unit 'blocks.0.ln' lies inside unit 'blocks.0'"):
        resolve_gather_units(model, ("blocks.*", "blocks.0.ln"))


# -- a rank that takes another path, caught by verify_schedule ------------------------
class _Skipper(torch.nn.Module):
    """Rank 1 skips the middle layer: a bug, not routing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = (torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x, skip: bool):
        x = self.first(x)
        if not skip:
            x = self.middle(x)
        return self.last(x).sum()


def _diverge(rank, world, mode):
    import sharc

    model = _Skipper()
    sharc.shard(model, config=sharc.ShardConfig(verify_schedule=True,
                                                 eager_prefetch=mode == "eager, prefetch"))
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    step(torch.ones(2, 6), False).backward()  # the same path: fine
    try:
        step(torch.ones(2, 6), rank == 1).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("mode", ["eager", "eager, prefetch", "compiled"])
def test_verify_schedule_names_where_ranks_diverged(mode):
    messages = run_ranks(_diverge, 2, mode, timeout=120)
    for rank, message in enumerate(messages):
        assert "the ranks diverged" in message, message
        assert f"rank {rank} is about to issue" in message
        assert "ShardConfig.gather_units" in message
        assert "the same number of forward and backward passes" in message  # or one eval more
        if mode == "eager":
            assert "'middle." in message and "'last." in message
        if mode == "compiled":  # the gathers share one bucket from 'first.'
            assert "their parameters first differ at position" in message, message
            assert "'middle." in message
        if mode == "eager, prefetch":  # both prefetched 'middle.'; rank 1 never reduces it
            assert "'middle." in message


def _read_on_rank_zero(rank, world, verify):
    import sharc

    model = _Skipper()
    sharc.shard(model, config=sharc.ShardConfig(verify_schedule=verify, rank_check_timeout_s=3))
    message = "no error"
    if rank == 0:
        try:
            print(model.first.weight.norm())  # logging on one rank: a collective
        except RuntimeError as e:
            message = str(e)
    # The model's group never saw the lone read: both ranks train on.
    model(torch.ones(2, 6), False).backward()
    return message, dict(model.named_parameters())["first.weight"].grad.clone()


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify_schedule"])
def test_a_read_on_one_rank_raises_there_and_the_job_goes_on(verify):
    (first, grad0), (second, grad1) = run_ranks(_read_on_rank_zero, 2, verify, timeout=120)
    assert "a read of a sharded parameter outside forward ('first.weight') is collective" in first
    assert "not every rank did within 3 s (ShardConfig.rank_check_timeout_s)" in first
    assert second == "no error"
    assert grad0.shape == grad1.shape and grad0.abs().sum() > 0


# -- a recompile on one rank only ---------------------------------------------------
class _Scaler(nn.Module):
    """`scale` changes no parameter use: ranks that pass different values
    issue the same collectives, although one of them compiles again."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, scale: bool):
        x = self.first(x)
        if scale:
            x = x * 2
        return self.last(x).pow(2).mean()


def _one_rank_recompiles(rank, world, mode):
    import sharc

    model = _Scaler()
    sharc.shard(model)
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    losses = []
    for it in range(3):  # rank 1 alone compiles a second graph at step 1
        loss = step(torch.full((2, 6), float(rank + it)), rank == 1 and it > 0)
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, grads


def test_a_recompile_on_one_rank_issues_no_collective():
    """Compiling (profiling included) may run on some ranks only: it must
    not issue a collective of its own, or it pairs with the other ranks'
    gathers (a hang or an abort)."""
    compiled = run_ranks(_one_rank_recompiles, 2, "compiled", timeout=180)
    eager = run_ranks(_one_rank_recompiles, 2, "eager", timeout=120)
    for (c_losses, c_grads), (e_losses, e_grads) in zip(compiled, eager):
        assert c_losses == pytest.approx(e_losses, rel=1e-5)
        for name in e_grads:
            torch.testing.assert_close(c_grads[name], e_grads[name], rtol=1e-4, atol=1e-6)


# -- ranks that diverge, caught by default (no verify_schedule) ---------------------
# Every collective carries each rank's header (see [Note: collective agreement]):
# the ranks find a divergence in the collective where it happens, whether the
# sizes match (which would mix parameters silently) or not (which would abort
# or hang), and all raise, naming what each rank issued.
class _Experts(nn.Module):
    """Rank r runs experts[r]; with `same_shape` they cannot be told apart by
    size. `warm` steps run expert 0 on every rank first, so the ranks have
    a schedule to expect."""

    def __init__(self, same_shape: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 6)
        widths = (6, 6) if same_shape else (6, 10)
        self.experts = nn.ModuleList(nn.Linear(6, w) for w in widths)
        self.out = nn.Linear(6, 1)

    def forward(self, x, which: int):
        h = self.experts[which](self.inp(x))
        return self.out(h[:, :6]).pow(2).mean()


def _routed(rank, world, mode, same_shape, warm):
    import sharc

    model = _Experts(same_shape)
    sharc.shard(model)
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    x = torch.ones(2, 6)
    for _ in range(warm):
        step(x, 0).backward()
    try:
        loss = step(x, rank)  # the routing diverges here
        loss.backward()
    except RuntimeError as e:
        message = str(e)
    else:
        return f"no error (loss {float(loss):.4f})"
    try:  # the group refuses anything later rather than pair it wrongly
        step(x, 0)
    except RuntimeError as e:
        return message, str(e)
    return message, "a later collective was issued"


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("same_shape", [True, False], ids=["same-size", "other-size"])
@pytest.mark.parametrize("warm", [0, 3], ids=["first-step", "after-3-steps"])
def test_ranks_that_route_differently_all_raise_by_default(mode, same_shape, warm):
    results = run_ranks(_routed, 2, mode, same_shape, warm, timeout=150)
    for rank, result in enumerate(results):
        assert isinstance(result, tuple), f"rank {rank}: {result}"
        message, later = result
        assert "the ranks diverged" in message, message
        assert "ShardConfig.gather_units" in message
        if mode == "eager":  # exact headers name what each rank gathered
            # Before the collective where the ranks expected nothing alike
            # yet (the first step), after it where they did.
            assert re.search(f"rank {rank} (issued|is about to issue) an all-gather of '",
                             message), message
            assert re.search(f"while rank {1 - rank} (issued|issues) an all-gather of '",
                             message), message
            assert "'experts." in message, message
        assert "the ranks diverged" in later and "cannot communicate any more" in later, later


class _Skip(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x, skip: int):
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _skips(rank, world, mode):
    import sharc

    model = _Skip()
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    for it in range(4):
        try:
            step(torch.ones(2, 6), 2 if (rank == 1 and it == 3) else -1).backward()
        except RuntimeError as e:
            return it, str(e)
        opt.step()
    return it, "no error"


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_rank_that_skips_a_layer_raises_instead_of_hanging(mode):
    for rank, (step, message) in enumerate(run_ranks(_skips, 2, mode, timeout=150)):
        assert step == 3, (rank, step, message)
        assert "the ranks diverged" in message, message


def _moe_without_unit(rank, world, mode):
    import sharc

    model = make()
    sharc.shard(model)  # no gather_units: routing decides which experts each rank gathers
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    try:
        for it in range(8):
            step(*batch(it, rank, world)).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_routing_without_a_unit_raises_instead_of_aborting(mode):
    for message in run_ranks(_moe_without_unit, 2, mode, timeout=150):
        assert "the ranks diverged" in message and "ShardConfig.gather_units" in message, message



class _FirstColumnPositive(torch.nn.Module):
    """A gather unit given only the rows whose first value is positive; with
    none (as HF's sparse MoE blocks do) its output is a constant."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.moe = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())

    def forward(self, x):
        h = self.inp(x)
        rows = h[x[:, 0] > 0]
        out = self.moe(rows) if rows.shape[0] else rows.new_zeros(rows.shape).detach()
        return h.pow(2).mean() + out.sum()


def _unit_given_no_rows(rank, world):
    import sharc

    torch.manual_seed(0)
    model = _FirstColumnPositive()
    sharc.shard(model, config=sharc.ShardConfig(gather_units=("moe",)))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank)).abs()
    if rank == 1:
        x[:, 0] = -1.0  # no row for the unit on this rank
    try:
        for _ in range(2):
            model(x).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_unit_given_no_rows_on_one_rank_is_named_as_the_cause():
    """Already a gather unit, so the advice to name one does not help: the
    error says a unit joins backward only where a gradient reaches it."""
    for message in run_ranks(_unit_given_no_rows, 2, timeout=150):
        assert "the ranks diverged" in message, message
        assert "A gather unit joins backward only on ranks where a gradient reaches its " \
            "output" in message, message

class _WithAuxHead(torch.nn.Module):
    """A main output and an auxiliary one, both computed on every rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 4)
        self.aux = torch.nn.Linear(4, 1)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return h.pow(2).mean(), self.aux(h).mean()


def _aux_loss_on_rank_0_only(rank, world, zero_elsewhere):
    """Rank 0 adds the auxiliary loss, rank 1 leaves it out (or adds 0 * aux,
    the workaround the error names); one SGD step, then the full weights."""
    import sharc

    def batch(r):
        return torch.randn(3, 4, generator=torch.Generator().manual_seed(r))

    def loss_of(model, r):
        main, aux = model(batch(r))
        return main + aux if r == 0 else (main + 0 * aux if zero_elsewhere else main)

    model = _WithAuxHead()
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    try:
        loss_of(model, rank).backward()
    except RuntimeError as e:
        return str(e)
    opt.step()
    reference = _WithAuxHead()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for r in range(world):  # one process: the mean of the ranks' losses
        (loss_of(reference, r) / world).backward()
    ref_opt.step()
    full = sharc.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def test_an_output_some_ranks_leave_out_of_the_loss_names_the_zero_term_workaround():
    """Eager: a module's output that reaches the loss on one rank only parts
    the ranks' backward collectives; the error names `loss + 0 * aux`, and
    with it the step matches one process."""
    for message in run_ranks(_aux_loss_on_rank_0_only, 2, False, timeout=150):
        assert isinstance(message, str) and "the ranks diverged" in message, message
        assert "`loss + 0 * aux`" in message, message
    for error in run_ranks(_aux_loss_on_rank_0_only, 2, True, timeout=150):
        assert error < 1e-6, error


def _switch_transformer(rank, world, mode, units):
    import sharc

    model = small_switch_transformers()
    sharc.shard(model, config=sharc.ShardConfig(gather_units=units))
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    losses = []
    try:
        for it in range(3):
            g = torch.Generator().manual_seed(10 * it + rank)  # each rank its own tokens
            ids = torch.randint(0, 64, (1, 4), generator=g)
            loss = step(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(float(loss))
    except RuntimeError as e:
        return str(e)
    return losses


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_switch_transformers_routes_differently_on_each_rank(mode):
    """An HF mixture-of-experts model with its own routing: without a gather
    unit the ranks raise (before: a hang); with its sparse MLPs named units
    they train."""
    for message in run_ranks(_switch_transformer, 2, mode, (), timeout=240):
        assert isinstance(message, str) and "the ranks diverged" in message, message
    if mode == "eager":  # (compiled units: test_moe_with_unused_experts_matches_single_process)
        for losses in run_ranks(_switch_transformer, 2, mode, ("*.mlp",), timeout=240):
            assert isinstance(losses, list) and len(losses) == 3, losses


def _compiled(model):
    """Compiled with profiling off: a schedule built from measured costs may
    differ between two runs (and so the order gradients are summed in), and
    these runs are compared bitwise."""
    return torch.compile(model, backend="sharc", options={"profile": False})


def _settled_on_arrival(rank, world, mode, diverge):
    """The path a device takes (header_readback.h), forced on the host: each
    collective's headers are copied at its wait and settled later. Returns
    the losses of four steps, the error of a step where the ranks route
    differently (raised at a later collective or by settle_all, which a
    checkpoint save calls), and whether the group refuses later work."""
    import sharc
    from sharc.api import sharded_root

    model = _Experts(same_shape=True)
    sharc.shard(model)
    runtime = sharded_root(model).runtime
    runtime.set_settle_on_arrival(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _compiled(model) if mode == "compiled" else model
    losses = []
    for it in range(4):
        x = torch.full((2, 6), 0.1 * (it + 1) * (rank + 1))
        try:
            loss = step(x, rank if (diverge and it == 3) else 0)
            loss.backward()
            runtime.settle_all() if it == 3 else None
        except RuntimeError as e:
            try:
                step(x, 0)
            except RuntimeError as later:
                return losses, str(e), str(later)
            return losses, str(e), "a later collective was issued"
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, None, None


def _settled_at_wait(rank, world, mode):
    import sharc

    model = _Experts(same_shape=True)
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _compiled(model) if mode == "compiled" else model
    losses = []
    for it in range(4):
        loss = step(torch.full((2, 6), 0.1 * (it + 1) * (rank + 1)), 0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_settling_on_arrival_trains_alike_and_still_catches_ranks_that_part(mode):
    agreed = run_ranks(_settled_on_arrival, 2, mode, False, timeout=150)
    at_wait = run_ranks(_settled_at_wait, 2, mode, timeout=150)
    for (losses, error, _), reference in zip(agreed, at_wait):
        assert error is None, error
        assert losses == reference  # bitwise: only when the headers are read moves
    for rank, (losses, error, later) in enumerate(
            run_ranks(_settled_on_arrival, 2, mode, True, timeout=150)):
        assert len(losses) == 3, (rank, losses)
        assert error is not None and "the ranks diverged" in error, (rank, error)
        assert "cannot communicate any more" in later, (rank, later)


# -- gather units and cross-graph prefetch ------------------------------------------
def _switch_gathers(rank, world, prefetch: bool):
    """The HF Switch model above, compiled with its sparse MLPs as units,
    each rank on its own tokens: losses, and all-gathers and cross-graph
    prefetches a step."""
    import sharc

    model = small_switch_transformers()
    sharc.shard(model, config=sharc.ShardConfig(gather_units=("*.mlp",)))
    options = {"profile": False}
    if not prefetch:
        options["disable_passes"] = ("mark_graph_prefetch",)
    step = torch.compile(model, backend="sharc", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": [], "gathers": [], "prefetches": []}
    for it in range(3):
        sharc.reset_memory_stats()
        g = torch.Generator().manual_seed(10 * it + rank)  # each rank its own tokens
        ids = torch.randint(0, 64, (1, 4), generator=g)
        loss = step(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sharc.memory_stats()
        out["losses"].append(loss.item())
        out["gathers"].append(stats["allgather_calls"])
        out["prefetches"].append(stats["graph_prefetch_calls"])
    return out


def test_compiled_switch_prefetches_across_its_graph_breaks_without_splitting_a_units_gather():
    """HF SwitchTransformers breaks its graph inside every sparse MLP and
    computes eagerly between the graphs; the graphs still continue one
    forward pass ([Note: forward dataflow]), so the next graph's gather
    starts ahead. A unit's members are gathered whole by the unit on the
    ranks that enter it, so no gather order starts one ahead alone (the
    router, read by a graph of its own, was: one all-gather more a step
    than with prefetch off, for each sparse MLP). Training is the same
    either way."""
    with_prefetch = run_ranks(_switch_gathers, 2, True, timeout=300)
    without = run_ranks(_switch_gathers, 2, False, timeout=300)
    for on, off in zip(with_prefetch, without):
        assert on["losses"] == off["losses"]
        assert min(on["prefetches"][1:]) > 0, on["prefetches"]
        # Prefetch sends several graphs' buckets in one collective; it never
        # adds one.
        assert all(a <= b for a, b in zip(on["gathers"][1:], off["gathers"][1:])), \
            (on["gathers"], off["gathers"])
