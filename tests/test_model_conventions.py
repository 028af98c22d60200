"""The checks transformers' own model test mixins make, for both native configurations: the paper's encoder
(learned positions, post-LN, GELU, mean pooling) and the modern decoder (RoPE, RMSNorm, SwiGLU).

Not covered: contrastive search, which transformers 5 serves from the Hub (`custom_generate` with
`trust_remote_code=True`), so it cannot run offline.
"""

import warnings

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    PreTrainedTokenizerFast,
    pipeline,
)
from transformers.utils import ModelOutput

from cta import CTAConfig, CTAForCausalLM, CTAForSequenceClassification, CTAModel
from cta.pde_cache import CACHE_ARGUMENT
from pde_testing import enable_checkpointing

WORDS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"] + [f"w{i}" for i in range(57)]
VOCAB = len(WORDS)


def decoder_config(**kwargs):
    defaults = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=40, pde_steps=2, pde_alpha=0.12,
                    pde_placement=["value", "block_output"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    defaults.update(kwargs)
    return CTAConfig.modern_decoder(**defaults)


def encoder_config(**kwargs):
    defaults = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=40, max_position_embeddings=64, hidden_dropout_prob=0.0, pde_steps=2,
                    pde_alpha=0.12, pde_placement=["embedding", "attention_output"], num_labels=3, pad_token_id=0)
    defaults.update(kwargs)
    return CTAConfig.paper_encoder(**defaults)


CONFIGS = {"decoder": (decoder_config, CTAForCausalLM), "encoder": (encoder_config, CTAForSequenceClassification)}


def build(kind, **kwargs):
    make_config, model_class = CONFIGS[kind]
    torch.manual_seed(0)
    return model_class(make_config(**kwargs)).eval()


def inputs(padded=True):
    ids = torch.randint(4, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def word_tokenizer():
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]", unk_token="[UNK]")


@pytest.mark.parametrize("kind", CONFIGS)
def test_save_load_round_trip(kind, tmp_path):
    model = build(kind)
    ids, mask = inputs()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    auto = AutoModelForCausalLM if kind == "decoder" else AutoModelForSequenceClassification
    reloaded, info = auto.from_pretrained(tmp_path, output_loading_info=True)
    assert type(reloaded) is type(model) and not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(ids, attention_mask=mask).logits,
                                   model(ids, attention_mask=mask).logits, atol=0, rtol=0)
    base = AutoModel.from_pretrained(tmp_path)  # the base model from a checkpoint with a head
    assert isinstance(base, CTAModel)


def test_tied_embeddings_stay_tied_after_reload(tmp_path):
    model = build("decoder", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    reloaded, info = CTAForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"], info
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("kind", CONFIGS)
def test_resize_token_embeddings(kind):
    model = build(kind, tie_word_embeddings=True) if kind == "decoder" else build(kind)
    ids, mask = inputs()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    model.resize_token_embeddings(VOCAB + 9)
    assert model.get_input_embeddings().weight.shape[0] == VOCAB + 9 and model.config.vocab_size == VOCAB + 9
    with torch.no_grad():
        after = model(ids, attention_mask=mask).logits
        assert model(torch.full((1, 3), VOCAB + 8), attention_mask=torch.ones(1, 3)).logits.isfinite().all()
    if kind == "decoder":  # the head grows with the (tied) embeddings; old tokens keep their logits
        assert model.lm_head.weight.shape[0] == VOCAB + 9
        torch.testing.assert_close(after[..., :VOCAB][mask.bool()], before[mask.bool()], atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", CONFIGS)
def test_gradient_checkpointing_same_gradients(kind):
    ids, mask = inputs()
    labels = ids if kind == "decoder" else torch.tensor([0, 2])
    grads = []
    for checkpointing in (False, True):
        model = build(kind)
        model.train()
        if checkpointing:
            enable_checkpointing(model, use_reentrant=False)
            # (transformers 5.24 renamed the property, the old name warning; 5.14 has only the old one)
            assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("_pde." in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", CONFIGS)
def test_eager_and_sdpa_agree(kind, tmp_path):
    build(kind).save_pretrained(tmp_path)
    model_class = CONFIGS[kind][1]
    eager = model_class.from_pretrained(tmp_path, attn_implementation="eager").eval()
    sdpa = model_class.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert (eager.config._attn_implementation, sdpa.config._attn_implementation) == ("eager", "sdpa")
    ids, mask = inputs()
    with torch.no_grad():
        a, b = eager(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    if kind == "decoder":  # padded positions attend to nothing; their logits are not compared (as transformers')
        a, b = a[mask.bool()], b[mask.bool()]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", CONFIGS)
def test_output_attentions_and_hidden_states_shapes(kind):
    model = build(kind, attn_implementation="sdpa")  # output_attentions falls back to eager for that call
    ids, mask = inputs()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        plain = model(ids, attention_mask=mask)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert len(out.hidden_states) == layers + 1 and len(out.attentions) == layers
    assert all(h.shape == (2, 7, 24) for h in out.hidden_states)
    assert all(a.shape == (2, heads, 7, 7) for a in out.attentions)
    valid = mask.bool() if kind == "decoder" else slice(None)  # padded positions attend to nothing
    torch.testing.assert_close(out.logits[valid], plain.logits[valid], atol=1e-5, rtol=1e-5)
    rows = out.attentions[0][0].sum(-1)  # attention rows of an unpadded sequence sum to one
    torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", CONFIGS)
def test_dtype_loading(kind, tmp_path):
    build(kind).save_pretrained(tmp_path)
    model = CONFIGS[kind][1].from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids, mask = inputs()
    with torch.no_grad():
        assert model(ids, attention_mask=mask).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", CONFIGS)
def test_device_map_auto_on_cpu(kind, tmp_path):
    model = build(kind)
    model.save_pretrained(tmp_path)
    mapped = CONFIGS[kind][1].from_pretrained(tmp_path, device_map="auto").eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # accelerate fills the GPU first where there is one
    assert {p.device.type for p in mapped.parameters()} == {device}
    ids, mask = inputs()
    with torch.no_grad():
        logits = mapped(ids.to(device), attention_mask=mask.to(device)).logits.cpu()
        torch.testing.assert_close(logits, model(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)


def test_generation_greedy_sampling_beam_search():
    model = build("decoder")
    ids, mask = inputs()
    common = dict(attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    greedy = model.generate(ids, do_sample=False, **common)
    assert greedy.shape == (2, 12) and torch.equal(greedy, model.generate(ids, do_sample=False, use_cache=False,
                                                                            **common))
    torch.manual_seed(3)
    sampled = model.generate(ids, do_sample=True, top_k=10, **common)
    torch.manual_seed(3)
    assert torch.equal(sampled, model.generate(ids, do_sample=True, top_k=10, **common))  # seeded: reproducible
    beams = model.generate(ids, num_beams=3, do_sample=False, **common)  # reorders the PDE state with the beams
    assert torch.equal(beams, model.generate(ids, num_beams=3, do_sample=False, use_cache=False, **common))
    scored = model.generate(ids, num_beams=3, num_return_sequences=3, do_sample=False, output_scores=True,
                            return_dict_in_generate=True, **common)
    assert scored.sequences.shape == (6, 12)


def test_pipelines(tmp_path):
    tokenizer = word_tokenizer()
    text = "w1 w2 w3 w4"
    decoder = build("decoder")
    generator = pipeline("text-generation", model=decoder, tokenizer=tokenizer, device="cpu")
    generated = generator(text, max_new_tokens=3, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    prompt = tokenizer(text, return_tensors="pt")
    expected = decoder.generate(**prompt, max_new_tokens=3, do_sample=False)[0]
    assert list(generated) == expected.tolist() and len(expected) == prompt["input_ids"].shape[1] + 3

    encoder = build("encoder")
    encoder.config.id2label = {0: "a", 1: "b", 2: "c"}
    classifier = pipeline("text-classification", model=encoder, tokenizer=tokenizer, device="cpu")
    result = classifier(text)[0]
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        probabilities = encoder(ids).logits.softmax(-1)[0]
    assert result["label"] == "abc"[int(probabilities.argmax())]
    assert result["score"] == pytest.approx(float(probabilities.max()), abs=1e-5)

    features = pipeline("feature-extraction", model=encoder.model, tokenizer=tokenizer, device="cpu")(text)
    with torch.no_grad():
        expected = encoder.model(ids).last_hidden_state
    torch.testing.assert_close(torch.tensor(features), expected, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------------------
# Config-level and keyword-level output flags, and the old cache keyword, against transformers' own Llama
# --------------------------------------------------------------------------------------------------------------

# Every CTA model class (the base model under both configurations) and its transformers counterpart.
CLASSES = {
    "CTAModel-decoder": ("decoder", lambda model: model.model, LlamaModel),
    "CTAModel-encoder": ("encoder", lambda model: model.model, LlamaModel),
    "CTAForCausalLM": ("decoder", lambda model: model, LlamaForCausalLM),
    "CTAForSequenceClassification": ("encoder", lambda model: model, LlamaForSequenceClassification),
}

# (config flags, keyword flags): each flag from the config, from the keyword, and the keyword overriding the config.
FLAG_CASES = [
    ({}, {}),
    ({"output_hidden_states": True}, {}),
    ({"output_attentions": True}, {}),
    ({"output_hidden_states": True, "output_attentions": True}, {}),
    ({}, {"output_hidden_states": True}),
    ({}, {"output_attentions": True}),
    ({"output_hidden_states": True}, {"output_hidden_states": False}),
    ({"output_attentions": True}, {"output_attentions": False}),
    ({"output_hidden_states": True, "output_attentions": True}, {"output_attentions": False}),
]


def cta_model(name):
    kind, pick, _ = CLASSES[name]
    return pick(build(kind, attn_implementation="eager"))  # config.output_attentions requires eager (as Llama's)


def llama_model(name):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0,
                         attn_implementation="eager")
    return CLASSES[name][2](config).eval()


def run_with_flags(model, config_flags, keyword_flags):
    """The model's output with ``config_flags`` set on its config (restored afterwards) and ``keyword_flags``."""
    saved = {key: getattr(model.config, key) for key in config_flags}
    try:
        for key, value in config_flags.items():
            setattr(model.config, key, value)
        ids, mask = inputs()
        with torch.no_grad():
            return model(ids, attention_mask=mask, **keyword_flags)
    finally:
        for key, value in saved.items():
            setattr(model.config, key, value)


def what_came_back(output):
    """(hidden states count, attentions count): None where the output holds none."""
    return tuple(None if getattr(output, key) is None else len(getattr(output, key))
                 for key in ("hidden_states", "attentions"))


@pytest.mark.parametrize("name", CLASSES)
def test_output_flags_from_config_and_keyword_behave_as_transformers_models(name):
    """Each flag from the config, from the keyword, and the keyword overriding the config: the outputs hold what
    transformers' own Llama counterpart returns for the same flags, and the config path returns the same tensors as
    the keyword path."""
    model, llama = cta_model(name), llama_model(name)
    both = run_with_flags(model, {}, {"output_hidden_states": True, "output_attentions": True})
    layers = model.config.num_hidden_layers
    assert what_came_back(both) == (layers + 1, layers)  # (the Llama twin has as many layers)
    for config_flags, keyword_flags in FLAG_CASES:
        out = run_with_flags(model, config_flags, keyword_flags)
        expected = what_came_back(run_with_flags(llama, config_flags, keyword_flags))
        assert what_came_back(out) == expected, (name, config_flags, keyword_flags)
        for key in ("hidden_states", "attentions"):
            for got, want in zip(getattr(out, key) or (), getattr(both, key)):
                torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert expected == (layers + 1, None)  # (the last case: hidden states from the config, attentions switched off)


@pytest.mark.parametrize("name", CLASSES)
def test_return_dict_from_config_and_keyword(name):
    """``config.return_dict=False`` gives the tuple ``ModelOutput.to_tuple()`` gives (transformers'
    ``can_return_tuple`` / ``capture_outputs``); the keyword overrides the config either way. (transformers 5.24's own
    Llama heads raise on ``config.return_dict=False``: their base model returns a tuple to them. The base model is
    compared with LlamaModel.)"""
    model = cta_model(name)
    as_dict = run_with_flags(model, {}, {"output_hidden_states": True})
    assert isinstance(as_dict, ModelOutput)
    as_tuple = run_with_flags(model, {"return_dict": False}, {"output_hidden_states": True})
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(as_dict.to_tuple())
    for got, want in zip(as_tuple, as_dict.to_tuple()):
        if torch.is_tensor(want):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        elif isinstance(want, tuple):
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert isinstance(run_with_flags(model, {"return_dict": False}, {"return_dict": True}), ModelOutput)
    assert isinstance(run_with_flags(model, {}, {"return_dict": False}), tuple)
    if CLASSES[name][2] is LlamaModel:
        llama = llama_model(name)
        for config_flags, keyword_flags in [({"return_dict": False}, {}), ({"return_dict": False},
                                            {"return_dict": True}), ({}, {"return_dict": False})]:
            expected = isinstance(run_with_flags(llama, config_flags, keyword_flags), tuple)
            assert isinstance(run_with_flags(model, config_flags, keyword_flags), tuple) == expected


def cache_keyword_warnings(model, name):
    """The warnings of one forward that passes the cache under its old name ``past_key_values``, with the model's
    class name taken out of the messages."""
    ids, mask = inputs()
    if isinstance(model, (LlamaForSequenceClassification, CTAForSequenceClassification)):
        cache, use_cache = None, False  # (an encoder head takes the keyword, keeps no cache)
    else:
        cache, use_cache = DynamicCache(config=model.config), True
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=use_cache)
    return [(w.category, str(w.message).replace(type(model).__name__, "<model>")) for w in caught
            if "past_key_values" in str(w.message) or "cache" in str(w.message)]


@pytest.mark.parametrize("name", CLASSES)
def test_old_cache_keyword_warns_where_transformers_models_warn(name):
    """``past_key_values=`` gives the warnings (category and message) transformers' own Llama counterpart gives on the
    installed release: a FutureWarning from 5.24 on, where the keyword is ``cache``; none on older releases."""
    model, llama = cta_model(name), llama_model(name)
    expected = cache_keyword_warnings(llama, name)
    assert cache_keyword_warnings(model, name) == expected
    if CACHE_ARGUMENT == "cache":  # (the comparison above is not vacuous on this release)
        assert expected and expected[0][0] is FutureWarning and "Use `cache` instead" in expected[0][1]
    else:
        assert expected == []
