"""The exit path of a sharded job, run as a program by test_lifetime.py:
two local ranks shard a model, train 5 steps (eager, then compiled when
asked), destroy the process group through the launcher, and exit."""

import sys

import torch
import torch.nn as nn


def body(compiled: bool) -> None:
    import sharc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    sharc.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(model, backend="sharc") if compiled else model
    for _ in range(5):
        step(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    from sharc.launch import launch

    launch(body, 2, args=(sys.argv[1:] == ["compiled"],))
