"""Cross-graph prefetch: when graph breaks split a compiled model, the next
graph's first gather starts at the end of the graph before it (from the
second step on, in the order recorded in the first), in forward and in
backward; training is unchanged and nothing stays gathered, also when the
graph that follows changes from one step to the next, and between forward
calls without backward (nothing is gathered ahead for the next call);
also across eager code between graphs that computes on what they return."""

import torch

from dist_harness import run_ranks
from models import GraphBreakBlock as _Block

STEPS = 4


class _Broken(torch.nn.Module):
    """Blocks separated by graph breaks; with `alternate`, odd steps take a
    detour through a different block (a different graph follows)."""

    def __init__(self, width=16, depth=3, alternate=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        self.detour = _Block(width)
        self.head = torch.nn.Linear(width, 1)
        self.alternate = alternate
        self.step = 0

    def forward(self, x, y):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.alternate and i == 0 and self.step % 2:
                x = self.detour(x)
        return torch.nn.functional.mse_loss(self.head(x), y)


def _batch(step, rank, world):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, 1, generator=g)
    return x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def _train(rank, world, alternate, compiled):
    import sharc

    torch.manual_seed(0)
    model = _Broken(alternate=alternate)
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model, backend="sharc") if compiled else model
    out = {"losses": [], "prefetches": [], "left": [], "gathers": []}
    for step in range(STEPS):
        model.step = step
        sharc.reset_memory_stats()
        loss = run(*_batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sharc.memory_stats()
        out["losses"].append(loss.item())
        out["prefetches"].append(stats["graph_prefetch_calls"])
        out["gathers"].append(stats["allgather_calls"])
        out["left"].append(stats["gathered_bytes"] - stats["kept_gathered_bytes"])
    return out


def _both(rank, world, alternate):
    return {mode: _train(rank, world, alternate, mode == "compiled")
            for mode in ("eager", "compiled")}


def test_the_next_graphs_first_gather_starts_ahead_and_training_is_unchanged():
    for out in run_ranks(_both, 2, False):
        eager, compiled = out["eager"], out["compiled"]
        for got, want in zip(compiled["losses"], eager["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want)
        assert compiled["left"] == [0] * STEPS
        # The first step records the order; from then on the same boundaries
        # between graphs of one kind start a gather ahead every step, and the
        # next graph then finds it in flight: no collective more than before.
        assert compiled["prefetches"][0] == 0
        assert compiled["prefetches"][1] >= 2
        assert compiled["prefetches"][1:] == [compiled["prefetches"][1]] * (STEPS - 1)
        assert compiled["gathers"][1:] == [compiled["gathers"][1]] * (STEPS - 1)
        assert compiled["gathers"][1] <= compiled["gathers"][0]
        assert eager["prefetches"] == [0] * STEPS  # eager code has no compiled graphs


def test_a_graph_that_does_not_follow_as_recorded_gives_its_prefetch_up():
    for out in run_ranks(_both, 2, True):
        eager, compiled = out["eager"], out["compiled"]
        for got, want in zip(compiled["losses"], eager["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want)
        # What was gathered ahead for a graph that did not come is freed.
        assert compiled["left"] == [0] * STEPS
        assert sum(compiled["prefetches"]) > 0


def _eval_calls(rank, world):
    import sharc

    torch.manual_seed(0)
    model = _Broken()
    sharc.shard(model)
    run = torch.compile(model, backend="sharc")
    out = []
    for step in range(STEPS):
        sharc.reset_memory_stats()
        with torch.no_grad():
            loss = run(*_batch(step, rank, world))
        stats = sharc.memory_stats()
        out.append((loss.item(), stats["graph_prefetch_calls"],
                    stats["gathered_bytes"] - stats["kept_gathered_bytes"]))
    return out


def test_forward_calls_without_backward_prefetch_within_a_call_only():
    for calls in run_ranks(_eval_calls, 2):
        assert [left for *_, left in calls] == [0] * STEPS  # nothing ahead for the next call
        prefetches = [n for _, n, _ in calls]
        assert prefetches[0] == 0 and all(n >= 1 for n in prefetches[1:]), prefetches


class _Linear(torch.nn.Module):
    """A module of the test's own: Dynamo does not compile torch.nn's own
    modules as frames of their own."""

    def __init__(self, width_in, width_out):
        super().__init__()
        self.fc = torch.nn.Linear(width_in, width_out)

    def forward(self, x):
        return self.fc(x)


class _Experts(torch.nn.Module):
    """Each module compiled on its own, with eager code between the graphs
    that computes on what the graphs return: the second expert reads the
    first graph's output (through eager code), never the first expert's,
    as a router's experts do."""

    def __init__(self, width=16):
        super().__init__()
        self.fc_in = _Linear(width, width)
        self.expert_a = _Linear(width, width)
        self.expert_b = _Linear(width, width)
        self.head = _Linear(width, 1)

    def compile_each(self):
        for module in (self.fc_in, self.expert_a, self.expert_b, self.head):
            module.compile(backend="sharc")

    def forward(self, x, y):
        h = torch.relu(self.fc_in(x))
        a = self.expert_a(h * 0.5)
        b = self.expert_b(h + 1.0)
        return torch.nn.functional.mse_loss(self.head(torch.relu(a + b)), y)


def _train_experts(rank, world):
    import sharc

    torch.manual_seed(0)
    model = _Experts()
    sharc.shard(model)
    model.compile_each()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": [], "prefetches": [], "gathers": [], "left": []}
    for step in range(STEPS):
        sharc.reset_memory_stats()
        loss = model(*_batch(step, rank, world))
        forward_prefetches = sharc.memory_stats()["graph_prefetch_calls"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sharc.memory_stats()
        out["losses"].append(loss.item())
        out["prefetches"].append(forward_prefetches)
        out["gathers"].append(stats["allgather_calls"])
        out["left"].append(stats["gathered_bytes"] - stats["kept_gathered_bytes"])
    return out


def _experts_reference(world):
    """The same training in one process, on the whole batch."""
    torch.manual_seed(0)
    model = _Experts()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = zip(*(_batch(step, rank, world) for rank in range(world)))
        loss = model(torch.cat(x), torch.cat(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_graphs_that_read_an_earlier_graphs_output_through_eager_code_prefetch_each_other():
    """The experts' graphs each continue the forward pass of the first
    graph, though eager code computed their inputs and neither reads the
    other's output: every graph boundary of the forward starts the next
    graph's gather ahead, from the second step on ([Note: forward
    dataflow])."""
    outs = run_ranks(_train_experts, 2)
    # Each rank's loss is its half's mean; the halves are equal in size.
    mean = [sum(pair) / 2 for pair in zip(*(out["losses"] for out in outs))]
    for got, want in zip(mean, _experts_reference(2)):
        assert abs(got - want) <= 1e-5 * abs(want), (mean, want)
    for out in outs:
        assert out["left"] == [0] * STEPS
        assert out["prefetches"][0] == 0
        # fc_in -> expert_a -> expert_b -> head: three boundaries a step.
        assert out["prefetches"][1:] == [3] * (STEPS - 1), out["prefetches"]
        assert out["gathers"][1:] == [out["gathers"][1]] * (STEPS - 1)
        assert out["gathers"][1] <= out["gathers"][0]


class _TiedAcrossGraphs(torch.nn.Module):
    """An embedding whose weight a later graph reads again (a tied output
    head, as transformers' models tie them), with graph breaks between the
    first graph and both readers: the first graph's prefetch point starts
    the next two graphs' buckets, which share that weight."""

    def __init__(self, width=16, vocab=20):
        super().__init__()
        self.fc_in = torch.nn.Linear(8, width)
        self.emb = torch.nn.Embedding(vocab, width)
        self.mid = torch.nn.Linear(width, width)

    def forward(self, x, ids):
        h = torch.tanh(self.fc_in(x))
        torch._dynamo.graph_break()
        h = h + self.emb(ids)
        torch._dynamo.graph_break()
        return torch.tanh(self.mid(h)) @ self.emb.weight.t()


def _tied_batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return (torch.randn(2, 3, 8, generator=g), torch.randint(0, 20, (2, 3), generator=g),
            torch.randint(0, 20, (2, 3), generator=g))


def _tied_loss(model, x, ids, target):
    return torch.nn.functional.cross_entropy(model(x, ids).flatten(0, 1), target.flatten())


def _train_tied(rank, world, compiled, options=None):
    import sharc

    torch.manual_seed(0)
    model = _TiedAcrossGraphs()
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model, backend="sharc", options=options) if compiled else model
    out = {"losses": [], "left": [], "peaks": []}
    for step in range(STEPS):
        sharc.reset_memory_stats()
        loss = _tied_loss(run, *_tied_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sharc.memory_stats()
        out["losses"].append(loss.item())
        out["left"].append(stats["gathered_bytes"] - stats["kept_gathered_bytes"])
        out["peaks"].append(stats["peak_gathered_bytes"])
    return out


def _tied_both(rank, world):
    return {mode: _train_tied(rank, world, mode == "compiled") for mode in ("eager", "compiled")}


def _tied_reference_losses():
    torch.manual_seed(0)
    ref = _TiedAcrossGraphs()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for step in range(STEPS):
        x, ids, target = (torch.cat(t) for t in zip(*(_tied_batch(step, r) for r in range(2))))
        loss = _tied_loss(ref, x, ids, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    return want


def test_a_weight_read_by_two_graphs_ahead_is_gathered_once_at_a_time():
    """The buckets a prefetch point starts are gathered in one collective
    per dtype; a parameter two of them share (a tied embedding read again
    by a later graph) is in it once: the second step crashed with "cannot
    start gathering parameter 'emb.weight': it is gathering"."""
    outs = run_ranks(_tied_both, 2)
    want = _tied_reference_losses()
    for mode in ("eager", "compiled"):
        got = [sum(pair) / 2 for pair in zip(*(out[mode]["losses"] for out in outs))]
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-5 * abs(w), (mode, got, want)
        for out in outs:
            assert out[mode]["left"] == [0] * STEPS


def test_what_points_gather_ahead_stays_within_the_memory_budget():
    """The graphs' parameters: fc_in 576 bytes, emb 1280, mid 1088; the
    last graph needs mid and emb together (2368 bytes). A 3000-byte budget
    fits every graph alone, but not the first graph's point starting the
    second's bucket and the third's together: one collective of three
    parameters, with its staging buffer as large again, beside fc_in.
    Points that counted neither the staging nor the later graphs' own
    peaks gathered 5312 bytes at once from the second step on."""
    budget = 3000
    outs = run_ranks(_train_tied, 2, True, {"memory_budget_bytes": budget})
    want = _tied_reference_losses()
    got = [sum(pair) / 2 for pair in zip(*(out["losses"] for out in outs))]
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)
    for out in outs:
        assert max(out["peaks"]) <= budget, out["peaks"]
        assert out["left"] == [0] * STEPS
