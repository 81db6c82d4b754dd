"""Compute costs are measured once per call signature in a process: the
identical blocks of a model, and the next graph with the same calls, reuse
them (the first compile of a 12-block model measured each block's calls 12
times before). Symbolic sizes are measured at their hints."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sharc._compile.profile import CostCache, profile_compute


def _blocks(x, w1, w2):
    for _ in range(3):  # three identical blocks
        x = torch.relu(x @ w1) @ w2
    return x.sum()


def _inputs(n=32):
    return torch.randn(8, n), torch.randn(n, 2 * n), torch.randn(2 * n, n)


def _calls(graph):
    return [n for n in graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)]


def test_each_distinct_call_is_measured_once_and_reused_across_graphs():
    cache = CostCache()
    graph = make_fx(_blocks, tracing_mode="fake")(*_inputs()).graph
    costs = profile_compute(graph, cache)
    calls = _calls(graph)
    assert set(costs) == set(calls)  # every call has a cost
    distinct = 4  # mm (8x32 @ 32x64), relu, mm (8x64 @ 64x32), sum
    assert cache.measured == distinct, cache.measured
    # The three blocks' identical calls got the very same measurement.
    first_mms = [n for n in calls if "mm" in str(n.target) and
                 n.args[0].meta["val"].shape[1] == 32]
    assert len(first_mms) == 3 and len({costs[n] for n in first_mms}) == 1

    again = make_fx(_blocks, tracing_mode="fake")(*_inputs()).graph
    assert len(profile_compute(again, cache)) == len(calls)
    assert cache.measured == distinct  # nothing measured anew

    wider = make_fx(_blocks, tracing_mode="fake")(*_inputs(48)).graph
    profile_compute(wider, cache)
    assert cache.measured == 2 * distinct  # other sizes: other calls


def test_symbolic_sizes_are_measured_at_their_hints():
    cache = CostCache()
    graph = make_fx(_blocks, tracing_mode="symbolic")(*_inputs()).graph
    costs = profile_compute(graph, cache)
    assert costs and all(us >= 0 for us in costs.values())
    static = make_fx(_blocks, tracing_mode="fake")(*_inputs()).graph
    measured = cache.measured
    profile_compute(static, cache)  # the hints are these very sizes
    assert cache.measured == measured


def test_the_cache_is_bounded():
    cache = CostCache(capacity=2)
    profile_compute(make_fx(_blocks, tracing_mode="fake")(*_inputs()).graph, cache)
    assert len(cache._costs) == 2
