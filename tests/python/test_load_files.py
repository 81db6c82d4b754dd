"""sharc.load_full_state_dict from torch.save and safetensors files into a
model sharded from the meta device: each rank reads its slice of one tensor
at a time; wrong keys, shapes and dtypes raise on every rank before
anything is written."""

import os

import pytest
import torch

from dist_harness import run_ranks
from test_meta_init import make_gpt, make_llama


def _save_files(directory):
    """Rank 0 writes the files: a GPT as a torch.save file, a tied Llama the
    way Hugging Face ships it (save_pretrained: model.safetensors, the tied
    head left out), and bad variants of the GPT's."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    gpt = {k: v.clone() for k, v in make_gpt().state_dict().items()}
    torch.save(gpt, os.path.join(directory, "gpt.pt"))
    del gpt["lm_head.weight"]  # tied to wte.weight: a safetensors file keeps one name
    save_file(gpt, os.path.join(directory, "gpt.safetensors"))
    torch.manual_seed(4)
    make_llama(tied=True).save_pretrained(os.path.join(directory, "llama"))
    bad = {
        "unexpected": gpt | {"blocks.0.extra": torch.zeros(3)},
        "missing": {k: v for k, v in gpt.items() if k != "blocks.1.mlp.fc.bias"},
        "shape": gpt | {"blocks.1.mlp.fc.weight": torch.zeros(96, 25)},
        "dtype": gpt | {"ln_f.bias": gpt["ln_f.bias"].double()},
    }
    for name, sd in bad.items():
        save_file(sd, os.path.join(directory, f"bad_{name}.safetensors"))
        torch.save(sd, os.path.join(directory, f"bad_{name}.pt"))


def _meta(build, seed=99):
    torch.manual_seed(seed)  # not the file's seed: values must come from the file
    with torch.device("meta"):
        return build()


def _loads(rank, world, directory):
    import torch.distributed as dist
    import transformers  # noqa: F401  (a Llama's rotary tables are recomputed by its init)
    from safetensors.torch import load_file

    import sharc

    if rank == 0:
        _save_files(directory)
    dist.barrier()
    out = {}
    for name, build, path in [
            ("gpt_pt", make_gpt, "gpt.pt"),
            ("gpt_safetensors", make_gpt, "gpt.safetensors"),
            ("llama_dir", lambda: make_llama(True), "llama"),
            ("llama_file", lambda: make_llama(True), "llama/model.safetensors")]:
        model = _meta(build)
        sharc.shard(model, dist.new_group())
        sharc.load_full_state_dict(model, os.path.join(directory, path))
        file = os.path.join(directory, path)
        if os.path.isdir(file):
            file = os.path.join(file, "model.safetensors")
        want = (load_file(file) if file.endswith(".safetensors")
                else torch.load(file, weights_only=True))
        torch.manual_seed(0)
        normal_buffers = dict(build().named_buffers())
        out[name] = dict(got=sharc.full_state_dict(model), want=want,
                         buffers=dict(model.named_buffers()), normal_buffers=normal_buffers,
                         loss=_one_loss(model, name))
    return out


def _one_loss(model, name):
    x = torch.arange(16).view(2, 8) % 60
    if name.startswith("gpt"):
        return model(x, x).item()
    return model(input_ids=x, labels=x).loss.item()


@pytest.mark.parametrize("world", [2, 4])
def test_files_load_into_a_meta_built_model(world, tmp_path):
    for out in run_ranks(_loads, world, str(tmp_path)):
        for name, case in out.items():
            want, got = case["want"], case["got"]
            assert set(want) <= set(got), name
            for k, v in want.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (name, k)
            for k, v in case["normal_buffers"].items():  # recomputed, not in the file
                assert torch.equal(case["buffers"][k], v), (name, k)
            assert case["loss"] == case["loss"]  # a forward ran (not NaN)
        tied = out["llama_dir"]["got"]
        assert "lm_head.weight" not in out["llama_dir"]["want"]
        assert torch.equal(tied["lm_head.weight"], tied["model.embed_tokens.weight"])


def _bad_loads(rank, world, directory):
    import torch.distributed as dist

    import sharc

    if rank == 0:
        _save_files(directory)
    dist.barrier()
    model = _meta(make_gpt)
    sharc.shard(model)
    errors = {}
    for name in ("unexpected", "missing", "shape", "dtype"):
        for ext in ("safetensors", "pt"):
            try:
                sharc.load_full_state_dict(model, os.path.join(directory, f"bad_{name}.{ext}"))
                errors[name, ext] = None
            except (KeyError, ValueError) as e:
                errors[name, ext] = (type(e).__name__, str(e))
    untouched = all(bool((p == 0).all()) for p in model.parameters())
    try:
        model(torch.zeros(1, 4, dtype=torch.long))
        forward = None
    except RuntimeError as e:
        forward = str(e)
    sharc.load_full_state_dict(model, os.path.join(directory, "gpt.safetensors"))
    loaded = sharc.full_state_dict(model)
    return errors, untouched, forward, loaded["ln_f.bias"]


def test_wrong_keys_shapes_and_dtypes_raise_on_every_rank_and_write_nothing(tmp_path):
    from safetensors.torch import load_file

    results = run_ranks(_bad_loads, 2, str(tmp_path))
    want_bias = load_file(os.path.join(tmp_path, "gpt.safetensors"))["ln_f.bias"]
    for errors, untouched, forward, bias in results:
        for ext in ("safetensors", "pt"):
            assert errors["unexpected", ext] == (
                "KeyError", "\"load_full_state_dict: missing keys [], unexpected keys "
                "['blocks.0.extra']\"")
            assert errors["missing", ext] == (
                "KeyError", "\"load_full_state_dict: missing keys ['blocks.1.mlp.fc.bias'], "
                "unexpected keys []\"")
            assert errors["shape", ext] == (
                "ValueError", "load_full_state_dict: 'blocks.1.mlp.fc.weight' has shape "
                "(96, 25), the module expects (96, 24)")
            assert errors["dtype", ext][0] == "ValueError"
            assert errors["dtype", ext][1].startswith(
                "load_full_state_dict: 'ln_f.bias' has dtype torch.float64, the module "
                "expects torch.float32")
        assert untouched  # every shard still all zeros
        assert "forward ran before the model built on the meta device has its values" in forward
        assert torch.equal(bias, want_bias)  # the good file still loads afterwards


def _tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=16))


def _converted_loads(rank, world, directory):
    import torch.distributed as dist

    import sharc

    if rank == 0:
        torch.manual_seed(5)
        model = _tiny_mixtral()
        model.save_pretrained(os.path.join(directory, "mixtral"))
        torch.save(model.state_dict(), os.path.join(directory, "mixtral.pt"))
    dist.barrier()
    model = _meta(_tiny_mixtral)
    sharc.shard(model)
    try:
        sharc.load_full_state_dict(model, os.path.join(directory, "mixtral"))
        error = None
    except KeyError as e:
        error = str(e)
    sharc.load_full_state_dict(model, os.path.join(directory, "mixtral.pt"))
    return error, sharc.full_state_dict(model)


def test_a_checkpoint_transformers_converts_on_load_is_refused_saying_how_to_load_it(tmp_path):
    """transformers 5 saves a Mixtral under its older, per-expert key names
    and converts them back while loading; sharc reads files as they are."""
    pytest.importorskip("transformers.conversion_mapping")
    results = run_ranks(_converted_loads, 2, str(tmp_path))
    want = torch.load(os.path.join(tmp_path, "mixtral.pt"))
    for error, loaded in results:
        assert error is not None and "unexpected keys" in error
        assert "transformers converts 'mixtral' checkpoints while loading them" in error
        assert "from_pretrained()" in error
        for name, value in want.items():
            assert torch.equal(loaded[name], value), name


def _tiny_hf(name):
    import transformers as T

    torch.manual_seed(6)
    if name == "roberta":  # position_ids: a non-persistent buffer beside the embeddings
        return T.RobertaForSequenceClassification(T.RobertaConfig(
            vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=24, max_position_embeddings=24, num_labels=3, pad_token_id=1))
    if name == "gemma2":  # embed_scale: likewise, in the scaled word embedding
        return T.Gemma2ForCausalLM(T.Gemma2Config(
            vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, intermediate_size=24,
            max_position_embeddings=16))
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(  # renames embed_out -> lm_head on load
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16))


def _hf_buffer_loads(rank, world, directory):
    import torch.distributed as dist

    import sharc

    out = {}
    for name in ("roberta", "gemma2", "gptneox"):
        if rank == 0:
            _tiny_hf(name).save_pretrained(os.path.join(directory, name))
        dist.barrier()
        model = _meta(lambda n=name: _tiny_hf(n))
        sharc.shard(model, dist.new_group())
        try:
            sharc.load_full_state_dict(model, os.path.join(directory, name))
        except KeyError as e:
            out[name] = str(e)
            continue
        out[name] = (sharc.full_state_dict(model),
                     {k: b.clone() for k, b in model.named_buffers()})
    return out


def test_hf_models_whose_embeddings_hold_computed_buffers_load_from_their_directories(tmp_path):
    """RoBERTa's position_ids and Gemma2's embed_scale are buffers no file
    has, in modules with parameters: transformers' initialisation computes
    them, run on stand-ins so the loaded weights stay. A model whose
    checkpoints transformers renames by class name (GPTNeoX) gets the hint."""
    pytest.importorskip("transformers.conversion_mapping")
    results = run_ranks(_hf_buffer_loads, 2, str(tmp_path))
    for name in ("roberta", "gemma2"):
        want = _tiny_hf(name)
        for out in results:
            params, buffers = out[name]
            for key, value in want.state_dict().items():
                assert torch.equal(params[key], value), (name, key)
            for key, value in want.named_buffers():
                assert torch.equal(buffers[key], value), (name, key)
    for out in results:
        assert "transformers converts 'GPTNeoXForCausalLM' checkpoints" in out["gptneox"]
