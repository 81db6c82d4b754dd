"""Tiny Hugging Face models of thirteen families, each trained sharded on 2
gloo ranks against one unsharded process (SGD, 4 steps; see scenario.py):
encoders (BERT, RoBERTa with a classification head, DistilBERT), decoders
(OPT, GPT-NeoX, Mistral, Qwen2, Gemma, Phi, Bloom, Falcon), a mixture of
experts (Qwen2-MoE, top-2 of 4 experts: ranks route their own tokens) and an
encoder-decoder (BART). Each family reaches its weights its own way: tied
and untied output heads, rotary and ALiBi position codes, fused QKV
projections, learned positions with an offset, shared experts behind a gate.

The batches are the way people train: a sequence length that changes from
step to step, padding masked in the last rows, and each rank its own data.
Dropout is set to zero so that the runs are comparable number for number.
Every family trains eager; two (BERT, Qwen2-MoE) also compiled, the rest of
the compiled path being covered by the GPT-2, Llama, T5 and
SwitchTransformers tests elsewhere."""

import functools

import pytest
import torch

import scenario
from dist_harness import run_ranks

transformers = pytest.importorskip("transformers")

VOCAB = 97
_SMALL = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB)
_TWO_LAYERS = dict(num_hidden_layers=2, max_position_embeddings=64, **_SMALL)


def _configs():
    """family -> (model class name, config); built when a test runs."""
    t = transformers
    return {
        "bert": ("BertForMaskedLM", t.BertConfig(**_TWO_LAYERS)),
        "roberta_classifier": ("RobertaForSequenceClassification", t.RobertaConfig(
            num_hidden_layers=2, max_position_embeddings=70, num_labels=3, **_SMALL)),
        "distilbert": ("DistilBertForMaskedLM", t.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
            max_position_embeddings=64)),
        "opt": ("OPTForCausalLM", t.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
            num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=32)),
        "gpt_neox": ("GPTNeoXForCausalLM", t.GPTNeoXConfig(**_TWO_LAYERS)),
        "mistral": ("MistralForCausalLM", t.MistralConfig(num_key_value_heads=1, **_TWO_LAYERS)),
        "qwen2": ("Qwen2ForCausalLM", t.Qwen2Config(num_key_value_heads=1, **_TWO_LAYERS)),
        "qwen2_moe": ("Qwen2MoeForCausalLM", t.Qwen2MoeConfig(
            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, **_TWO_LAYERS)),
        "bart": ("BartForConditionalGeneration", t.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64)),
        "bloom": ("BloomForCausalLM", t.BloomConfig(vocab_size=VOCAB, hidden_size=32,
                                                    n_layer=2, n_head=2)),
        "gemma": ("GemmaForCausalLM", t.GemmaConfig(num_key_value_heads=1, head_dim=16,
                                                    **_TWO_LAYERS)),
        "phi": ("PhiForCausalLM", t.PhiConfig(**_TWO_LAYERS)),
        "falcon": ("FalconForCausalLM", t.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)),
    }


FAMILIES = sorted(_configs())
COMPILED = ["bert", "qwen2_moe"]


def _without_dropout(config):
    for key, value in list(vars(config).items()):
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


class Family(torch.nn.Module):
    """One family's model, called the way its task trains it; returns the loss."""

    def __init__(self, family: str):
        super().__init__()
        class_name, config = _configs()[family]
        config.use_cache = False
        self.classifier = family == "roberta_classifier"
        self.model = getattr(transformers, class_name)(_without_dropout(config))

    def forward(self, ids, mask):
        labels = ids[:, 0] % 3 if self.classifier else ids
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _make(family):
    torch.manual_seed(0)
    return Family(family)


def batch(step, rank, world):
    """Lengths change every step; the last row's last two tokens are padding."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    length = (12, 9, 16, 7)[step % 4]
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[-1, -2:] = 0
    return ids, mask


def _rank(rank, world, family, mode, group=None):
    return scenario.run_sharded(rank, world, lambda: _make(family), batch, mode, 4, group=group)


@functools.cache
def _runs(mode):
    """Every family of `mode` trained in one launch, each sharded over its own
    process group: {family: per-rank results}."""
    families = FAMILIES if mode == "eager" else COMPILED
    runs = run_ranks(scenario.in_own_groups, 2, _rank, [(f, mode) for f in families],
                     timeout=900)
    return {family: [r[i] for r in runs] for i, family in enumerate(families)}


@pytest.mark.parametrize("mode,family", [("eager", f) for f in FAMILIES]
                         + [("compiled", f) for f in COMPILED])
def test_matches_single_process(family, mode):
    reference = scenario.run_reference(lambda: _make(family), batch, 2, 4)
    scenario.assert_matches_reference(_runs(mode)[family], reference, 2, rtol=1e-4, atol=1e-5)
