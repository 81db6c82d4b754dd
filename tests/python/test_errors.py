"""Bad input gives a clear error naming what was wrong; none hangs (every
multi-rank case runs under the harness timeout)."""

import pytest
import torch

from dist_harness import run_ranks


def test_shard_without_process_group():
    import sharc

    with pytest.raises(RuntimeError, match="init_process_group"):
        sharc.shard(torch.nn.Linear(2, 2))


def _twice_device_and_complex(rank, world):
    import sharc

    errors = {}
    lin = torch.nn.Linear(3, 3)
    sharc.shard(lin)
    try:
        sharc.shard(lin)
    except RuntimeError as e:
        errors["twice"] = str(e)
    parent = torch.nn.Sequential(lin)
    try:
        sharc.shard(parent)
    except RuntimeError as e:
        errors["parent_of_sharded"] = str(e)
    try:  # a meta model's shards on a device gloo cannot communicate
        sharc.shard(torch.nn.Linear(3, 3, device="meta"),
                    config=sharc.ShardConfig(device="xpu"))
    except RuntimeError as e:
        errors["device"] = str(e)
    filt = torch.nn.Module()  # a learnable FFT filter
    filt.freq = torch.nn.Parameter(torch.ones(4, dtype=torch.cfloat))
    try:
        sharc.shard(filt)
    except TypeError as e:
        errors["complex"] = str(e)
    return errors


def test_shard_twice_wrong_device_and_a_complex_parameter():
    for errors in run_ranks(_twice_device_and_complex, 2):
        assert "already called" in errors["twice"]
        assert "already called" in errors["parent_of_sharded"]
        assert errors["device"] == (
            "ShardConfig.device is 'xpu', but the process group's backend 'gloo' "
            "communicates only ['cpu', 'cuda'] tensors: name a matching device or leave it None")
        assert "parameter 'freq' is complex (torch.complex64)" in errors["complex"]
        assert "torch.view_as_complex" in errors["complex"]


class _KeepsReferences(torch.nn.Module):
    """A weight kept apart from its module in a plain container (`where`:
    on the root, nested in a submodule's dict, or a module reference,
    which is fine), beside a recurrent layer (whose own weight list sharc
    refills itself) that must not be refused."""

    def __init__(self, where):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.rnn = torch.nn.GRU(4, 4)
        self.b = torch.nn.Linear(4, 4)
        if where == "list":
            self.ext = [self.a.weight]
        elif where == "nested":
            self.b.cache = {"tied": (self.a.weight, 1.0)}
        elif where == "module":
            self.ext = [self.a]

    def forward(self, x):
        h, _ = self.rnn(self.a(x))
        other = self.ext[0] if hasattr(self, "ext") else self.a.weight
        weight = other.weight if isinstance(other, torch.nn.Module) else other
        return self.b(h) + torch.nn.functional.linear(x, weight)


def _gradient_hooks_and_kept_references(rank, world):
    import sharc

    outcomes = {}

    def attempt(name, model):
        before = dict(model.named_parameters())
        try:
            sharc.shard(model)
            error = None
        except RuntimeError as e:
            error = str(e)
        # Refused before anything changed: the same Parameters, nothing sharded.
        untouched = all(p is before[n] and type(p) is torch.nn.Parameter
                        for n, p in model.named_parameters())
        outcomes[name] = (error, untouched)

    clamp = lambda g: g.clamp(-0.01, 0.01)  # noqa: E731
    hooked = torch.nn.Sequential(torch.nn.Linear(4, 3))
    handle = hooked[0].weight.register_hook(clamp)
    attempt("register_hook", hooked)
    handle.remove()
    attempt("hook_removed", hooked)  # shards once the hook is gone
    later = torch.nn.Sequential(torch.nn.Linear(4, 3))
    later[0].bias.register_post_accumulate_grad_hook(lambda p: p.grad.zero_())
    attempt("post_accumulate", later)
    for where in ("list", "nested", "module"):
        torch.manual_seed(0)
        model = _KeepsReferences(where)
        attempt(where, model)
    model(torch.ones(2, 4)).sum().backward()  # through the module reference: the shard's
    outcomes["reference_trains"] = dict(model.named_parameters())["a.weight"].grad is not None
    return outcomes


def test_gradient_hooks_and_parameters_kept_apart_are_refused_by_shard():
    """Both would be silently lost when shard() swaps the parameters for
    their shards: a hook on the old Parameter never runs, a container
    keeping it makes forward train the old full Parameter apart on each
    rank. Refused before the model changes, naming the parameter."""
    for outcomes in run_ranks(_gradient_hooks_and_kept_references, 2, timeout=120):
        error, untouched = outcomes["register_hook"]
        assert error.startswith("sharc: parameter '0.weight' has gradient hooks "
                                "(register_hook), registered before sharc.shard()"), error
        assert "model.named_parameters()" in error
        assert "this rank's flat shard of the averaged gradient" in error
        assert untouched
        assert outcomes["hook_removed"] == (None, False)  # sharded now
        error, untouched = outcomes["post_accumulate"]
        assert "parameter '0.bias' has gradient hooks (register_post_accumulate_grad_hook)" \
            in error, error
        assert untouched
        error, untouched = outcomes["list"]
        assert error.startswith("sharc: the root module (_KeepsReferences) keeps the "
                                "parameter 'a.weight' in its attribute 'ext' (a list)"), error
        assert "Keep a reference to the module instead" in error
        assert untouched
        error, untouched = outcomes["nested"]
        assert error.startswith("sharc: module 'b' (Linear) keeps the parameter 'a.weight' "
                                "in its attribute 'cache' (a dict)"), error
        assert untouched
        assert outcomes["module"] == (None, False)  # a module reference, and the GRU: fine
        assert outcomes["reference_trains"]


def _mismatched(rank, world):
    import sharc

    torch.manual_seed(0)
    cases = {
        "shape": torch.nn.Linear(4, 3 if rank == 0 else 5),
        "dtype": torch.nn.Linear(4, 3, dtype=torch.float32 if rank == 0 else torch.float64),
        "count": torch.nn.Linear(4, 3, bias=(rank == 0)),
        "values": torch.nn.Linear(4, 3),  # the seed is not reset: values differ
    }
    errors = {}
    for name, module in cases.items():
        if name == "values":
            torch.manual_seed(rank)
            module = torch.nn.Linear(4, 3)
        try:
            sharc.shard(module)
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    return errors


def test_parameters_that_differ_across_ranks():
    for errors in run_ranks(_mismatched, 2, timeout=120):
        assert "shape (3, 4) on rank 0 but (5, 4) on rank 1" in errors["shape"]
        assert "dtype torch.float32 on rank 0 but torch.float64 on rank 1" in errors["dtype"]
        assert "rank 0 has 2 parameters, rank 1 has 1" in errors["count"]
        assert "different values" in errors["values"] and "seed" in errors["values"]


def _bad_state_dict(rank, world):
    import sharc

    lin = torch.nn.Linear(3, 2)
    sharc.shard(lin)
    errors = []
    for sd in ({"weight": torch.zeros(2, 3)},
               {"weight": torch.zeros(3, 3), "bias": torch.zeros(2)}):
        try:
            sharc.load_full_state_dict(lin, sd)
        except (KeyError, ValueError) as e:
            errors.append(str(e))
    return errors


def test_bad_full_state_dict():
    for errors in run_ranks(_bad_state_dict, 2):
        assert "missing keys ['bias']" in errors[0]
        assert "'weight' has shape (3, 3), the module expects (2, 3)" in errors[1]



def _regroup(rank, world, init_file):
    import torch.distributed as dist

    import sharc

    old = torch.nn.Linear(3, 3)
    sharc.shard(old)
    name = dist.group.WORLD.group_name
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    new = torch.nn.Linear(3, 3)
    sharc.shard(new)
    works = new(torch.ones(1, 3)).sum().item()
    try:
        old(torch.ones(1, 3))
        stale = None
    except RuntimeError as e:
        stale = str(e)
    torch.nn.utils.vector_to_parameters(  # replaces each shard's .data
        torch.nn.utils.parameters_to_vector(new.parameters()).clone(), new.parameters())
    try:
        new(torch.ones(1, 3))
        replaced = None
    except RuntimeError as e:
        replaced = str(e)
    return dist.group.WORLD.group_name == name, works, stale, replaced


def test_module_sharded_on_a_destroyed_group_or_with_its_data_replaced(tmp_path):
    # The new default group takes the old one's name: sharc must bind a fresh
    # runtime to it, and the old module must fail clearly instead of gathering
    # another parameter or talking through a destroyed group.
    for same_name, works, stale, replaced in run_ranks(_regroup, 2, str(tmp_path / "again")):
        assert same_name
        assert isinstance(works, float)
        assert stale is not None and "destroyed" in stale
        # The same message names the other cause, a shard whose .data was
        # replaced, with the in-place fix.
        assert replaced is not None and "vector_to_parameters" in replaced, replaced
        assert "p.copy_(t)" in replaced, replaced


def _reduction_tokens(rank, world):
    import sharc

    lin = torch.nn.Linear(4, 3)
    sharc.shard(lin)
    ref = next(r for r in sharc.api.sharded_root(lin).refs_by_shard.values()
               if r.fqn == "weight")  # 12 elements: no padding on 2 ranks
    ops, group, pid = torch.ops.sharc, ref.group_name, ref.pid
    grad = torch.ones(ref.shape)
    token = ops.start_reduce_scatter([grad], group, [pid])
    shard_grad = ops.wait_reduce_scatter(token, group, [pid])[0]
    errors = {}
    for name, bad in (("twice", token), ("unknown", torch.zeros(1, dtype=torch.long))):
        try:
            ops.wait_reduce_scatter(bad, group, [pid])
        except RuntimeError as e:
            errors[name] = str(e)
    return shard_grad, errors


def test_a_reduction_is_waited_on_once_by_its_token():
    for shard_grad, errors in run_ranks(_reduction_tokens, 2):
        assert torch.equal(shard_grad, torch.ones_like(shard_grad))  # the mean of ones
        for name in ("twice", "unknown"):
            assert "takes the token tensor start_reduce_scatter returned, once" in errors[name]
