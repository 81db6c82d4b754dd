"""Models built on the meta device, sharded, then initialised into their
shards one module at a time (sharc.init_weights): bitwise the values of the
same model built normally with the same seed, and the same losses."""

import pytest
import torch

from dist_harness import run_ranks
from models import global_batch, rank_slice


def gpt_config():
    from sharc.models.gpt import GPTConfig

    return GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=24,
                     head_bias=True)


def make_gpt():
    from sharc.models.gpt import GPT

    return GPT(gpt_config())


def make_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=65, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tied, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _gpt_loss(model, x, y):
    return model(x, y)


def _llama_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


CASES = {  # name -> (build, init_fn for sharc.init_weights, loss)
    "gpt": (make_gpt, lambda m: m._init_weights, _gpt_loss),
    "llama": (lambda: make_llama(False), lambda m: None, _llama_loss),
    "llama_tied": (lambda: make_llama(True), lambda m: None, _llama_loss),
}


def _train(model, loss_fn, rank, world, group, steps=3):
    import sharc

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, 2 * world)
        loss = loss_fn(model, rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        sharc.clip_grad_norm_(model, 1.0, group=group)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _built_both_ways(rank, world, names):
    """For each case: the normally built model's state and buffers, the
    meta-built model's after init_weights, and both models' losses sharded."""
    import torch.distributed as dist
    import transformers  # noqa: F401  (so a Llama is recognised)

    import sharc

    out = {}
    for name in names:
        build, init_fn, loss_fn = CASES[name]
        torch.manual_seed(1)
        normal = build()
        want = {k: v.clone() for k, v in normal.state_dict().items()}
        want_buffers = {k: v.clone() for k, v in normal.named_buffers()}
        torch.manual_seed(1)
        with torch.device("meta"):
            meta = build()
        meta_group, normal_group = dist.new_group(), dist.new_group()
        sharc.shard(meta, meta_group)
        sharc.init_weights(meta, init_fn=init_fn(meta))
        got = sharc.full_state_dict(meta)
        got_buffers = {k: v.clone() for k, v in meta.named_buffers()}
        sharc.shard(normal, normal_group)
        out[name] = dict(want=want, got=got, want_buffers=want_buffers,
                         got_buffers=got_buffers,
                         meta_losses=_train(meta, loss_fn, rank, world, meta_group),
                         normal_losses=_train(normal, loss_fn, rank, world, normal_group))
    return out


def _assert_same(case):
    assert list(case["got"]) == list(case["want"])
    for k, v in case["want"].items():
        assert case["got"][k].dtype == v.dtype, k
        assert torch.equal(case["got"][k], v), k
    assert list(case["got_buffers"]) == list(case["want_buffers"])
    assert case["want_buffers"], "the case must have buffers computed in __init__"
    for k, v in case["want_buffers"].items():
        assert torch.equal(case["got_buffers"][k], v), k
    assert case["meta_losses"] == case["normal_losses"]


@pytest.mark.parametrize("world", [2, 4])
def test_meta_built_models_initialise_bitwise_and_train_alike(world):
    for out in run_ranks(_built_both_ways, world, list(CASES)):
        for name, case in out.items():
            try:
                _assert_same(case)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None
