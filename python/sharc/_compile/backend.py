"""The "sharc" torch.compile backend.

AOTAutograd splits each Dynamo graph into forward and backward graphs; a
joint-graph pass first tells the partitioner to recompute gathers in backward
(recompute.py). Each graph then goes through sharc's scheduler
(schedule.py) and on to Inductor, or runs as a plain FX graph when
`inductor=False`. Which FX transforms run on which graph, and in which
order, is fx_pipeline.py's list.

[Note: sharc and Inductor's caches]
Inductor's FX graph cache (on disk, across processes) is keyed inside
compile_fx_inner, on the forward or backward graph as sharc's scheduler left
it: the generated code of that graph (every sharc op with its group name,
parameter ids, dtypes, graph kind and memory budget as literal arguments),
its inputs' sizes, strides and dtypes, Inductor's settings, and the custom
joint pass's uuid (fx_pipeline.JointGraphPass.uuid, keyed also with the
sizes of the groups the graph serves: the sharc sources that
shape what Inductor makes of a scheduled graph, its ops' lowering and
C++ library, whose meta kernels give the ops' output sizes). So a hit is a
graph sharc scheduled identically: same group, same parameters, same
buckets and order. sharc's own work on a graph (the passes, and what they
tell the runtime: kept parameters, the group's pass order) runs before the
lookup, hit or miss. A rescheduled graph (other measured costs, another
budget) is another key: the measured costs are kept beside Inductor's
cache (cost_store.py) and the free-memory budget is rounded, so that a
rerun of the job schedules identically and hits. AOTAutograd's cache would be looked up on Dynamo's
graph, before the joint pass and the scheduler: a hit there skips both, so
it stays off.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from sharc._compile import fx_pipeline, modes
from sharc._compile.pass_order import gathered_group, in_pass_order
from sharc.config import CompileConfig


def sharc_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None,
                  mode: str | None = None):
    """Entry point torch.compile calls (`backend="sharc"`); torch passes
    `mode` and `options` only when given."""
    _refuse_compiled_autograd_graph()
    mode_settings = modes.inductor_settings(mode, example_inputs)  # [Note: compile modes]
    compilation = fx_pipeline.Compilation(CompileConfig.from_options(options))
    fx_pipeline.run("dynamo", gm, compilation)
    if compilation.config.inductor:
        return _compile_with_inductor(gm, example_inputs, compilation, mode_settings)
    return _compile_without_inductor(gm, example_inputs, compilation)


def _refuse_compiled_autograd_graph() -> None:
    """Compiled autograd (torch._dynamo.config.compiled_autograd, or
    compiled_autograd._enable with this backend) traces a whole backward
    pass into one graph and compiles it with the frame's backend. For a
    sharded model that graph holds the backward sharc already scheduled
    when it compiled the forward (its gathers, releases and reduce-scatters,
    whose gradients the graph then accumulates), which the scheduler cannot
    take as its input: it failed deep inside, calling itself buggy."""
    from torch._dynamo import compiled_autograd

    if compiled_autograd.in_compiled_autograd_region:
        from sharc._compile.errors import SharcCompileError

        raise SharcCompileError(
            "sharc: compiled autograd (torch._dynamo.config.compiled_autograd = True, or "
            "torch._dynamo.compiled_autograd._enable(...)) hands backend='sharc' a whole "
            "backward pass, but sharc schedules a sharded model's backward itself, when it "
            "compiles the forward; leave compiled autograd off for a sharded model")


def _compile_with_inductor(gm, example_inputs, compilation: fx_pipeline.Compilation,
                           mode_settings: dict):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from sharc._compile import inductor_lowerings

    inductor_lowerings.register()

    joint_pass = fx_pipeline.JointGraphPass(compilation)
    forward_groups: list[str] = []  # the group the forward graph gathers from

    def inner(graph_module, inputs, **kwargs):
        kind = ("backward" if kwargs.get("is_backward") else
                "inference" if kwargs.get("is_inference") else "forward")
        fx_pipeline.run(kind, graph_module, compilation)
        if kind != "backward":
            forward_groups.extend(filter(None, [gathered_group(graph_module.graph)]))
        # AOTAutograd compiles a backward graph lazily, at the first
        # backward, outside the `with` below: the settings are patched here
        # again, so that they hold for it too and its FX graph cache key
        # carries the joint pass's uuid (without it a backward compiled by
        # an older sharc was a cache hit).
        with inductor_config.patch(_keyed_settings(settings, kind, graph_module.graph)):
            return compile_fx_inner(graph_module, inputs, **kwargs)

    # Inductor's FX graph cache stays on (see [Note: sharc and Inductor's
    # caches]); AOTAutograd's cache is keyed by the graph before sharc
    # rewrites it and a hit would skip sharc's passes: off.
    # Inductor's peak-memory reordering cannot see the runtime's gathered
    # buffers: it hoisted every start_gather (inputs: shards only) to the top
    # of a graph, gathering the whole model at once; sharc's passes order them.
    settings = dict(mode_settings, joint_custom_post_pass=joint_pass,
                    reorder_for_peak_memory=False, autotune_local_cache=False,
                    joint_graph_constant_folding=not _has_empty_input(example_inputs))
    with inductor_config.patch(settings), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = compile_fx(gm, example_inputs, inner_compile=inner)
    return in_pass_order(compiled, forward_groups, compilation.config)


def _has_empty_input(example_inputs) -> bool:
    """[Note: a rank's empty batch]
    Whether a tensor input other than a parameter (a zero-size parameter is
    one on every rank) has no elements (a rank whose batch has 0 rows).
    Dynamo specializes a size of 0 even under dynamic=True, so that rank
    compiles a graph of its own, and Inductor's joint-graph constant folding
    (constant_fold_uniform_value) then replaces computations of 0 elements
    with `full`, dropping their reads of gathered parameters (an attention
    layer's in_proj_bias): that rank's forward gathered fewer parameters than
    the others' and the ranks diverged at their first all-gather. Without
    that folding its graph reads every parameter the other ranks' graphs
    read, in the same order, so their collectives match. Only such graphs
    skip it; every other graph compiles (and is cached) as before."""
    return any(isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
               and isinstance(t.numel(), int) and t.numel() == 0
               for t in example_inputs)


def _keyed_settings(settings: dict, kind: str, graph: fx.Graph) -> dict:
    """The settings a graph compiles under, its FX graph cache key carrying
    what Inductor's key leaves out: the sizes of the groups its sharc ops
    serve ([Note: a graph's shard sizes]) and, for a backward graph, its
    donated buffers ([Note: a backward graph's donated buffers])."""
    extras = [_group_sizes(graph)]
    if kind == "backward":
        extras.append(_donated())
    return dict(settings, joint_custom_post_pass=settings["joint_custom_post_pass"].keyed(
        " ".join(extras)))


def _group_sizes(graph: fx.Graph) -> str:
    """[Note: a graph's shard sizes]
    A scheduled backward graph takes no shard as input, yet returns shard
    gradients whose sizes the group's world size sets (their ops' meta
    kernels ask the runtime): the same model compiled on 3 ranks and then on
    2 was the same key, and the 2-rank job ran the 3-rank code (a size check
    failing in backward, where it did not fail silently). Each group a
    graph's sharc ops name goes into the key with its world size and its
    replicas (hybrid sharding)."""
    from sharc._library import Runtime
    from sharc._state import live_group

    groups = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace != "sharc":
            continue
        for i, argument in enumerate(node.target._schema.arguments):
            if argument.name == "group" and i < len(node.args):
                groups.add(str(node.args[i]))
    sizes = []
    for name in sorted(groups):
        world = live_group(name, "that a compiled graph serves").size()
        sizes.append(f"{name}:{world}x{Runtime.for_group(name).replicate_size()}")
    return "groups=" + ",".join(sizes)


def _donated() -> str:
    """[Note: a backward graph's donated buffers]
    AOTAutograd lets Inductor write a backward graph's results into the
    buffers of saved tensors that backward uses last ("donated buffers"),
    unless the backward that compiles it keeps its graph (`retain_graph=True`,
    decided at that first backward). Inductor's FX graph cache key leaves
    that decision out, so one graph compiled both ways is one key: a job
    whose backward retains its graph could get code compiled by another that
    did not, which overwrites saved tensors the second backward reads (wrong
    gradients, silently). The donated inputs go into the key here, through
    the joint pass's uuid."""
    from torch._inductor import utils as inductor_utils

    donated_idxs = getattr(inductor_utils, "get_donated_idxs", None)  # torch >= 2.6
    return f"donated={sorted((donated_idxs() if donated_idxs else None) or ())}"


def _compile_without_inductor(gm, example_inputs, compilation: fx_pipeline.Compilation):
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    forward_groups: list[str] = []  # the group the forward graph gathers from

    def compiler(kind):
        def compile_graph(graph_module, inputs):
            fx_pipeline.run(kind, graph_module, compilation)
            if kind != "backward":
                forward_groups.extend(filter(None, [gathered_group(graph_module.graph)]))
            return make_boxed_func(graph_module.forward)
        return compile_graph

    def partition(joint, joint_inputs, **kwargs):
        fx_pipeline.run("joint", joint.graph, compilation)
        joint.recompile()
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    backend = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                           inference_compiler=compiler("inference"),
                           partition_fn=partition, keep_inference_input_mutations=True)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = backend(gm, example_inputs)
    return in_pass_order(compiled, forward_groups, compilation.config)



@functools.cache
def register() -> None:
    """Makes backend="sharc" available (also reachable through the
    torch_dynamo_backends entry point)."""
    from torch._dynamo.backends import registry

    if "sharc" not in registry._COMPILER_FNS:  # the entry point may have loaded it
        registry.register_backend(compiler_fn=sharc_backend, name="sharc")
