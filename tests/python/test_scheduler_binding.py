"""torch.classes.sharc.Scheduler, the one call from the bridge into the C++
pass pipeline: named options in, structured nodes and per-pass rewrite
counts out."""

import pytest
import torch

import sharc  # noqa: F401  (loads the library)
from sharc.config import CompileConfig

Scheduler = torch.classes.sharc.Scheduler

# As lower.py produces it: parameters read directly, one gradient marker.
IR = """param @0 "g/0" bytes=64
param @1 "g/1" bytes=8
%x = input bytes=16
%y = compute "mm" %x @0 bytes=16
%z = compute "add" %y @1 bytes=16
%dw = compute "grad" %z bytes=64 grad=@0
output %z
"""


def test_structured_nodes_and_pass_records():
    text, nodes, passes, trace, params, budget = Scheduler.schedule_nodes(IR)
    assert "%sharc_reduce_0 = reduce_scatter @0 %dw" in text
    assert nodes[1] == ("gather", ["sharc_gather_0"], [], [0, 1])
    assert nodes[2] == ("wait", ["sharc_full_0", "sharc_full_1"], ["sharc_gather_0"], [])
    # Cross-graph prefetch may start the next graph's gather once this one's
    # last wait is done (the graph is named by its last gather's parameters).
    assert nodes[3] == ("prefetch_next", [], [], [0, 1])
    assert nodes[4] == ("compute", ["y"], ["x", "sharc_full_0"], [])
    assert nodes[5] == ("release", [], ["y"], [0])
    assert ("prefetch_next", [], ["z"], [0, 1]) in nodes  # and after the last release
    # The reduction, its wait right before the output, which returns the shard gradient.
    assert nodes[-3:] == [("reduce_scatter", ["sharc_reduce_0"], ["dw"], [0]),
                          ("wait_reduce", ["sharc_shard_grad_0"], ["sharc_reduce_0"], []),
                          ("output", [], ["z", "sharc_shard_grad_0"], [])]
    assert [p[0] for p in passes] == list(Scheduler.pass_names())
    assert passes[0] == ("regather_in_backward", 0, False)  # the bridge never saves params
    assert passes[1] == ("cast_before_gather", 0, False)  # no dtypes, no casts
    by_name = {name: (rewrites, skipped) for name, rewrites, skipped in passes}
    assert by_name["insert_gather_release"] == (2, False)
    assert by_name["insert_reduce_scatter"] == (1, False)
    assert by_name["place_reduce_waits"] == (1, False)
    assert by_name["mark_graph_prefetch"] == (2, False)
    assert by_name["keep_gathered_params"] == (0, False)  # no budget, no measured cost
    assert trace == []
    assert params == [(0, "", False), (1, "", False)]
    assert budget == -1  # none given


def test_named_options_and_trace():
    _, nodes, passes, trace, _, _ = Scheduler.schedule_nodes(
        ir_text=IR, gather_bucket_bytes=0, reduce_bucket_bytes=1,
        disabled_passes=["prefetch_gathers"], trace=True)
    assert sum(kind == "gather" for kind, *_ in nodes) == 2
    assert ("prefetch_gathers", 0, True) in passes
    assert [(p, when) for p, when, _ in trace[:2]] == [("regather_in_backward", "before"),
                                                       ("regather_in_backward", "after")]
    assert len(trace) == 2 * sum(not skipped for *_, skipped in passes)


def test_defaults_are_compile_configs():
    config = CompileConfig()
    assert config.gather_bucket_bytes is None and config.memory_budget_bytes is None
    assert config.reduce_bucket_bytes is None
    defaults = Scheduler.schedule_nodes(IR)
    explicit = Scheduler.schedule_nodes(IR, gather_bucket_bytes=-1, reduce_bucket_bytes=-1,
                                        memory_budget_bytes=-1)
    assert defaults == explicit


def test_budget_costs_and_keeping_through_the_binding():
    costs = [100.0, 0.01, 200.0, 0.01]
    text, _, passes, _, params, budget = Scheduler.schedule_nodes(
        IR, memory_budget_bytes=10**6, collective_costs=costs, keep_for_backward=True,
        keep_candidates=[0, 1])
    assert any(kept for _, _, kept in params)
    assert budget == 10**6
    assert Scheduler.peak_gathered_bytes(text) <= 10**6
    assert " cost=" in text
    with pytest.raises(RuntimeError, match="is below the smallest budget"):
        Scheduler.schedule_nodes(IR, memory_budget_bytes=1)
    raised, *_ = Scheduler.schedule_nodes(IR, memory_budget_bytes=1,
                                          raise_budget_to_feasible=True)
    assert Scheduler.peak_gathered_bytes(raised) > 1
    with pytest.raises(RuntimeError, match="collective_costs takes 4 numbers"):
        Scheduler.schedule_nodes(IR, collective_costs=[1.0])


def test_a_missing_rule_names_the_pass_to_enable():
    with pytest.raises(RuntimeError, match="requires 'gathers inserted', which no earlier "
                                           "pass established; enable 'insert_gather_release'"):
        Scheduler.schedule_nodes(IR, disabled_passes=["insert_gather_release",
                                                      "bucket_allgathers"])
