"""torch.classes.sharc.Scheduler, the one call from the bridge into the C++
pass pipeline: IR text, a pipeline as text and the facts (ScheduleFacts)
in; a Schedule with named fields out (structured nodes, each pass's named
statistics, the pipeline that ran with every argument written out)."""

import pytest
import torch

import sharc  # noqa: F401  (loads the library)
from sharc.config import CompileConfig

Scheduler = torch.classes.sharc.Scheduler

# As fx_to_ir.py produces it: parameters read directly, one gradient marker.
IR = """param @0 "g/0" bytes=64
param @1 "g/1" bytes=8
%x = input bytes=16
%y = compute "mm" %x @0 bytes=16
%z = compute "add" %y @1 bytes=16
%dw = compute "grad" %z bytes=64 grad=@0
output %z
"""


def _facts(**fields):
    facts = torch.classes.sharc.ScheduleFacts()
    for name, value in fields.items():
        setattr(facts, name, value)
    return facts


def test_structured_nodes_and_pass_statistics():
    schedule = Scheduler.run(IR, "", _facts())
    nodes = schedule.nodes
    assert "%sharc_reduce_0 = reduce_scatter @0 %dw" in schedule.ir
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
    passes = schedule.passes
    assert [p[0] for p in passes] == list(Scheduler.pass_names())
    stats = {name: s for name, skipped, s in passes if not skipped}
    assert stats["regather_in_backward"] == {"rewrites": 0}  # the bridge never saves params
    assert stats["insert_gather_release"]["rewrites"] == 2
    assert stats["insert_reduce_scatter"]["rewrites"] == 1
    assert stats["place_reduce_waits"]["rewrites"] == 1
    assert stats["mark_graph_prefetch"]["rewrites"] == 2
    assert stats["keep_gathered_params"] == {"rewrites": 0, "kept_bytes": 0}
    assert stats["bucket_allgathers"] == {"rewrites": 1, "buckets": 1, "cap_bytes": 65536}
    assert schedule.trace == []
    assert schedule.params == [(0, "", False), (1, "", False)]
    assert schedule.budget is None  # none given


def test_the_pipeline_that_ran_replays_the_schedule_without_facts():
    facts = _facts(memory_budget_bytes=10**6, collective_costs=[100.0, 0.01, 200.0, 0.01],
                   keep_for_backward=True, keep_candidates=[0, 1])
    first = Scheduler.run(IR, "", facts)
    assert "bucket_allgathers{budget=1000000,bytes=" in first.pipeline
    assert "gather_latency_us=100" in first.pipeline
    again = Scheduler.run(IR, first.pipeline, _facts())  # nothing measured, nothing given
    assert again.ir == first.ir and again.pipeline == first.pipeline
    assert again.budget == 10**6


def test_config_edits_and_trace():
    text = CompileConfig(gather_bucket_bytes=0, reduce_bucket_bytes=1,
                         disable_passes=("prefetch_gathers",)).pipeline_text()
    assert "-prefetch_gathers" in text and "bucket_allgathers{bytes=0}" in text
    schedule = Scheduler.run(IR, text, _facts(), trace=True)
    assert sum(kind == "gather" for kind, *_ in schedule.nodes) == 2
    assert ("prefetch_gathers", True, {}) in schedule.passes
    assert [(p, when) for p, when, _ in schedule.trace[:2]] == [
        ("regather_in_backward", "before"), ("regather_in_backward", "after")]
    assert len(schedule.trace) == 2 * sum(not skipped for _, skipped, _ in schedule.passes)


def test_defaults_are_compile_configs():
    config = CompileConfig()
    assert config.gather_bucket_bytes is None and config.memory_budget_bytes is None
    assert config.reduce_bucket_bytes is None
    shipped = Scheduler.run(IR, "", _facts())
    from_config = Scheduler.run(IR, config.pipeline_text(), _facts())
    assert shipped.ir == from_config.ir and shipped.pipeline == from_config.pipeline


def test_budget_costs_and_keeping_through_the_binding():
    facts = _facts(memory_budget_bytes=10**6, collective_costs=[100.0, 0.01, 200.0, 0.01],
                   keep_for_backward=True, keep_candidates=[0, 1])
    schedule = Scheduler.run(IR, "", facts)
    assert any(kept for _, _, kept in schedule.params)
    kept = {name: s for name, _, s in schedule.passes}["keep_gathered_params"]
    assert kept == {"rewrites": 2, "kept_bytes": 72}
    assert schedule.budget == 10**6
    assert Scheduler.peak_gathered_bytes(schedule.ir) <= 10**6
    assert " cost=" in schedule.ir
    with pytest.raises(RuntimeError, match="is below the smallest budget"):
        Scheduler.run(IR, "", _facts(memory_budget_bytes=1))
    raised = Scheduler.run(IR, "", _facts(memory_budget_bytes=1, budget_is_default=True))
    assert Scheduler.peak_gathered_bytes(raised.ir) > 1 and raised.budget > 1
    with pytest.raises(RuntimeError, match="collective_costs takes 4 numbers"):
        Scheduler.run(IR, "", _facts(collective_costs=[1.0]))


def test_a_missing_rule_names_the_pass_to_enable():
    text = CompileConfig(disable_passes=("insert_gather_release",
                                         "bucket_allgathers")).pipeline_text()
    with pytest.raises(RuntimeError, match="requires 'gathers inserted', which no earlier "
                                           "pass established; enable 'insert_gather_release'"):
        Scheduler.run(IR, text, _facts())


@pytest.mark.parametrize("text, message", [
    ("insert_gather_release,frobnicate", "no pass named 'frobnicate'"),
    ("bucket_allgathers{bytez=4}", "takes no argument 'bytez'"),
    ("bucket_allgathers{bytes=lots}", "bytes=lots of pass 'bucket_allgathers' is not an integer"),
    ("bucket_allgathers{bytes=4", "never closed"),
    ("insert_gather_release,,place_reduce_waits", "an empty pass"),
])
def test_a_bad_pipeline_is_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        CompileConfig(pipeline=text)
    with pytest.raises(ValueError, match="replaces the shipping pipeline"):
        CompileConfig(pipeline="insert_gather_release", disable_passes=("prefetch_gathers",))
