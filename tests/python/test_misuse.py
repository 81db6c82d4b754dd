"""Misuse gets a clear error, never a segfault, a hang or a silent no-op.

Each case asserts the exact error type and a fragment of its message. Cases
in one process run under an alarm; multi-rank cases run in one job per
test under the harness timeout (a hang fails, it never stalls the suite).
More cases: test_errors.py (shard), test_launch.py (failing ranks).
"""

import math
import re
import signal
import threading

import pytest
import torch

from dist_harness import run_ranks

ALARM_S = 60


@pytest.fixture(autouse=True)
def _alarm():
    def fail(signum, frame):
        raise TimeoutError(f"a misuse case ran longer than {ALARM_S}s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(ALARM_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ------------------------------------------------ no process group at all


@pytest.mark.parametrize("call, who", [
    (lambda sharc: sharc.shard(torch.nn.Linear(2, 2)), "sharc"),
    (lambda sharc: sharc.memory_stats(), "sharc"),
    (lambda sharc: sharc.reset_memory_stats(), "sharc"),
    (lambda sharc: sharc.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0),
     "sharc.clip_grad_norm_()"),
])
def test_needs_a_process_group(call, who):
    import sharc

    with pytest.raises(RuntimeError,
                       match="^" + re.escape(f"{who} needs an initialized torch.distributed "
                                             "process group: call torch.distributed."
                                             "init_process_group(...) first")):
        call(sharc)


# ------------------------------------------------------------ launcher


@pytest.mark.parametrize("nproc", [0, -1, 1.5, True, "2"])
def test_launch_bad_nproc(nproc):
    from sharc.launch import launch

    with pytest.raises(ValueError, match=r"--nproc must be an int of at least 1, got"):
        launch(print, nproc)


@pytest.mark.parametrize("timeout", [0, -3, "5", False])
def test_launch_bad_timeout(timeout):
    from sharc.launch import launch

    with pytest.raises(ValueError, match=r"launch\(timeout=...\) must be a positive number"):
        launch(print, 1, timeout=timeout)


@pytest.mark.parametrize("grace", [0, -1.0, "10", True])
def test_launch_bad_handling_grace(grace):
    from sharc.launch import launch

    with pytest.raises(ValueError, match=r"launch\(handling_grace_s=...\) must be a positive "
                                         r"number of seconds or None"):
        launch(print, 1, handling_grace_s=grace)


def test_launch_fn_that_cannot_reach_the_ranks():
    from sharc.launch import launch

    with pytest.raises(TypeError, match=r"fn must be callable, got int"):
        launch(3, 2)
    with pytest.raises(TypeError, match=r"fn and args must be picklable to start local ranks "
                                        r"\(.*\); define fn at the top level of a module"):
        launch(lambda: None, 2)
    with pytest.raises(TypeError, match=r"must be picklable"):
        launch(print, 2, args=(threading.Lock(),))


# --------------------------------------------------------------- configs

SHARD_CONFIG_CASES = [
    (dict(verify_replicas="yes"), TypeError, "ShardConfig.verify_replicas must be a bool"),
    (dict(verify_replicas=1), TypeError, "ShardConfig.verify_replicas must be a bool"),
    (dict(verify_schedule="on"), TypeError, "ShardConfig.verify_schedule must be a bool"),
    (dict(eager_prefetch=1), TypeError, "ShardConfig.eager_prefetch must be a bool"),
    (dict(eager_reduce_bucket_bytes=-1), ValueError,
     "ShardConfig.eager_reduce_bucket_bytes must be a whole number of bytes >= 0"),
    (dict(eager_reduce_bucket_bytes=1.5), ValueError,
     "ShardConfig.eager_reduce_bucket_bytes must be a whole number of bytes >= 0"),
    (dict(unit_keep_bytes=-1), ValueError,
     "ShardConfig.unit_keep_bytes must be a whole number of bytes >= 0"),
    (dict(unit_keep_bytes=True), ValueError,
     "ShardConfig.unit_keep_bytes must be a whole number of bytes >= 0"),
    (dict(rank_check_timeout_s=0), ValueError, "rank_check_timeout_s must be a number of seconds > 0"),
    (dict(keep_gathered="fc.weight"), TypeError, "got the string 'fc.weight': write"),
    (dict(keep_gathered=5), TypeError, "keep_gathered must be a tuple of parameter names"),
    (dict(keep_gathered=("w", 3)), TypeError, "(strings), got 3 in it"),
    (dict(gather_units="moe"), TypeError, "got the string 'moe': write"),
    (dict(gather_units=("moe", None)), TypeError, "(strings), got None in it"),
    (dict(mixed_precision="bf16"), TypeError,
     "ShardConfig.mixed_precision must be a sharc.MixedPrecision"),
    (dict(shard_everything=True), TypeError, "unexpected keyword argument 'shard_everything'"),
    (dict(device=0), TypeError, "ShardConfig.device must be a torch.device, a device string"),
    (dict(device="gpu"), ValueError, "ShardConfig.device: "),
    (dict(device="meta"), ValueError, "cannot be 'meta'; leave it None or name a real device"),
    (dict(replicate_groups=5), TypeError, "replicate_groups must be a tuple of tuples of global ranks"),
    (dict(replicate_groups=(0, 2)), TypeError, "got the element 0"),
    (dict(replicate_groups=((0, 2), (1, "3"))), TypeError, "ranks are ints >= 0, got '3'"),
    (dict(replicate_groups=()), ValueError, "leave it None for flat sharding"),
    (dict(replicate_groups=((0, 2), (1,))), ValueError, "must have the same size (one rank per host)"),
    (dict(replicate_groups=((0, 2), (2, 1))), ValueError, "rank 2 is in more than one place"),
]


@pytest.mark.parametrize("fields, error, fragment", SHARD_CONFIG_CASES)
def test_shard_config_bad_fields(fields, error, fragment):
    from sharc import ShardConfig

    with pytest.raises(error, match=re.escape(fragment)):
        ShardConfig(**fields)


def test_configs_are_keyword_only():
    from sharc import CompileConfig, ShardConfig

    for cls in (ShardConfig, CompileConfig):
        with pytest.raises(TypeError, match="positional argument"):
            cls(True)


COMPILE_CONFIG_CASES = [
    (dict(inductor="no"), TypeError, "CompileConfig.inductor must be a bool"),
    (dict(gather_bucket_bytes=-1), ValueError, "gather_bucket_bytes must be an int >= 0"),
    (dict(gather_bucket_bytes=1.5), ValueError, "gather_bucket_bytes must be an int >= 0"),
    (dict(gather_bucket_bytes=True), ValueError, "gather_bucket_bytes must be an int >= 0"),
    (dict(reduce_bucket_bytes="4MiB"), ValueError, "reduce_bucket_bytes must be an int >= 0"),
    (dict(disable_passes="bucket_allgathers"), TypeError,
     "got the string 'bucket_allgathers': write"),
    (dict(disable_passes=3), TypeError, "disable_passes must be a tuple of pass names"),
    (dict(disable_passes=(None,)), TypeError, "got None in it"),
    (dict(disable_passes=("nope",)), ValueError, "unknown pass 'nope'; the passes are "),
    (dict(dump_ir=5), TypeError, "CompileConfig.dump_ir must be a directory path"),
    (dict(memory_budget_bytes=-5), ValueError, "memory_budget_bytes must be an int >= 0"),
    (dict(memory_budget_bytes="1GB"), ValueError, "memory_budget_bytes must be an int >= 0"),
    (dict(profile="yes"), TypeError, "CompileConfig.profile must be a bool"),
    (dict(memory_budget_rule="half"), ValueError,
     "CompileConfig.memory_budget_rule must be 'auto', 'free_memory' "),
    (dict(warn_graphs=0), ValueError, "CompileConfig.warn_graphs must be an int >= 1 or None, got 0"),
    (dict(warn_graphs=True), ValueError,
     "CompileConfig.warn_graphs must be an int >= 1 or None, got True"),
    (dict(pipeline=5), TypeError, "CompileConfig.pipeline must be a str, got 5"),
    (dict(pipeline="nope"), ValueError, "CompileConfig.pipeline: sharc pipeline: no pass named 'nope'"),
    (dict(pipeline="bucket_allgathers{bytes=x}"), ValueError, "bytes=x of pass 'bucket_allgathers' is not an integer"),
    (dict(pipeline="insert_gather_release", gather_bucket_bytes=5), ValueError,
     "which gather_bucket_bytes edits; write it in the pipeline text instead"),
]


@pytest.mark.parametrize("fields, error, fragment", COMPILE_CONFIG_CASES)
def test_compile_config_bad_fields(fields, error, fragment):
    from sharc import CompileConfig

    with pytest.raises(error, match=re.escape(fragment)):
        CompileConfig(**fields)


def test_compile_config_every_field_is_checked():
    # A new field must come with a bad-value case above.
    from sharc import CompileConfig, ShardConfig

    covered = {k for fields, _, _ in COMPILE_CONFIG_CASES for k in fields}
    assert covered == set(CompileConfig.__dataclass_fields__)
    covered = {k for fields, _, _ in SHARD_CONFIG_CASES for k in fields}
    assert set(ShardConfig.__dataclass_fields__) <= covered


def test_compile_options_unknown_key():
    from sharc import CompileConfig

    with pytest.raises(ValueError, match="unknown sharc compile option 'bucket_bytes'; "
                                         "the options are inductor"):
        CompileConfig.from_options({"bucket_bytes": 1})


# ------------------------------------------------------------ shard()


def _swap_one_pair(t: torch.Tensor) -> None:
    flat = t.data.view(-1)
    flat[[0, 1]] = flat[[1, 0]].clone()


def _shard_misuse(rank, world):
    import sharc

    errors = {}

    def attempt(name, fn, *exc):
        try:
            fn()
            errors[name] = None
        except exc as e:
            errors[name] = (type(e).__name__, str(e))

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3, dtype=dtype)
        if rank == 1:  # same values, same sum, two of them swapped
            _swap_one_pair(lin.weight)
        attempt(f"swap_{dtype}", lambda: sharc.shard(lin), RuntimeError)
    lin = torch.nn.Linear(3, 3)
    attempt("first", lambda: sharc.shard(lin), RuntimeError)
    attempt("twice", lambda: sharc.shard(lin), RuntimeError)
    attempt("nested", lambda: sharc.shard(torch.nn.Sequential(lin, torch.nn.ReLU())),
            RuntimeError)  # FSDP habit: a layer first, then the root
    attempt("meta", lambda: sharc.shard(torch.nn.Sequential(
        torch.nn.Linear(3, 3, device="meta"), torch.nn.Linear(3, 3))), RuntimeError)
    attempt("group", lambda: sharc.shard(torch.nn.Linear(3, 3), group="world"), TypeError)
    attempt("keep", lambda: sharc.shard(
        torch.nn.Linear(3, 3), config=sharc.ShardConfig(keep_gathered=("weights",))),
        ValueError)
    attempt("keep_pattern", lambda: sharc.shard(
        torch.nn.Linear(3, 3), config=sharc.ShardConfig(keep_gathered=("*.weight",))),
        ValueError)  # the root's parameters have no dot: the pattern matches none
    attempt("stats_group", lambda: sharc.memory_stats(group=0), TypeError)
    state = {k: v for k, v in sharc.full_state_dict(lin).items()}
    state["bias"] = [0.0, 0.0, 0.0]
    attempt("load_list", lambda: sharc.load_full_state_dict(lin, state), TypeError)
    attempt("cast", lambda: lin.to(torch.float64), RuntimeError)
    # A buffer in a module before the sharded one: refused before it changes.
    with_buffer = torch.nn.Sequential(torch.nn.BatchNorm1d(3, affine=False),
                                      torch.nn.Linear(3, 3))
    sharc.shard(with_buffer)
    attempt("cast_root", lambda: with_buffer.double(), RuntimeError)
    errors["buffer_after"] = str(with_buffer[0].running_mean.dtype)
    return errors


def _shard_over_a_group_without_this_rank(rank, world):
    import torch.distributed as dist

    import sharc

    only_rank_0 = dist.new_group([0])  # every rank creates it; rank 1 is not in it
    try:
        sharc.shard(torch.nn.Linear(3, 3), only_rank_0)
        return None
    except Exception as e:
        return type(e).__name__, str(e)


def test_shard_over_a_group_without_this_rank_names_why():
    # Before: "group must be a torch.distributed.ProcessGroup ..., got int"
    # (GroupMember.NON_GROUP_MEMBER is -100), which hid the cause.
    inside, outside = run_ranks(_shard_over_a_group_without_this_rank, 2, timeout=120)
    assert inside is None
    assert outside == (
        "ValueError", "sharc: this rank (global rank 1) is not in the group: "
        "torch.distributed.new_group(ranks) returns GroupMember.NON_GROUP_MEMBER on every "
        "rank outside `ranks`. Make this call only on the group's ranks (the other ranks "
        "need not call it and are not waited for)")


def _shard_two_models_sharing_a_submodule(rank, world):
    import sharc

    torch.manual_seed(0)
    encoder = torch.nn.Linear(4, 4)
    a = torch.nn.Sequential(encoder, torch.nn.Linear(4, 2))
    b = torch.nn.Sequential(encoder, torch.nn.Linear(4, 3))
    sharc.shard(a)
    try:
        sharc.shard(b)
    except RuntimeError as e:
        shared = str(e)
    both = torch.nn.ModuleDict({"a": torch.nn.Sequential(torch.nn.Linear(4, 4)),
                                "b": torch.nn.Linear(4, 3)})
    both["b"] = torch.nn.Sequential(both["a"][0], both["b"])  # the shared encoder
    sharc.shard(both)  # the way out the error names
    return shared, both["b"](torch.ones(1, 4)).shape


def test_shard_of_a_model_sharing_a_submodule_with_a_sharded_one_names_the_way_out():
    # Before, the error said the submodule was sharded and to call shard()
    # on the root module only, which the caller had done.
    for shared, shape in run_ranks(_shard_two_models_sharing_a_submodule, 2, timeout=120):
        assert shared == (
            "sharc.shard(): this module's submodule '0' is part of another model sharded "
            "before (a submodule shared between two models); a module's parameters are "
            "sharded with one model only. Shard one root that holds both models instead "
            "(e.g. sharc.shard(torch.nn.ModuleDict({'a': model_a, 'b': model_b})), before "
            "either is sharded)")
        assert shape == (1, 3)


def test_shard_misuse():
    for errors in run_ranks(_shard_misuse, 2, timeout=120):
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert errors[f"swap_{dtype}"] == (
                "RuntimeError", "parameter 'weight' has different values on rank 0 and rank 1: "
                "seed every rank identically before building the model (or load a checkpoint "
                "after shard()), or pass ShardConfig(verify_replicas=False) if this is "
                "intended"), dtype
        assert errors["first"] is None
        assert errors["twice"][0] == "RuntimeError"
        assert "sharc.shard() was already called on this module" in errors["twice"][1]
        assert "no per-layer wrapping" not in errors["twice"][1]
        assert errors["nested"][0] == "RuntimeError"
        assert "its submodule '0' is sharded" in errors["nested"][1]
        assert "call sharc.shard() on the root module only" in errors["nested"][1]
        assert errors["meta"][0] == "RuntimeError"
        assert ("parameter '0.weight' is on the meta device but '1.weight' is not"
                in errors["meta"][1])
        assert errors["group"] == (
            "TypeError", "sharc: group must be a torch.distributed.ProcessGroup (or None for "
            "the default group), got str")
        assert errors["keep"][0] == "ValueError"
        assert "keep_gathered names 'weights', which is not a parameter" in errors["keep"][1]
        assert errors["keep_pattern"][0] == "ValueError"
        assert "keep_gathered names '*.weight', which is not a parameter of this module and " \
            "matches none" in errors["keep_pattern"][1]
        assert errors["stats_group"][0] == "TypeError"
        assert errors["load_list"] == (
            "TypeError", "load_full_state_dict: 'bias' is a list, not a tensor; pass the full "
            "tensors (e.g. from sharc.full_state_dict or an unsharded model's state_dict())")
        assert "mixed precision" in errors["cast"][1]
        assert "cannot move or cast the sharded parameter '1.weight'" in errors["cast_root"][1]
        assert errors["buffer_after"] == "torch.float32"  # nothing half-cast


def _structure_after_shard(rank, world):
    import sharc
    from transformers import GPT2Config, GPT2LMHeadModel

    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)

    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    sharc.shard(seq)
    head = seq[2]

    def replace_head():
        seq[2] = torch.nn.Linear(4, 2)

    def add_parameter():
        seq[0].register_parameter("scale", torch.nn.Parameter(torch.ones(4)))

    def add_wrapped_head():
        seq.extra = torch.nn.Sequential(torch.nn.Linear(2, 2))

    def swap_activation():
        seq[1] = torch.nn.GELU()

    def reassign_head():
        seq[2] = seq[2]

    attempt("module", replace_head)
    attempt("parameter", add_parameter)
    attempt("nested", add_wrapped_head)
    attempt("activation", swap_activation)  # no parameters: fine
    attempt("same", reassign_head)  # only shards: fine
    errors["head_kept"] = seq[2] is head
    errors["names"] = [n for n, _ in seq.named_parameters()]
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
    seq(x).sum().backward()  # still trains, every parameter a shard with a gradient
    errors["grads"] = all(p.grad is not None for p in seq.parameters())

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40,
                                    n_positions=16))
    sharc.shard(lm)
    shards = dict(lm.named_parameters())
    errors["get_parameter"] = lm.get_parameter("transformer.wte.weight") is shards[
        "transformer.wte.weight"]
    errors["get_parameter_plain"] = lm.get_parameter("transformer.h.0.ln_1.bias") is shards[
        "transformer.h.0.ln_1.bias"]
    attempt("tie_weights", lm.tie_weights)  # tied already: nothing to do
    errors["still_tied"] = lm.lm_head._parameters["weight"] is shards["transformer.wte.weight"]
    errors["resize"] = _resize_after_shard(lm, 48)
    for name in ("LlamaForCausalLM", "LlamaForSequenceClassification"):
        errors[f"resize_{name}"] = _resize_after_shard(_tiny_llama(name), 120)
    return errors


def _tiny_llama(class_name):
    import sharc
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, class_name)(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    sharc.shard(model)
    return model


def _resize_after_shard(model, new_vocab):
    """transformers' resize_token_embeddings after shard(): its error, and
    whether the model is as it was (the embedding's num_embeddings, the
    config's vocab_size, every parameter)."""
    import sharc

    before = {k: v.clone() for k, v in sharc.full_state_dict(model).items()}
    embedding = model.get_input_embeddings()
    old_vocab = embedding.num_embeddings
    try:
        model.resize_token_embeddings(new_vocab, mean_resizing=False)
        error = None
    except RuntimeError as e:
        error = str(e)
    after = sharc.full_state_dict(model)
    unchanged = (model.get_input_embeddings() is embedding
                 and embedding.num_embeddings == old_vocab
                 and model.config.vocab_size == old_vocab
                 and after.keys() == before.keys()
                 and all(torch.equal(after[k], before[k]) for k in before))
    return error, unchanged


def test_structure_changes_after_shard_are_refused_where_made():
    """A parameter entering a sharded model later would be trained apart on
    each rank, silently; transformers' tie_weights on tied weights is a
    no-op and get_parameter gives the shard named_parameters() gives;
    resize_token_embeddings raises and leaves the model as it was."""
    for errors in run_ranks(_structure_after_shard, 2, timeout=180):
        for case, what in (("module", "module '2' (Linear)"),
                           ("parameter", "parameter 'scale' (shape (4,)) to a Linear of a sharded model"),
                           ("nested", "module 'extra' (Sequential), whose parameter "
                                      "'0.weight' is not sharded")):
            assert errors[case] is not None, case
            assert f"cannot add the {what}" in errors[case], (case, errors[case])
            assert "after sharc.shard()" in errors[case]
            assert "before shard()" in errors[case]
        assert errors["activation"] is None and errors["same"] is None, errors
        assert errors["head_kept"]
        assert errors["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert errors["grads"]
        assert errors["get_parameter"] and errors["get_parameter_plain"]
        assert errors["tie_weights"] is None, errors["tie_weights"]
        assert errors["still_tied"]
        # resize_token_embeddings assigns the old embedding's weight.data
        # first: refused there, before it changes anything (tied or not).
        for case in ("resize", "resize_LlamaForCausalLM", "resize_LlamaForSequenceClassification"):
            error, unchanged = errors[case]
            assert error is not None, case
            assert "assigning `.data` on it would change the copy only" in error, (case, error)
            assert "change shapes (resize_token_embeddings included) before sharc.shard()" \
                in error, (case, error)
            assert unchanged, case


def _pruned_or_parametrized_after_shard(rank, world):
    """Each case on a fresh sharded model: the error (type, message), and
    whether the model is as it was and still trains on shards alone."""
    import copy
    import io

    import sharc
    from torch.nn.utils import parametrizations, parametrize, prune

    class Symmetric(torch.nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).t()

    def build(pruned=False, parametrized=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        if pruned:
            prune.l1_unstructured(model[0], "weight", 0.5)
        if parametrized == "symmetric":  # one tensor held
            parametrize.register_parametrization(model[0], "weight", Symmetric())
        elif parametrized == "weight_norm":  # two
            parametrizations.weight_norm(model[0])
        sharc.shard(model)
        return model

    results = {}
    cases = {
        "pickle": (build, lambda m: torch.save(m, io.BytesIO())),
        "prune": (build, lambda m: prune.l1_unstructured(m[0], "weight", 0.5)),
        "parametrize": (build, lambda m: parametrize.register_parametrization(
            m[0], "weight", torch.nn.Identity())),
        "delete": (build, lambda m: delattr(m[0], "weight")),
        "prune_remove": (lambda: build(pruned=True), lambda m: prune.remove(m[0], "weight")),
        "shallow_copy": (build, lambda m: copy.copy(m)),
        "parametrize_remove": (lambda: build(parametrized="symmetric"),
                               lambda m: parametrize.remove_parametrizations(m[0], "weight")),
        "weight_norm_remove": (lambda: build(parametrized="weight_norm"),
                               lambda m: parametrize.remove_parametrizations(
                                   m[0], "weight", leave_parametrized=False)),
    }
    for case, (make, change) in cases.items():
        model = make()
        before = {k: v.clone() for k, v in sharc.full_state_dict(model).items()}
        shards = list(model.parameters())
        try:
            change(model)
            error = None
        except (RuntimeError, TypeError) as e:
            error = (type(e).__name__, str(e))
        after = sharc.full_state_dict(model)
        model(torch.ones(3, 8)).sum().backward()
        unchanged = (after.keys() == before.keys()
                     and all(torch.equal(after[k], before[k]) for k in before)
                     and list(model.parameters()) == shards
                     and all(p.grad is not None and p.grad.shape == p.shape for p in shards))
        results[case] = error, unchanged
    return results


def test_pruning_parametrizing_and_pickling_after_shard_are_refused_unchanged():
    """torch's pruning and parametrizations take a parameter over by reading
    it and deleting it from the module: after shard() the read is a gathered
    copy, and the deletion (or prune.remove's `.data` write) left the model
    training a full copy apart on each rank, or a parametrization over
    nothing, with a RecursionError. torch.save(model) failed in pickle's
    class lookup. Removing a parametrization made before shard() failed
    inside torch with an AttributeError on sharc's class. Each is refused where it is made, naming what to do
    instead, and the model trains on as it was."""
    for results in run_ranks(_pruned_or_parametrized_after_shard, 2, timeout=180):
        expected = {
            "pickle": ("TypeError", "cannot be pickled (torch.save(model), multiprocessing)"),
            "prune": ("TypeError", "prune and parametrize before shard()"),
            "parametrize": ("RuntimeError", "cannot delete the sharded parameter '0.weight'"),
            "delete": ("RuntimeError", "cannot delete the sharded parameter '0.weight'"),
            "prune_remove": ("RuntimeError", "Make pruning permanent before sharc.shard()"),
            "parametrize_remove": ("RuntimeError", "cannot remove the parametrization of "
                                   "'weight' on a sharded Linear"),
            "weight_norm_remove": ("RuntimeError", "Remove parametrizations before sharc.shard()"),
        }
        for case, (kind, fragment) in expected.items():
            error, unchanged = results[case]
            assert error is not None and error[0] == kind, (case, error)
            assert error[1].startswith("sharc: ") and fragment in error[1], (case, error)
            assert unchanged, case
        assert results["shallow_copy"] == (None, True)


# --------------------------------------------------- clip_grad_norm_()


def _sharded_linear_with_grads():
    import sharc

    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    sharc.shard(lin)
    lin(torch.ones(2, 5)).sum().backward()
    return lin


def _clip_misuse(rank, world):
    import sharc

    lin = _sharded_linear_with_grads()
    plain = torch.nn.Linear(5, 3)
    plain(torch.ones(2, 5)).sum().backward()
    errors = {}

    def attempt(name, *args, **kwargs):
        try:
            sharc.clip_grad_norm_(*args, **kwargs)
            errors[name] = None
        except (TypeError, ValueError, RuntimeError) as e:
            errors[name] = (type(e).__name__, str(e))

    attempt("mixture", [*lin.parameters(), *plain.parameters()], 1.0)
    attempt("unsharded", plain, 1.0)
    # Only rank 1 passes a foreign parameter: both ranks fail, neither hangs.
    attempt("one_rank", [*lin.parameters(), *([plain.weight] if rank == 1 else [])], 1.0)
    attempt("norm_zero", lin, 1.0, norm_type=0)
    attempt("norm_neg_inf", lin, 1.0, norm_type=-math.inf)
    attempt("norm_nan", lin, 1.0, norm_type=math.nan)
    attempt("max_norm_neg", lin, -1.0)
    attempt("max_norm_str", lin, "big")
    attempt("not_tensors", [lin.weight, "bias"], 1.0)
    attempt("group", lin, 1.0, group="world")
    # lin.weight outside forward is a gathered copy: a full tensor, not a shard.
    attempt("gathered_copy", [lin.weight], 1.0)
    shard = dict(lin.named_parameters())["weight"]
    shard.grad[0] = math.nan if rank == 0 else 0.0  # only one rank's shard is bad
    attempt("nonfinite", lin, 1.0, error_if_nonfinite=True)
    total = sharc.clip_grad_norm_(lin, 1.0)  # as in torch: a NaN norm, NaN gradients
    errors["nan_total"] = (math.isnan(float(total)), bool(shard.grad.isnan().all()))
    return errors


def test_clip_misuse():
    results = run_ranks(_clip_misuse, 2, timeout=120)
    for rank, errors in enumerate(results):
        for case in ("mixture", "unsharded", "gathered_copy"):
            kind, msg = errors[case]
            assert kind == "ValueError", case
            assert "are not shards of group" in msg and "torch.nn.utils.clip_grad_norm_" in msg
        assert "2 of the 4 parameters given (the first: #2, shape (3, 5))" in \
            errors["mixture"][1]
        kind, msg = errors["one_rank"]
        assert kind == "ValueError"
        if rank == 1:
            assert "1 of the 3 parameters given (the first: #2, shape (3, 5))" in msg
        else:
            assert "another rank was given parameters that are not shards" in msg
        for case in ("norm_zero", "norm_neg_inf", "norm_nan"):
            assert errors[case][0] == "ValueError", case
            assert "norm_type must be a positive number or inf" in errors[case][1]
        assert errors["max_norm_neg"] == (
            "ValueError", "sharc.clip_grad_norm_(): max_norm must be >= 0, got -1.0")
        assert errors["max_norm_str"][0] == "TypeError"
        assert "max_norm and norm_type must be numbers, got 'big'" in errors["max_norm_str"][1]
        assert errors["not_tensors"][0] == "TypeError"
        assert "got an element of type str" in errors["not_tensors"][1]
        assert errors["group"][0] == "TypeError"
        assert "sharc.clip_grad_norm_(): group must be a" in errors["group"][1]
        assert errors["nonfinite"][0] == "RuntimeError"
        assert "the total norm of order 2.0 of the gradients is nan" in errors["nonfinite"][1]
        assert errors["nan_total"] == (True, True)
