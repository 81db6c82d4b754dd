"""Hybrid sharding's process groups: this rank's shard group and replicate
group, from a 2-D DeviceMesh or from ShardConfig.replicate_groups.

Parameters are sharded over the shard group (the runtime's own group);
after each reduce-scatter there, the shard gradients are summed over the
replicate group (the ranks holding the same shards, one per host). See
docs/design/hybrid-sharding.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from sharc import _validate

MESH_DIMS = ("replicate", "shard")
_HOW = ("build it with torch.distributed.device_mesh.init_device_mesh(device_type, "
        "(hosts, ranks_per_host), mesh_dim_names=('replicate', 'shard'))")


@dataclass(frozen=True)
class Groups:
    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None  # None: flat sharding


def resolve(group, mesh, config) -> Groups:
    """The groups shard() uses, from its `group` and `mesh` arguments and
    the config, every combination checked."""
    if mesh is not None:
        if group is not None:
            raise ValueError("sharc.shard(): pass group= or mesh=, not both (the mesh's "
                             "'shard' dimension is the group parameters are sharded over)")
        if config.replicate_groups is not None:
            raise ValueError("sharc.shard(): pass mesh= or ShardConfig.replicate_groups, not "
                             "both; they say the same thing")
        _validate.check_group(None)  # torch.distributed is set up
        return _from_mesh(mesh)
    if config.replicate_groups is not None:
        return _from_rank_groups(group, config.replicate_groups)
    return Groups(_validate.check_group(group), None)


def shard_group_of(group_or_mesh, who: str) -> dist.ProcessGroup:
    """A process group, or a hybrid mesh's shard group (where sharc's figures
    and clipping live); None: the world."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group_or_mesh, DeviceMesh):
        return _from_mesh(group_or_mesh).shard
    return _validate.check_group(group_or_mesh, who)


def _from_mesh(mesh) -> Groups:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError("sharc.shard(): mesh must be a torch.distributed.device_mesh.DeviceMesh "
                        f"with dims ('replicate', 'shard'), got {type(mesh).__name__}; {_HOW}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2:
        raise ValueError(f"sharc.shard(): mesh must be 2-D with dims ('replicate', 'shard'), "
                         f"got a {mesh.ndim}-D mesh {names or ''}; for flat sharding pass "
                         f"group= (or nothing) instead of a mesh, or {_HOW}")
    if names != MESH_DIMS:
        raise ValueError("sharc.shard(): the mesh's dims must be named ('replicate', 'shard') "
                         f"in that order (replicas across hosts, shards within a host), got "
                         f"{names or 'no names'}; {_HOW}")
    return Groups(mesh.get_group("shard"), mesh.get_group("replicate"))


_BY_RANK_GROUPS: dict[tuple, Groups] = {}  # one pair of groups per layout, reused


def _from_rank_groups(group, groups: tuple[tuple[int, ...], ...]) -> Groups:
    group = _validate.check_group(group)
    world = dist.get_world_size()
    if dist.get_world_size(group) != world:
        raise ValueError("sharc.shard(): ShardConfig.replicate_groups names global ranks and "
                         "covers the world; leave group= unset (the world) with it")
    ranks = sorted(r for g in groups for r in g)
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        extra = sorted(set(ranks) - set(range(world)))
        what = f"misses ranks {missing}" if missing else f"names ranks {extra} beyond the world"
        raise ValueError(f"ShardConfig.replicate_groups {what}: the world has ranks "
                         f"0..{world - 1}, and every one must be in exactly one replicate group")
    key = (groups, id(dist.group.WORLD))
    if key not in _BY_RANK_GROUPS:
        me = dist.get_rank()
        shard_groups = [tuple(g[i] for g in groups) for i in range(len(groups[0]))]
        replicate = shard = None
        for g in groups:  # every rank creates every group, in the same order
            pg = dist.new_group(list(g))
            replicate = pg if me in g else replicate
        for g in shard_groups:
            pg = dist.new_group(list(g))
            shard = pg if me in g else shard
        # See [Note: a group's last handshake] (sharc/_rank_check.py).
        for pg in (replicate, shard):
            dist.barrier(group=pg)
        _BY_RANK_GROUPS[key] = Groups(shard, replicate)
    return _BY_RANK_GROUPS[key]


def attach(runtime, replicate: dist.ProcessGroup | None) -> None:
    """Makes the shard group's runtime all-reduce over `replicate` (once)."""
    if replicate is None or dist.get_world_size(replicate) == 1:
        if runtime.replicate_size() > 1:
            raise ValueError("sharc.shard(): this group is hybrid-sharded already (a model was "
                             "sharded on it with a replicate dimension); shard every model on "
                             "it with the same mesh")
        return
    if runtime.replicate_size() == 1:
        runtime.set_replicate_group(replicate.group_name)
