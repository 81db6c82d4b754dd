"""The ranks agree on every collective inside it (docs/design/
collective-agreement.md): what the headers cost, exactly, and that a
schedule the ranks have run before takes no collective beyond its own."""

from __future__ import annotations

import torch
import torch.nn as nn

from dist_harness import run_ranks

HEADER = 48  # bytes of one rank's header in an all-gather
BITS = 98    # elements of header bits in each rank's row of a reduction


def _header_bytes(rank, world):
    import torch.distributed as dist

    from sharc._library import Runtime

    rt = Runtime.for_group(dist.new_group().group_name)
    a = rt.register_param(torch.arange(10.0), "a")
    b = rt.register_param(torch.arange(7.0).view(7, 1), "b")
    out = {}
    full = rt.gather(a)
    out["one"] = dict(rt.stats())
    out["a"] = full.clone()
    rt.release(a, "free")
    rt.reset_stats()
    rt.start_gather([a, b])
    out["a2"], out["b"] = (t.clone() for t in rt.wait_gather([a, b]))
    out["two"] = dict(rt.stats())
    rt.release(a, "free")
    rt.release(b, "free")
    rt.reset_stats()
    rt.reduce_scatter(a, torch.ones(10))
    out["reduce"] = dict(rt.stats())
    out["after"] = dict(rt.stats())
    return out


def test_headers_are_counted_apart_from_the_data():
    world = 2
    for out in run_ranks(_header_bytes, world):
        assert torch.equal(out["a"], torch.arange(10.0))  # rows compacted in place
        assert torch.equal(out["a2"], out["a"]) and torch.equal(out["b"], torch.arange(7.0).view(7, 1))
        one, two, reduce = out["one"], out["two"], out["reduce"]
        assert one["gathered_bytes"] == 10 * 4  # the padded bytes, as before
        # Room after each of the 2 shards (a gather in the shard's dtype sends
        # it in place), and for every rank's header in each gathered buffer.
        assert one["header_bytes"] == 2 * HEADER + world * HEADER
        assert one["allgather_bytes"] == (world - 1) * 5 * 4
        assert one["header_sent_bytes"] == (world - 1) * HEADER
        assert two["header_bytes"] == 2 * HEADER + 2 * world * HEADER  # two buffers
        assert two["header_sent_bytes"] == (world - 1) * HEADER  # one collective
        assert two["allgather_bytes"] == (world - 1) * (5 + 4) * 4
        assert reduce["reduce_scatter_bytes"] == (world - 1) * (5 + 1) * 4  # + the non-finite flag
        assert reduce["header_sent_bytes"] == (world - 1) * BITS * 4
        assert out["after"]["header_bytes"] == 2 * HEADER


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x):
        return self.layers(x).pow(2).mean()


def _extra_collectives(rank, world, mode):
    import sharc

    model = _Net()
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    calls = []
    for it in range(8):
        sharc.reset_memory_stats()
        step(torch.full((2, 8), float(rank + it))).backward()
        opt.step()
        stats = sharc.memory_stats()
        calls.append((stats["agreement_calls"],
                      stats["allgather_calls"] + stats["reduce_scatter_calls"]))
    return calls


def test_a_schedule_run_before_takes_no_collective_beyond_its_own():
    for mode in ("eager", "compiled"):
        for calls in run_ranks(_extra_collectives, 2, mode):
            extra = [c[0] for c in calls]
            assert extra[0] > 0, calls  # the first step: nothing expected yet
            # A collective announces what followed its context the last time:
            # a schedule met for the first time is announced from its second
            # lap on, fully from its third (eager prefetch changes the first
            # step's schedule, so that is step 3 in eager). A step of fewer
            # than kLag collectives (compiled, with every parameter kept
            # gathered: one gather and one reduction) needs more laps to
            # cover the kLag + context collectives a prediction spans.
            warm = 3 if mode == "eager" else 5
            assert extra[warm:] == [0] * (8 - warm), calls
