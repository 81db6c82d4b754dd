"""The group's collective costs the scheduler reads: measured once per
group by the runtime's probe, or taken from what an earlier process of the
same job measured (cost_store.py), and in either case the same on every
rank.

The ranks must schedule from the very same numbers, or they bucket and
prefetch differently and issue different collectives. The probe agrees
by itself (each size's slowest rank). A file read from disk does not: one
rank may have one and another none, or files of different runs (a cache
directory per rank). So at the group's first compile, which every rank
runs, the ranks exchange (one all-gather) their host and what their file
holds, and take the file's costs only when every rank has the same ones,
recorded under the same placement of ranks on hosts; else all measure.
Either way every rank then writes the agreed costs, so the next process
of the job agrees from its files at once.
"""

from __future__ import annotations

import hashlib
import socket

import torch
import torch.distributed as dist
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

from sharc._compile import cost_store

_AGREED: dict[str, list[float]] = {}  # group name -> its four costs
_COSTS = 4  # all-gather latency and us per byte, then reduce-scatter's


def agreed_collective_costs(group_name: str, runtime, device: torch.device) -> list[float]:
    """The group's four collective costs (Runtime.collective_costs' order).
    Collective at the group's first call, which every rank makes (its first
    compile); later calls, a recompile on some ranks too, find them here."""
    if group_name not in _AGREED:
        with unset_fake_temporarily(), no_python_dispatcher():  # real collectives
            _AGREED[group_name] = _agree(group_name, runtime, device)
    return _AGREED[group_name]


def known_collective_costs(group_name: str) -> list[float] | None:
    """The group's costs when already agreed; None before (no collective)."""
    return _AGREED.get(group_name)


def _agree(group_name: str, runtime, device: torch.device) -> list[float]:
    group = (torch._C._distributed_c10d._resolve_process_group(group_name)
             if dist.is_initialized() else None)
    facts = _facts(group, device)
    stored = cost_store.load("collective", facts)
    ranks = _exchange(group, device, stored)
    layout = _layout([host for host, _, _ in ranks])
    costs = _common_costs(ranks, layout)
    if costs is None:
        costs = _probe(runtime)
    cost_store.store("collective", facts, {"layout": layout, "costs": costs})
    return costs


def _probe(runtime) -> list[float]:
    """The runtime's probe: collective, every rank gets the same numbers."""
    return list(runtime.collective_costs())


def _common_costs(ranks, layout: list[int]) -> list[float] | None:
    """The costs every rank's file holds, when all hold the same ones,
    recorded under this placement of ranks on hosts; else None."""
    files = {(recorded_under == _digest(str(layout)), costs) for _, recorded_under, costs in ranks}
    if len(files) != 1:
        return None
    same_layout, costs = files.pop()
    return list(costs) if same_layout and costs is not None else None


def _facts(group, device: torch.device) -> dict:
    """What the group's costs depend on besides the environment: its size,
    backend and the device the probe times on."""
    world = dist.get_world_size(group) if group is not None else 1
    backend = str(dist.get_backend(group)) if group is not None else "none"
    return {"world_size": world, "backend": backend, "device": device.type}


def _exchange(group, device: torch.device, stored: dict | None):
    """Every rank's (host digest, digest of the layout its file was recorded
    under, its file's costs or None), by rank: all a rank decides from, so
    every rank decides alike."""
    mine = torch.full((3 + _COSTS,), float("nan"), dtype=torch.float64)
    mine[0] = _digest(socket.gethostname())
    costs = _valid_costs(stored)
    if costs is not None:
        mine[1] = _digest(str(stored.get("layout")))
        mine[2] = 1.0
        mine[3:] = torch.tensor(costs, dtype=torch.float64)
    if group is None:
        gathered = [mine]
    else:
        on = device if device.type == "cuda" else torch.device("cpu")
        gathered = [torch.empty_like(mine, device=on) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine.to(on), group=group)
    rows = [t.cpu().tolist() for t in gathered]
    return [(row[0], row[1], tuple(row[3:]) if row[2] == 1.0 else None) for row in rows]


def _valid_costs(stored: dict | None) -> list[float] | None:
    costs = stored.get("costs") if isinstance(stored, dict) else None
    if (isinstance(costs, list) and len(costs) == _COSTS and
            all(isinstance(c, float | int) and not isinstance(c, bool) for c in costs)):
        return [float(c) for c in costs]
    return None


def _layout(hosts: list[float]) -> list[int]:
    """Which ranks share a host, by each rank's first rank on its host:
    [0, 0, 2, 2] is two hosts of two ranks each."""
    return [hosts.index(h) for h in hosts]


def _digest(text: str) -> float:
    """`text` as a number a float64 holds exactly (48 bits)."""
    digest = hashlib.blake2b(text.encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "little"))
