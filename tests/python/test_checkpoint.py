"""Sharded checkpoints through torch.distributed.checkpoint: the layout
matches torch's own state dicts, checkpoints reshard between world sizes and
to one unsharded process bitwise, resume is exact, and an interrupted save
never damages the last good checkpoint."""

import math
import os
import random

import pytest
import torch

from dist_harness import RankFailure, run_ranks
from models import global_batch, make_optimizer, make_parity_model, rank_slice


# ---- layout: flat ranges as rectangles (no process group needed) ----------

def test_flat_range_chunks_cover_the_range_exactly_in_flat_order():
    from sharc._flat_chunks import flat_range_chunks

    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 4)))
        n = math.prod(shape)
        start = rng.randint(0, n)
        stop = rng.randint(start, n)
        full = torch.arange(n).reshape(shape)
        seen = []
        chunks = flat_range_chunks(shape, start, stop)
        for c in chunks:
            box = full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))].reshape(-1)
            assert box.tolist() == list(range(c.flat_start, c.flat_start + c.numel)), (shape, c)
            seen += box.tolist()
        assert seen == list(range(start, stop)), (shape, start, stop, chunks)
        assert len(chunks) <= max(1, 2 * len(shape) - 1)


# ---- helpers run on every rank --------------------------------------------

def _train(model, opt, rank, world, steps, first_step=0, step_fn=None):
    step_fn = model if step_fn is None else step_fn
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step, 2 * world)
        loss = step_fn(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _sharded_job():
    import sharc

    model = make_parity_model()
    sharc.shard(model)
    opt = make_optimizer(model.parameters())
    return model, opt


def _local_state(model, opt):
    """This rank's shards of parameters and optimizer state, by fqn."""
    from sharc.api import sharded_root

    root = sharded_root(model)
    params, state = {}, {}
    for ref in root.refs_by_shard.values():
        params[ref.fqn] = (ref.shape, ref.shard.detach().clone())
        st = opt.state.get(ref.shard, {})
        state[ref.fqn] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                          for k, v in st.items()}
    return params, state


def _assemble(per_rank):
    """Full tensors from every rank's (params, state) shards: concatenate,
    drop the padding, take the true shape. Scalars (step) from rank 0."""
    params0, state0 = per_rank[0]
    params, state = {}, {}
    for fqn, (shape, _) in params0.items():
        n = math.prod(shape)
        params[fqn] = torch.cat([r[0][fqn][1] for r in per_rank])[:n].view(shape)
        state[fqn] = {}
        for key, value in state0[fqn].items():
            if isinstance(value, torch.Tensor) and value.dim() == 1:
                value = torch.cat([r[1][fqn][key] for r in per_rank])[:n].view(shape)
            state[fqn][key] = value
    return params, state


def _assert_bitwise(got, want, what):
    if isinstance(want, (tuple, list)):
        got, want = dict(enumerate(got)), dict(enumerate(want))
    assert set(got) == set(want), what
    for fqn in want:
        a, b = got[fqn], want[fqn]
        if isinstance(b, (dict, tuple, list)):
            _assert_bitwise(a, b, f"{what} {fqn}")
        elif isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{what} {fqn}: {a.shape} {b.shape}"
            assert torch.equal(a, b), f"{what} {fqn} differs"
        else:
            assert a == b, f"{what} {fqn}: {a} != {b}"


# ---- layout matches torch.distributed.checkpoint.state_dict ---------------

def _layouts(rank, world):
    import sharc
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get

    plain = make_parity_model()
    plain_opt = make_optimizer(plain.parameters())
    want_m, want_o = torch_get(plain, plain_opt)
    model, opt = _sharded_job()
    got_m, got_o = sharc.get_state_dict(model, opt)

    def shapes(sd):
        return {k: tuple(v.size()) for k, v in sd.items()}

    return ((list(got_m), shapes(got_m), {k: shapes(v) for k, v in got_o["state"].items()},
             got_o["param_groups"]),
            (list(want_m), shapes(want_m), {k: shapes(v) for k, v in want_o["state"].items()},
             want_o["param_groups"]))


def test_state_dict_layout_matches_torch_get_state_dict():
    for got, want in run_ranks(_layouts, 2):
        assert got[0] == want[0]  # model keys, in order, tied names included
        assert got[1] == want[1]  # global shapes
        assert got[2] == want[2]  # optimizer state keys and shapes by fqn
        assert got[3] == want[3]  # param groups by fqn with hyperparameters


# ---- resharding: W -> W' ranks, and to one unsharded process --------------

def _save(rank, world, path, steps):
    import torch.distributed.checkpoint as dcp

    import sharc

    model, opt = _sharded_job()
    _train(model, opt, rank, world, steps)
    model_sd, optim_sd = sharc.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _local_state(model, opt)


def _load(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import sharc

    model, opt = _sharded_job()
    model_sd, optim_sd = sharc.get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    sharc.set_state_dict(model, opt, model_state_dict=state["model"],
                         optim_state_dict=state["optim"])
    return _local_state(model, opt)


@pytest.mark.parametrize("save_world,load_world", [(2, 4), (4, 2)])
def test_checkpoint_reshards_bitwise(tmp_path, save_world, load_world):
    saved = _assemble(run_ranks(_save, save_world, str(tmp_path / "ckpt"), 3))
    loaded = _assemble(run_ranks(_load, load_world, str(tmp_path / "ckpt")))
    assert saved[1]["wte.weight"]["exp_avg"].abs().sum() > 0  # real state was saved
    _assert_bitwise(loaded[0], saved[0], "params")
    _assert_bitwise(loaded[1], saved[1], "optimizer state")


def _load_unsharded(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get
    from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set

    model = make_parity_model(seed=1)  # different values: the load must overwrite them
    opt = make_optimizer(model.parameters())
    model_sd, optim_sd = torch_get(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    torch_set(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    named = dict(model.named_parameters())
    params = {fqn: p.detach().clone() for fqn, p in named.items()}
    opt_state = {fqn: {k: v.clone() for k, v in opt.state.get(p, {}).items()}
                 for fqn, p in named.items()}
    return params, opt_state


def test_checkpoint_loads_into_one_unsharded_process(tmp_path):
    saved = _assemble(run_ranks(_save, 2, str(tmp_path / "ckpt"), 3))
    [(params, opt_state)] = run_ranks(_load_unsharded, 1, str(tmp_path / "ckpt"))
    _assert_bitwise(params, saved[0], "params")
    _assert_bitwise(opt_state, saved[1], "optimizer state")


def test_dcp_to_torch_save_loads_strictly_into_the_plain_model(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = _assemble(run_ranks(_save, 4, str(tmp_path / "ckpt"), 2))
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "plain.pt"))
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    model = make_parity_model(seed=1)
    model.load_state_dict(plain["model"], strict=True)
    _assert_bitwise({k: p.detach() for k, p in model.named_parameters()}, saved[0], "params")
    _assert_bitwise(plain["optim"]["state"], {k: v for k, v in saved[1].items() if v},
                    "optimizer state")


# ---- exact resume, eager and compiled --------------------------------------

def _compiled(model, compile_):
    return torch.compile(model, backend="sharc") if compile_ else model


def _train_save_train(rank, world, path, compile_):
    import sharc

    model, opt = _sharded_job()
    step_fn = _compiled(model, compile_)
    first = _train(model, opt, rank, world, 10, step_fn=step_fn)
    sharc.save_checkpoint(path, step_fn, opt, extra={"step": 10})
    second = _train(model, opt, rank, world, 10, first_step=10, step_fn=step_fn)
    return first, second, _local_state(model, opt)


def _load_train(rank, world, path, compile_):
    import sharc

    torch.manual_seed(123)
    model = make_parity_model(seed=1)  # other initial values: the load must replace them
    sharc.shard(model)
    opt = make_optimizer(model.parameters())
    step_fn = _compiled(model, compile_)
    extra = sharc.load_checkpoint(path, step_fn, opt)
    losses = _train(model, opt, rank, world, 10, first_step=extra["step"], step_fn=step_fn)
    return losses, _local_state(model, opt)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_resume_is_exact(tmp_path, compile_):
    path = str(tmp_path / "step-10")
    straight = run_ranks(_train_save_train, 2, path, compile_, timeout=420)
    resumed = run_ranks(_load_train, 2, path, compile_, timeout=420)
    for rank, ((_, want, want_state), (got, got_state)) in enumerate(zip(straight, resumed)):
        assert len(got) == len(want) == 10
        for step, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"rank {rank} step {10 + step}: {a.item()} vs {b.item()}"
        _assert_bitwise(got_state[0], want_state[0], f"rank {rank} params")
        _assert_bitwise(got_state[1], want_state[1], f"rank {rank} optimizer state")


# ---- a save that dies half-way ---------------------------------------------

def _save_and_die(rank, world, root_dir):
    import torch.distributed.checkpoint.filesystem as fs

    import sharc

    model, opt = _sharded_job()
    _train(model, opt, rank, world, 2)
    sharc.save_checkpoint(os.path.join(root_dir, "ckpt"), model, opt, extra={"step": 2})
    good = _local_state(model, opt)
    _train(model, opt, rank, world, 2, first_step=2)
    if rank == 1:
        def die(*args, **kwargs):
            os._exit(17)  # the process dies while writing its shards
        fs.FileSystemWriter.write_data = die
    sharc.save_checkpoint(os.path.join(root_dir, "ckpt"), model, opt, extra={"step": 4})
    return good


def _load_state(rank, world, path):
    import sharc

    model, opt = _sharded_job()
    extra = sharc.load_checkpoint(path, model, opt)
    return extra, _local_state(model, opt)


def test_a_save_killed_half_way_leaves_the_last_checkpoint_loadable(tmp_path):
    with pytest.raises(RankFailure):
        run_ranks(_save_and_die, 2, str(tmp_path), timeout=90)
    assert os.path.isdir(tmp_path / "ckpt.partial")  # the dead save got that far
    good = _assemble(run_ranks(_save, 2, str(tmp_path / "reference"), 2))
    results = run_ranks(_load_state, 2, str(tmp_path / "ckpt"))
    assert [extra for extra, _ in results] == [{"step": 2}, {"step": 2}]
    loaded = _assemble([state for _, state in results])
    _assert_bitwise(loaded[0], good[0], "params")
    _assert_bitwise(loaded[1], good[1], "optimizer state")


# ---- model only, compiled wrappers, wrong architecture ---------------------

def _model_only_round_trip(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import sharc

    model, _ = _sharded_job()
    compiled = torch.compile(model, backend="sharc")
    model_sd, optim_sd = sharc.get_state_dict(compiled)  # no optimizer
    keys = list(model_sd)
    dcp.save({"model": model_sd}, checkpoint_id=path)
    want = sharc.full_state_dict(model)
    fresh = make_parity_model(seed=1)
    sharc.shard(fresh)
    state = {"model": sharc.get_state_dict(fresh)[0]}
    dcp.load(state, checkpoint_id=path)
    sharc.set_state_dict(fresh, model_state_dict=state["model"])
    return keys, optim_sd, want, sharc.full_state_dict(fresh)


def test_model_only_state_dict_of_a_compiled_module(tmp_path):
    for keys, optim_sd, want, got in run_ranks(_model_only_round_trip, 2, str(tmp_path / "m")):
        assert optim_sd == {}
        assert keys == list(make_parity_model().state_dict())  # no "_orig_mod." prefixes
        _assert_bitwise(got, want, "model")


def _load_into_other_architecture(rank, world, path):
    import sharc
    from models import ParityGPT, parity_config

    model, opt = _sharded_job()
    sharc.save_checkpoint(path, model, opt)
    cfg = parity_config()
    cfg.n_embd = 32  # same names, other shapes
    other = ParityGPT(cfg)
    sharc.shard(other)
    messages = []
    try:
        sharc.load_checkpoint(path, other, make_optimizer(other.parameters()))
    except ValueError as e:
        messages.append(str(e))
    before = sharc.full_state_dict(other)
    try:  # the same check without the helper, before anything changes
        sharc.set_state_dict(other, model_state_dict=sharc.get_state_dict(model)[0])
    except ValueError as e:
        messages.append(str(e))
    unchanged = all(torch.equal(v, before[k]) for k, v in sharc.full_state_dict(other).items())
    return messages, unchanged


def test_loading_into_another_architecture_names_the_first_mismatch(tmp_path):
    for messages, unchanged in run_ranks(_load_into_other_architecture, 2, str(tmp_path / "c")):
        assert len(messages) == 2, messages
        assert "'wte.weight' has shape (65, 24) in the checkpoint and (65, 32) in the model" \
            in messages[0], messages[0]
        assert "'wte.weight' has shape (65, 24) in the state dict but (65, 32) in the model" \
            in messages[1], messages[1]
        assert unchanged


def _grouped(model, groups: int):
    """AdamW over one group, or weights and the rest in two."""
    named = list(model.named_parameters())
    if groups == 1:
        return torch.optim.AdamW([p for _, p in named], lr=1e-3)
    split = [[p for n, p in named if n.endswith("weight")],
             [p for n, p in named if not n.endswith("weight")]]
    return torch.optim.AdamW([{"params": split[0]}, {"params": split[1], "lr": 1e-4}],
                             lr=1e-3)


def _load_into_other_groups(rank, world, path):
    """Saved with two groups, loaded by optimizers grouped otherwise (after a
    step of their own, so they hold state a half load would change)."""
    import sharc
    from models import make_parity_model

    model = make_parity_model()
    sharc.shard(model)
    opt = _grouped(model, 2)
    _train(model, opt, rank, world, 1)
    sharc.save_checkpoint(path, model, opt)
    outcomes = []
    for make in (lambda m: _grouped(m, 1),  # fewer groups
                 lambda m: torch.optim.AdamW(  # two groups, the names regrouped
                     [{"params": list(m.parameters())[:3]},
                      {"params": list(m.parameters())[3:]}], lr=1e-3)):
        other = make_parity_model()
        sharc.shard(other)
        other_opt = make(other)
        _train(other, other_opt, rank, world, 1, first_step=3)
        before = sharc.full_state_dict(other)
        moments = [s["exp_avg"].clone() for s in other_opt.state.values()]
        try:
            sharc.load_checkpoint(path, other, other_opt)
            message = None
        except ValueError as e:
            message = str(e)
        unchanged = (all(torch.equal(v, before[k])
                         for k, v in sharc.full_state_dict(other).items())
                     and all(torch.equal(s["exp_avg"], m)
                             for s, m in zip(other_opt.state.values(), moments)))
        outcomes.append((message, unchanged))
    fresh = make_parity_model()  # an optimizer that never stepped, refused likewise
    sharc.shard(fresh)
    fresh_opt = _grouped(fresh, 1)
    try:
        sharc.load_checkpoint(path, fresh, fresh_opt)
        outcomes.append((None, None))
    except ValueError as e:
        outcomes.append((str(e), len(fresh_opt.state)))  # no state left behind
    sharc.save_checkpoint(path + "_model_only", model)
    try:
        sharc.load_checkpoint(path + "_model_only", model, opt)
        outcomes.append(None)
    except ValueError as e:
        outcomes.append(str(e))
    return outcomes


def test_loading_into_an_optimizer_grouped_otherwise_changes_nothing(tmp_path):
    """Fewer groups, the same count regrouped, and a checkpoint saved
    without an optimizer: each refused by name before anything is read. An
    optimizer that never stepped is left without state, as it was."""
    for (fewer, fewer_kept), (regrouped, regrouped_kept), (fresh, fresh_state), model_only \
            in run_ranks(_load_into_other_groups, 2, str(tmp_path / "c")):
        assert model_only is not None and "load it with optimizer=None" in model_only
        assert fewer is not None and "it holds 2 param groups, the optimizer 1" in fewer, fewer
        assert regrouped is not None and "its param group 0 holds" in regrouped, regrouped
        assert "first differing at position" in regrouped, regrouped
        assert fewer_kept and regrouped_kept
        assert fresh is not None and "it holds 2 param groups, the optimizer 1" in fresh, fresh
        assert fresh_state == 0, f"a refused load left state for {fresh_state} parameters"


# ---- ranks that own nothing, N-D parameters --------------------------------

class _Odd(torch.nn.Module):
    """A 3-element vector (a rank of 4 owns none of it), a 3-D tensor whose
    shards cut across rows and planes, and a 1x1 matrix."""

    def __init__(self):
        super().__init__()
        self.vec = torch.nn.Parameter(torch.randn(3))
        self.cube = torch.nn.Parameter(torch.randn(2, 3, 5))
        self.one = torch.nn.Parameter(torch.randn(1, 1))


def _save_odd(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import sharc

    torch.manual_seed(5)
    model = _Odd()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    sharc.shard(model)
    dcp.save({"model": sharc.get_state_dict(model)[0]}, checkpoint_id=path)
    return want


def _load_odd(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import sharc

    torch.manual_seed(6)  # other values: the load must replace them
    model = _Odd()
    sharc.shard(model)
    state = {"model": sharc.get_state_dict(model)[0]}
    dcp.load(state, checkpoint_id=path)
    sharc.set_state_dict(model, model_state_dict=state["model"])
    return sharc.full_state_dict(model)


def test_parameters_some_ranks_own_nothing_of_reshard(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    want = run_ranks(_save_odd, 4, str(tmp_path / "c"))[0]
    for got in run_ranks(_load_odd, 3, str(tmp_path / "c")):
        _assert_bitwise(got, want, "3 ranks")
    dcp_to_torch_save(str(tmp_path / "c"), str(tmp_path / "plain.pt"))
    _assert_bitwise(torch.load(tmp_path / "plain.pt")["model"], want, "torch.save")


# ---- no gather: local shards are views of the real shards -------------------

def _views_and_traffic(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import sharc
    from sharc.api import sharded_root

    model, opt = _sharded_job()
    _train(model, opt, rank, world, 1)
    sharc.reset_memory_stats()
    model_sd, optim_sd = sharc.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    stats = sharc.memory_stats()
    root = sharded_root(model)
    aliased = []
    for ref in root.refs_by_shard.values():
        if not ref.shape:
            continue  # 0-dim: a replicated scalar, see docs/design/checkpoints.md
        pairs = [(model_sd[ref.fqn], ref.shard)]
        if ref.fqn in optim_sd["state"]:
            pairs.append((optim_sd["state"][ref.fqn]["exp_avg"], opt.state[ref.shard]["exp_avg"]))
        for value, owner in pairs:
            lo = owner.data_ptr()
            hi = lo + owner.numel() * owner.element_size()
            views = [s.tensor for s in value.local_shards() if s.tensor.numel()]
            aliased.append(all(lo <= t.data_ptr() < hi for t in views))
    return stats["allgather_calls"], stats["peak_gathered_bytes"], aliased


def test_saving_gathers_nothing_and_writes_from_the_shards(tmp_path):
    for gathers, peak, aliased in run_ranks(_views_and_traffic, 2, str(tmp_path / "c")):
        assert gathers == 0 and peak == 0
        assert aliased and all(aliased)


# ---- publishing by rename (no process group needed) -------------------------

def test_publish_replaces_a_checkpoint_and_a_lost_one_falls_back(tmp_path):
    from sharc.checkpoint.directory import _existing, _publish

    path = str(tmp_path / "ckpt")
    for version in ("old", "new"):
        os.makedirs(path + ".partial")
        open(os.path.join(path + ".partial", "v"), "w").write(version)
        _publish(path + ".partial", path)
    assert open(os.path.join(path, "v")).read() == "new"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    # A crash between the two renames leaves only ckpt.previous: loads use it.
    os.rename(path, path + ".previous")
    with pytest.warns(UserWarning, match="ckpt is missing; loading .*ckpt.previous"):
        assert _existing(path) == path + ".previous"
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        _existing(str(tmp_path / "other"))


# ---- files swapped, truncated or changed after the save ------------------------

def _save_for_tamper(rank, world, path):
    import sharc

    model, opt = _sharded_job()
    _train(model, opt, rank, world, 1)
    sharc.save_checkpoint(path, model, opt)


def _load_tampered(rank, world, path):
    import sharc

    model, opt = _sharded_job()
    before = _local_state(model, opt)
    try:
        sharc.load_checkpoint(path, model, opt)
        message = "loaded"
    except ValueError as e:
        message = str(e)
    after = _local_state(model, opt)
    untouched = all(torch.equal(before[0][k][1], after[0][k][1]) for k in before[0])
    return message, untouched


@pytest.mark.parametrize("tamper", ["swap ranks", "truncate", "flip a byte", "none"])
def test_a_checkpoint_file_changed_since_the_save_is_named_and_nothing_loads(tmp_path, tamper):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_for_tamper, 2, path)
    first, second = (os.path.join(path, f"__{r}_0.distcp") for r in range(2))
    if tamper == "swap ranks":  # the classic mix: each rank's file under the other's name
        os.rename(first, first + ".tmp")
        os.rename(second, first)
        os.rename(first + ".tmp", second)
    elif tamper == "truncate":
        with open(second, "r+b") as f:
            f.truncate(os.path.getsize(second) // 2)
    elif tamper == "flip a byte":
        with open(first, "r+b") as f:
            f.seek(os.path.getsize(first) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    for message, untouched in run_ranks(_load_tampered, 2, path):
        if tamper == "none":
            assert message == "loaded"
            continue
        assert message.startswith(f"checkpoint {path} is not the one saved: "), message
        assert "nothing was loaded" in message
        named = {"swap ranks": ["'__0_0.distcp'", "'__1_0.distcp'"],
                 "truncate": ["'__1_0.distcp'"], "flip a byte": ["'__0_0.distcp'"]}[tamper]
        assert all(n in message for n in named), message
        assert untouched


# ---- extra that JSON cannot hold ---------------------------------------------

def _save_with_a_tensor_in_extra(rank, world, path):
    import torch.distributed as dist

    import sharc

    model, opt = _sharded_job()
    _train(model, opt, rank, world, 1)
    sharc.save_checkpoint(path, model, opt, extra={"step": 1})
    try:
        sharc.save_checkpoint(path, model, opt, extra={"step": 2, "rng": torch.get_rng_state()})
        raised = None
    except TypeError as e:
        raised = str(e)
    dist.barrier()  # a rank that returned as if saved would pair this with a save's own
    return raised, sharc.load_checkpoint(path, model, opt)


def test_an_extra_json_cannot_hold_is_refused_on_every_rank_before_saving(tmp_path):
    """extra={"rng": torch.get_rng_state()}: before, rank 0 alone raised, in
    its json.dump after every rank had saved its shards, while the others
    returned as if saved (and their next collective met rank 0's next one).
    Now every rank raises first, naming the key, and the last checkpoint
    stands."""
    path = str(tmp_path / "ckpt")
    for raised, extra in run_ranks(_save_with_a_tensor_in_extra, 2, path, timeout=60):
        assert raised is not None, "save_checkpoint returned on this rank as if saved"
        assert "extra['rng'] (Tensor) is not" in raised, raised
        assert ".item() or .tolist()" in raised, raised
        assert extra == {"step": 1}


# ---- full state dicts: gathered, on every rank or rank 0 only -------------

def _full_state(rank, world):
    import sharc

    model, opt = _sharded_job()
    _train(model, opt, rank, world, 2)
    full_m, full_o = sharc.get_state_dict(model, opt, full=True)
    on_rank0 = sharc.get_state_dict(model, opt, full=True, rank0_only=True, cpu_offload=True)
    assembled = _local_state(model, opt)
    # A fresh job loads the full dicts and trains on from there: the second
    # step's loss depends on the optimizer state loaded.
    model2, opt2 = _sharded_job()
    sharc.set_state_dict(model2, opt2, model_state_dict=full_m, optim_state_dict=full_o)
    resumed = _train(model2, opt2, rank, world, 2, first_step=2)
    mismatches = {}
    for case, kwargs in (("rank0_only", dict(full=True, rank0_only=rank == 0)),
                         ("full", dict(full=rank == 0))):
        try:
            sharc.get_state_dict(model, opt, **kwargs)
            mismatches[case] = None
        except RuntimeError as e:
            mismatches[case] = str(e)
    step_before = full_o["state"]["lm_head.bias"]["step"].clone()
    _train(model, opt, rank, world, 1, first_step=2)  # the dict is a snapshot
    return (full_m, full_o, on_rank0, assembled, resumed, mismatches,
            bool(torch.equal(full_o["state"]["lm_head.bias"]["step"], step_before)))


def _plain_run(full_m, full_o):
    """One process: the plain model loads the full dicts through torch's
    set_state_dict and trains steps 2 and 3 on the whole batch."""
    from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set

    plain = make_parity_model()
    plain_opt = make_optimizer(plain.parameters())
    torch_set(plain, plain_opt, model_state_dict=full_m, optim_state_dict=full_o)
    losses = []
    for step in (2, 3):
        x, y = global_batch(step, 4)
        loss = plain(x, y)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        losses.append(loss.detach())
    return losses


def test_full_state_dict_is_torchs_unsharded_one_and_loads_into_sharc_and_torch():
    results = run_ranks(_full_state, 2)
    per_rank = [r[3] for r in results]
    params, state = _assemble(per_rank)
    state = {fqn: st for fqn, st in state.items() if st}  # frozen: no state, as in torch's
    for rank, (full_m, full_o, on_rank0, _, _, mismatches, snapshot) in enumerate(results):
        _assert_bitwise({k: full_m[k] for k in params}, params, "model")
        _assert_bitwise(full_o["state"], state, "optimizer")
        assert list(full_m) == list(make_parity_model().state_dict())  # keys and order
        if rank == 0:
            _assert_bitwise(on_rank0[0], full_m, "rank 0 model")
            _assert_bitwise(on_rank0[1]["state"], full_o["state"], "rank 0 optimizer")
        else:
            assert on_rank0 == ({}, {})
        for case, message in mismatches.items():
            assert message is not None and "ranks disagree" in message, case
        assert snapshot
    # Resumed from the full dicts, the ranks' losses of steps 2 and 3 (the
    # second after a step with the loaded optimizer state) average to the
    # plain model's after it loaded the same dicts through torch.
    want = _plain_run(results[0][0], results[0][1])
    for step in (0, 1):
        got = (results[0][4][step] + results[1][4][step]) / 2
        torch.testing.assert_close(got, want[step], rtol=1e-5, atol=1e-6)
