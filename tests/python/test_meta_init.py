"""Models built on the meta device, sharded, then initialised into their
shards one module at a time (sharc.init_weights): bitwise the values of the
same model built normally with the same seed, and the same losses."""

import warnings

import pytest
import torch
from torch.nn.init import normal_

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


class TorchLayers(torch.nn.Module):
    """Stock layers with their own initialisers: an embedding's padding row,
    MultiheadAttention's `_reset_parameters` (which also zeroes its child's
    bias), BatchNorm's running statistics (buffers its reset_parameters
    resets)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(65, 24, padding_idx=0)
        self.enc = torch.nn.TransformerEncoderLayer(24, 2, 48, dropout=0.0, batch_first=True)
        self.norm = torch.nn.BatchNorm1d(24)
        self.head = torch.nn.Linear(24, 65)

    def forward(self, x, y):
        h = self.enc(self.emb(x))
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, 65), y.reshape(-1))


def _gpt_loss(model, x, y):
    return model(x, y)


def _llama_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


CASES = {  # name -> (build, init_fn for sharc.init_weights, loss)
    "gpt": (make_gpt, lambda m: m._init_weights, _gpt_loss),
    "torch_layers": (TorchLayers, lambda m: None, _gpt_loss),
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


class _Scaled(torch.nn.Module):
    """Draws a parameter in __init__ outside any reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.lin(x) * self.scale


class _Table(torch.nn.Module):
    """A buffer computed in __init__ that nothing can compute again."""

    def __init__(self, persistent=True):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=persistent)

    def forward(self, x):
        return self.lin(x) + self.table


def _meta_model(build):
    with torch.device("meta"):
        return build()


def _error(fn):
    try:
        fn()
    except (RuntimeError, TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def _misuse(rank, world):
    import sharc

    e = {}
    model = _meta_model(make_gpt)
    early = torch.optim.AdamW(model.parameters())  # holds meta parameters
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # shards: fine once initialised
    e["step"] = _error(opt.step)
    x = torch.zeros(1, 4, dtype=torch.long)
    e["forward"] = _error(lambda: model(x))
    e["compiled"] = _error(lambda: torch.compile(model, backend="sharc")(x))
    e["full_state_dict"] = _error(lambda: sharc.full_state_dict(model))
    # FSDP2's idiom (to_empty, then each module's reset_parameters()) would put
    # new tensors in the shards' .data: refused before any changes
    shards = [(p, p.data_ptr()) for p in model.parameters()]
    e["to_empty"] = _error(lambda: model.to_empty(device="cpu"))
    e["to_empty_compiled"] = _error(
        lambda: torch.compile(model, backend="sharc").to_empty(device="cpu"))
    e["to_empty_untouched"] = all(p.data_ptr() == ptr for p, ptr in shards)
    e["init_fn_type"] = _error(lambda: sharc.init_weights(model, init_fn=3))
    sharc.init_weights(model, init_fn=model._init_weights)
    e["early_step"] = _error(early.step)
    model(x).sum().backward()
    opt.step()  # initialised: trains
    e["again"] = _error(lambda: sharc.init_weights(model))

    scaled = _meta_model(_Scaled)
    sharc.shard(scaled)
    e["no_reset"] = _error(lambda: sharc.init_weights(scaled))
    e["no_reset_untouched"] = all(bool((p == 0).all()) for p in scaled.parameters())
    e["init_fn_skips"] = _error(lambda: sharc.init_weights(scaled, init_fn=lambda m: None))
    e["table"] = _error(lambda: sharc.init_weights(sharc.shard(_meta_model(_Table))))
    e["table_load"] = _error(lambda: sharc.load_full_state_dict(
        sharc.shard(_meta_model(lambda: _Table(persistent=False))),
        {"lin.weight": torch.zeros(4, 4), "lin.bias": torch.zeros(4)}))
    e["device"] = _error(lambda: sharc.shard(
        torch.nn.Linear(2, 2), config=sharc.ShardConfig(device="cuda")))
    return e


def test_misuse_of_a_meta_built_model_says_what_and_how_to_fix():
    fix = ("call sharc.init_weights(model) (random initialisation, as if built normally with "
           "the same seed) or sharc.load_full_state_dict(model, path_or_state_dict) on every "
           "rank first")
    for e in run_ranks(_misuse, 2):
        assert e["step"] == ("RuntimeError", "sharc: an optimizer step over the shard of "
                             "'wte.weight' ran before the model built on the meta device has "
                             "its values: its shards are allocated but hold no values yet; "
                             + fix)
        assert e["forward"] == ("RuntimeError", "sharc: forward ran before the model built on "
                                "the meta device has its values: its shards are allocated but "
                                "hold no values yet; " + fix)
        assert e["compiled"][0] == "RuntimeError" and fix in e["compiled"][1]
        assert e["full_state_dict"][1].startswith("sharc: sharc.full_state_dict was called "
                                                  "before the model built on the meta device")
        for case in ("to_empty", "to_empty_compiled"):
            assert e[case][0] == "RuntimeError", case
            assert e[case][1].startswith(
                "sharc: Module.to_empty() (or another conversion that allocates new tensors) "
                "cannot replace the sharded parameter 'wte.weight' after sharc.shard(): its "
                "shard is already allocated on cpu"), e[case]
            assert "sharc.init_weights(model)" in e[case][1]
        assert e["to_empty_untouched"]  # so init_weights below still initialises the model
        assert e["init_fn_type"] == ("TypeError", "sharc.init_weights: init_fn must be "
                                     "callable (module -> None) or None, got 3")
        assert e["early_step"] == (
            "RuntimeError", "sharc: this AdamW holds the meta-device parameter 'wte.weight': it "
            "was created from a model built on the meta device, before sharc.shard(). Create "
            "the optimizer after shard(), from model.parameters() (the shards)")
        assert e["again"][0] == "RuntimeError"
        assert "this model already has its values" in e["again"][1]
        assert e["no_reset"] == (
            "RuntimeError", "sharc.init_weights: module '' (_Scaled) creates the parameters "
            "['scale'] but has no reset_parameters(), so nothing can initialise them. Give "
            "_Scaled a reset_parameters() that initialises them in place (and call it from "
            "__init__, so both ways of building agree), pass init_fn=(module -> None) to "
            "sharc.init_weights, or load values with sharc.load_full_state_dict")
        assert e["no_reset_untouched"]  # refused before anything was written
        assert e["init_fn_skips"][0] == "RuntimeError"
        assert e["init_fn_skips"][1].startswith(
            "sharc.init_weights: no initialiser wrote the parameter 'scale'; the others have "
            "their values")
        assert e["table"][0] == "RuntimeError"
        assert e["table"][1].startswith("sharc.init_weights: the buffer 'table' (_Table) was "
                                        "computed on the meta device")
        assert "reset_buffers()" in e["table"][1]
        assert e["table_load"][0] == "RuntimeError"
        assert e["table_load"][1].startswith(
            "load_full_state_dict: the non-persistent buffer 'table' (_Table) is in no state "
            "dict")
        assert e["device"][0] == "ValueError"
        assert "ShardConfig.device is 'cuda' but parameter 'weight' is on 'cpu'" in e["device"][1]


def _encoder(num_layers=3):
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers, norm=torch.nn.LayerNorm(8),
                                       enable_nested_tensor=False)


def _decoder(num_layers=2):
    layer = torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return torch.nn.TransformerDecoder(layer, num_layers)


def _encoder_with_a_replaced_layer():
    """A layer replaced right after construction is no copy: it drew its own
    values, after the copies were made; the layers around it still are."""
    encoder = _encoder(3)
    encoder.layers[1] = torch.nn.Linear(8, 8)
    return torch.nn.Sequential(encoder, torch.nn.Linear(8, 5))


CLONED_LAYERS = {  # name -> build; a head after the layers shows the stream was not shifted
    "encoder": lambda: torch.nn.Sequential(_encoder(), torch.nn.Linear(8, 5)),
    "decoder": lambda: torch.nn.Sequential(_decoder(), torch.nn.Linear(8, 5)),
    "encoder_decoder": lambda: torch.nn.Sequential(_encoder(2), _decoder(3),
                                                   torch.nn.Linear(8, 5)),
    "replaced_layer": _encoder_with_a_replaced_layer,
    # Its _reset_parameters() walks self.parameters() after its layers
    # initialised themselves, redrawing every matrix: it reaches their shards.
    "transformer": lambda: torch.nn.Sequential(
        torch.nn.Transformer(8, 2, 2, 2, 16, dropout=0.0, batch_first=True),
        torch.nn.Linear(8, 5)),
}


def _cloned_layers_both_ways(rank, world):
    import sharc

    out = {}
    for name, build in CLONED_LAYERS.items():
        torch.manual_seed(1)
        want = {k: v.clone() for k, v in build().state_dict().items()}
        torch.manual_seed(1)
        with torch.device("meta"):
            meta = build()
        sharc.shard(meta)
        sharc.init_weights(meta)
        got = sharc.full_state_dict(meta)
        out[name] = (want, got)
    return out


def test_stock_transformer_layers_are_initialised_as_the_clones_they_were_built_as():
    """nn.TransformerEncoder/Decoder deep-copy one layer: built normally, the
    layers hold equal values drawn once, and later modules draw from the
    stream after that one draw."""
    for out in run_ranks(_cloned_layers_both_ways, 2):
        differ = {}
        for name, (want, got) in out.items():
            assert list(got) == list(want), name
            differ[name] = [k for k, v in want.items() if not torch.equal(got[k], v)]
        assert differ == {name: [] for name in CLONED_LAYERS}


def make_gpt2():
    """transformers' Conv1D draws its weight in __init__, with no
    reset_parameters(): the replay builds each one again where it was built."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=65, n_positions=16, n_embd=24, n_layer=2, n_head=2,
                     bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg)


def make_t5(tied: bool):
    """T5's `_init_weights` on the root model writes its children's
    parameters (`shared.weight`, untied `lm_head.weight`)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=65, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                   tie_word_embeddings=tied, decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1)
    return T5ForConditionalGeneration(cfg)


class _Drawn(torch.nn.Module):
    """A leaf that draws in __init__ with no reset_parameters(), keeping its
    argument: built again by the replay."""

    def __init__(self, n, std=0.5):
        super().__init__()
        self.n, self.std = n, std
        self.w = torch.nn.Parameter(torch.empty(n, n))
        torch.nn.init.normal_(self.w, std=std)


class _DrawnOpaque(torch.nn.Module):
    """The same without its argument kept: it cannot be built again."""

    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(n, n))
        torch.nn.init.normal_(self.w)


def make_modernbert_tied():
    """ModernBERT's root `_init_weights` writes the output head `decoder`,
    tied to the token embedding: at construction the head still had a
    weight of its own, so the embedding's draw is the one that stands."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    return ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2, tie_word_embeddings=True))


HF_INIT_IN_CONSTRUCTOR = {  # name -> build
    "gpt2": make_gpt2,
    "t5": lambda: make_t5(False),
    "t5_tied": lambda: make_t5(True),
    "modernbert_tied": make_modernbert_tied,
}

DRAWN_LEAF = {  # a head after it shows the stream was not shifted
    "drawn_leaf": lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), _Drawn(4, std=0.1),
                                              torch.nn.Linear(4, 3)),
}


def _meta_and_normal(cases, init_fns=None):
    """name -> the normally built model's state and buffers, and the
    meta-built model's after init_weights (same seed); init_fns: name ->
    (meta-built model -> the init_fn to pass)."""
    import transformers  # noqa: F401  (so the models are recognised)

    import sharc

    out = {}
    for name, build in cases.items():
        torch.manual_seed(3)
        normal = build()
        want = {k: v.clone() for k, v in normal.state_dict().items()}
        want_buffers = {k: v.clone() for k, v in normal.named_buffers()}
        torch.manual_seed(3)
        with torch.device("meta"):
            meta = build()
        sharc.shard(meta)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            init_fn = (init_fns or {}).get(name)
            sharc.init_weights(meta, init_fn=init_fn and init_fn(meta))
        out[name] = dict(want=want, got=sharc.full_state_dict(meta), want_buffers=want_buffers,
                         got_buffers={k: v.clone() for k, v in meta.named_buffers()},
                         warned=[str(w.message) for w in caught
                                 if "sharc.init_weights" in str(w.message)])
    return out


def _differing(out):
    """name -> the parameters and buffers that differ from the normal build."""
    differ = {}
    for name, case in out.items():
        assert list(case["got"]) == list(case["want"]), name
        assert list(case["got_buffers"]) == list(case["want_buffers"]), name
        differ[name] = [k for k, v in case["want"].items()
                        if case["got"][k].dtype != v.dtype or not torch.equal(case["got"][k], v)]
        differ[name] += [k for k, v in case["want_buffers"].items()
                         if not torch.equal(case["got_buffers"][k], v)]
    return differ


def _hf_init_in_constructor(rank, world):
    return _meta_and_normal(HF_INIT_IN_CONSTRUCTOR)


def test_hf_draws_in_constructors_and_root_writes_into_children_are_replayed():
    """Bitwise every parameter and buffer of a normal build with the same
    seed. GPT-2: Conv1D draws its weight in __init__ (no reset_parameters());
    a lost draw shifts every later value. T5: the root model's
    `_init_weights` writes `shared.weight` and the untied `lm_head.weight`.
    ModernBERT, tied: the root's write to its head went into the tied
    embedding (std 0.01 values where the normal build has 0.02's)."""
    for out in run_ranks(_hf_init_in_constructor, 2):
        assert _differing(out) == {name: [] for name in HF_INIT_IN_CONSTRUCTOR}
        assert all(not case["warned"] for case in out.values()), out


def make_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=24, num_labels=3))


def _vit_both_ways(rank, world):
    return _meta_and_normal({"vit": make_vit})


def test_a_draw_in_a_constructor_that_cannot_be_replayed_is_warned_of():
    """HF's ViTEmbeddings draws `nn.Parameter(torch.randn(...))` in its
    __init__ and has submodules: on meta the draw took nothing from the
    stream, so later values differ from a normal build. Before, silently."""
    for out in run_ranks(_vit_both_ways, 2):
        (message,) = out["vit"]["warned"]
        assert "'vit.embeddings' (ViTEmbeddings) draws random numbers in its __init__" \
            in message
        assert "torch.randn(1, 1, config.hidden_size)" in message
        assert "sharc.load_full_state_dict" in message
        assert _differing(out)["vit"]  # what the warning says: not bitwise


def _user_init_in_constructor(rank, world):
    import sharc

    out = _meta_and_normal(DRAWN_LEAF)
    opaque = sharc.shard(_meta_model(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                                 _DrawnOpaque(4))))
    out["opaque"] = _error(lambda: sharc.init_weights(opaque))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its draw in __init__: test_root_... below
        out["opaque_init_fn"] = _error(lambda: sharc.init_weights(opaque,
                                                                  init_fn=lambda m: None))
    return out


def test_a_leaf_drawing_in_its_constructor_is_built_again_or_refused():
    """A module of the user's that draws in __init__ without
    reset_parameters() is built again from the attributes named as its
    arguments; one that cannot be is refused, naming it, even with init_fn
    (the stream would shift for every later module), unless init_fn is given
    to write it: one that leaves it unwritten is refused after the replay."""
    for out in run_ranks(_user_init_in_constructor, 2):
        opaque, opaque_init_fn = out.pop("opaque"), out.pop("opaque_init_fn")
        assert _differing(out) == {name: [] for name in DRAWN_LEAF}
        kind, message = opaque
        assert kind == "RuntimeError"
        assert message.startswith(
            "sharc.init_weights: module '1' (_DrawnOpaque) writes its parameters ['1.w'] in its "
            "__init__ (an nn.init call or another in-place write) and has no "
            "reset_parameters()."), message
        assert "its __init__ argument 'n' is not kept as an attribute of the same name" in message
        assert "Give _DrawnOpaque a reset_parameters()" in message
        assert "pass init_fn=(module -> None) that initialises them" in message
        assert opaque_init_fn[0] == "RuntimeError"
        assert opaque_init_fn[1].startswith(
            "sharc.init_weights: no initialiser wrote the parameter '1.w'"), opaque_init_fn


class _ZeroInitLastNorm(torch.nn.Module):
    """A residual block as EfficientNet's and ResNet's are built with
    `zero_init_last`: its __init__ zeroes its last norm's weight after the
    norm initialised itself (ones), a write the replay cannot run again."""

    def __init__(self, n=4):
        super().__init__()
        self.fc = torch.nn.Linear(n, n)
        self.norm = torch.nn.BatchNorm1d(n)
        torch.nn.init.zeros_(self.norm.weight)


class _ZeroInitLastNormInReset(_ZeroInitLastNorm):
    """The same write moved into the block's reset_parameters(), which the
    replay calls after its children's."""

    def __init__(self, n=4):
        torch.nn.Module.__init__(self)
        self.fc = torch.nn.Linear(n, n)
        self.norm = torch.nn.BatchNorm1d(n)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.zeros_(self.norm.weight)


class _RootInitLoop(torch.nn.Module):
    """A root whose __init__ ends with a loop over its modules (timm's
    ResNet `init_weights`: kaiming for every convolution) instead of
    `self.apply(init_fn)`."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 4, 3)
        self.head = torch.nn.Linear(4, 3)
        for m in self.modules():
            if isinstance(m, torch.nn.Conv1d):
                torch.nn.init.kaiming_normal_(m.weight, mode="fan_out")


WRITES_OUTSIDE_INITIALISERS = {
    "zero_init_last": lambda: torch.nn.Sequential(_ZeroInitLastNorm(), torch.nn.Linear(4, 3)),
    "zero_init_last_in_reset": lambda: torch.nn.Sequential(_ZeroInitLastNormInReset(),
                                                           torch.nn.Linear(4, 3)),
    "root_init_loop": _RootInitLoop,
}


def _writes_outside_initialisers(rank, world):
    return _meta_and_normal(WRITES_OUTSIDE_INITIALISERS)


def test_a_write_in_an_init_that_the_replay_cannot_run_again_is_warned_of():
    """A parent's __init__ writing its child's parameter (a zero-init of a
    block's last norm, a kaiming loop ending the root's __init__) runs
    neither in a reset_parameters() nor in init_fn, so the replay cannot
    write it again: the meta-built model got the child's own values (norm
    weight ones, default convolution init), differing from a normal build.
    Before, silently; now warned, naming the parameter. Moved into the
    block's reset_parameters(), the write is replayed, bitwise, no warning."""
    for out in run_ranks(_writes_outside_initialisers, 2):
        assert _differing(out) == {"zero_init_last": ["0.norm.weight"],
                                   "zero_init_last_in_reset": [],
                                   "root_init_loop": ["conv.weight"]}
        assert out["zero_init_last_in_reset"]["warned"] == []
        for name, param in (("zero_init_last", "0.norm.weight"), ("root_init_loop", "conv.weight")):
            (message,) = out[name]["warned"]
            assert message.startswith(f"sharc.init_weights: building the model wrote the "
                                      f"parameter '{param}' in place more often"), message
            assert "reset_parameters()" in message and "init_fn" in message


class _TokenRoot(torch.nn.Module):
    """A root as timm's vision transformers are built: it creates its own
    class token and position table, and its __init__ ends with
    `self.apply(self._init_weights)`, which also writes those two (the root
    has no reset_parameters())."""

    def __init__(self, table=None, d=8, tokens=5):
        super().__init__()
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, tokens, d) if table is None else table)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.LayerNorm(d),
                                          torch.nn.Linear(d, d))
        self.head = torch.nn.Linear(d, 3)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.trunc_normal_(module.weight, std=.02)
            torch.nn.init.zeros_(module.bias)
        if isinstance(module, _TokenRoot):
            torch.nn.init.trunc_normal_(module.pos_embed, std=.02)
            torch.nn.init.normal_(module.cls_token, std=1e-6)


class _DrawnTokenRoot(_TokenRoot):
    """The same with the table drawn where it is made (timm's
    `nn.Parameter(torch.randn(...) * .02)`), before the blocks are built."""

    def __init__(self):
        super().__init__(table=torch.randn(1, 5, 8) * .02)


class _BareDrawnTokenRoot(_TokenRoot):
    """The same drawn in place by an init function imported bare (DETR's
    `from torch.nn.init import normal_`)."""

    def __init__(self):
        table = torch.empty(1, 5, 8)
        normal_(table, std=.02)
        super().__init__(table=table)


TOKEN_ROOTS = {"zeros": _TokenRoot, "drawn": _DrawnTokenRoot, "bare": _BareDrawnTokenRoot}


def _token_roots(rank, world):
    return _meta_and_normal(TOKEN_ROOTS, {name: lambda m: m._init_weights
                                          for name in TOKEN_ROOTS})


def test_a_root_writing_its_own_parameters_in_its_apply_loop_is_initialised_by_init_fn():
    """The init_fn README names for a model whose __init__ ends with
    `self.apply(init_fn)`. Before, refused when the root (no
    reset_parameters()) created a parameter the loop writes: "writes its
    parameters ['cls_token', 'pos_embed'] in its __init__", though init_fn
    writes them again. Now bitwise a normal build, unwarned; with the table
    drawn where it is made, initialised and warned that later draws shift."""
    for out in run_ranks(_token_roots, 2):
        assert _differing(out)["zeros"] == []
        assert out["zeros"]["warned"] == []
        for name, cls in (("drawn", "_DrawnTokenRoot"), ("bare", "_BareDrawnTokenRoot")):
            (message,) = out[name]["warned"]
            assert f"module '' ({cls}) draws random numbers in its __init__" in message, message
        # Every value init_fn writes without drawing is the normal build's;
        # the drawn ones differ, as the warning says.
        differ = _differing(out)["drawn"]
        assert differ and all(k.endswith("weight") or k in ("cls_token", "pos_embed")
                              for k in differ), differ
