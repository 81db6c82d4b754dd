"""The backend warns once, with the measured collective latencies, when
graph breaks split a sharded model's step into many compiled graphs (each
pays its own collectives); a model compiled whole does not warn."""

import warnings

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks


class _Broken(nn.Module):
    """Three linear layers with a graph break between each: three graphs."""

    def __init__(self, breaks: bool):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.breaks = breaks

    def forward(self, x):
        x = torch.tanh(self.layers[0](x))
        self._break()
        x = torch.tanh(self.layers[1](x))
        self._break()
        return torch.tanh(self.layers[2](x)).pow(2).mean()

    def _break(self):
        if self.breaks:
            torch._dynamo.graph_break()


def _warnings(rank, world, breaks, options):
    import sharc

    torch._dynamo.reset()
    model = _Broken(breaks)
    sharc.shard(model)
    step = torch.compile(model, backend="sharc", options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2):
            step(torch.randn(4, 16, generator=torch.Generator().manual_seed(i))).backward()
    return [str(w.message) for w in caught if issubclass(w.category, sharc.ManyGraphsWarning)]


@pytest.mark.parametrize("breaks", [True, False])
def test_warns_once_with_figures_on_a_graph_broken_model_only(breaks):
    for messages in run_ranks(_warnings, 2, breaks, {"warn_graphs": 3}):
        if not breaks:
            assert messages == [], messages
            continue
        assert len(messages) == 1, messages  # once, not per graph nor per step
        message = messages[0]
        assert "into at least 3 compiled graphs" in message, message
        # The measured figures: the group's collective latencies and the
        # latency floor they put on a step.
        assert "us latency per all-gather" in message and "ms per step" in message, message
        assert "warn_graphs=3" in message and "torch._dynamo.explain" in message, message


def test_below_the_threshold_or_switched_off_it_stays_silent():
    for options in ({"warn_graphs": 4}, {"warn_graphs": None}):
        for messages in run_ranks(_warnings, 2, True, options):
            assert messages == [], (options, messages)


def test_warn_graphs_must_be_positive():
    import sharc

    with pytest.raises(ValueError, match="warn_graphs must be an int >= 1 or None"):
        sharc.CompileConfig(warn_graphs=0)
