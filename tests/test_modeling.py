"""Native CTA models: causality, padding, placements, cached generation, Auto classes, training stability."""

import itertools

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, DynamicCache

import cta
from cta import PDE_TYPES, CTAConfig, CTAForCausalLM, CTAForSequenceClassification, CTAModel
from cta.pde_cache import CACHE_ARGUMENT
from pde_testing import enable_checkpointing, randomize_pde

DECODER_PLACEMENTS = ["embedding", "value", "attention_output", "mlp_output", "block_output", "attention_matrix"]


def tiny_decoder_config(**kwargs):
    defaults = dict(
        vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=40, pde_steps=2, pde_alpha=0.12, attn_implementation="eager",
    )
    defaults.update(kwargs)
    return CTAConfig.modern_decoder(**defaults)


def tiny_encoder_config(**kwargs):
    defaults = dict(
        vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=64, hidden_dropout_prob=0.0, pde_steps=2, pde_alpha=0.12, num_labels=3,
        attn_implementation="eager",
    )
    defaults.update(kwargs)
    return CTAConfig.paper_encoder(**defaults)


def set_pde_steps(model, steps):
    for module in model.modules():
        if isinstance(module, cta.PDERefinement):
            module.steps = steps


def make_lm(pde_type, placement, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = CTAForCausalLM(tiny_decoder_config(pde_type=pde_type, pde_placement=placement, **kwargs)).eval()
    return randomize_pde(model, seed)


# --------------------------------------------------------------------------------------------------------------
# No future leak (every type x placement), and PDE steps really change the outputs
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pde_type, placement", list(itertools.product(PDE_TYPES, DECODER_PLACEMENTS)))
def test_causal_lm_does_not_leak_future_tokens(pde_type, placement):
    model = make_lm(pde_type, placement)
    torch.manual_seed(1)
    ids = torch.randint(0, 61, (2, 12))
    logits = model(ids).logits
    for t in (0, 5, 10):
        changed = ids.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % 61
        other = model(changed).logits
        assert torch.allclose(logits[:, : t + 1], other[:, : t + 1], atol=1e-6), t
        assert not torch.allclose(logits[:, t + 1 :], other[:, t + 1 :], atol=1e-6)
    set_pde_steps(model, 0)
    assert not torch.allclose(model(ids).logits, logits, atol=1e-4), "PDE steps must change the outputs"


# --------------------------------------------------------------------------------------------------------------
# Padding
# --------------------------------------------------------------------------------------------------------------


def _padded_batch(seqs, length, side, pad_id=0):
    ids = torch.full((len(seqs), length), pad_id)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for row, seq in enumerate(seqs):
        if side == "left":
            ids[row, length - len(seq) :], mask[row, length - len(seq) :] = seq, 1
        else:
            ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    return ids, mask


def _check_padding(model, output_of, side):
    torch.manual_seed(3)
    seqs = [torch.randint(1, 61, (n,)) for n in (9, 5, 7)]
    ids, mask = _padded_batch(seqs, 11, side)
    batched = output_of(model(input_ids=ids, attention_mask=mask))
    for row, seq in enumerate(seqs):
        alone = output_of(model(input_ids=seq[None]))[0]
        valid = mask[row].bool()
        got = batched[row][valid] if batched.dim() == 3 else batched[row]
        assert torch.allclose(got, alone, atol=2e-5), (side, row, (got - alone).abs().max())


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("pde_type, placement", [(t, "block_output") for t in PDE_TYPES] + [
    ("diffusion", p) for p in DECODER_PLACEMENTS if p != "block_output"])
def test_padding_gives_unpadded_outputs_encoder(pde_type, placement, side):
    torch.manual_seed(0)
    model = randomize_pde(CTAModel(tiny_encoder_config(pde_type=pde_type, pde_placement=placement))).eval()
    _check_padding(model, lambda out: out.last_hidden_state, side)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("pde_type, placement", [(t, "block_output") for t in PDE_TYPES] + [
    ("wave", p) for p in DECODER_PLACEMENTS if p != "block_output"])
def test_padding_gives_unpadded_outputs_decoder(pde_type, placement, side):
    model = make_lm(pde_type, placement)
    _check_padding(model, lambda out: out.logits, side)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_classifier_pooling_ignores_padding(pooling):
    torch.manual_seed(0)
    model = randomize_pde(CTAForSequenceClassification(tiny_encoder_config(pooling=pooling))).eval()
    _check_padding(model, lambda out: out.logits, "right")
    _check_padding(model, lambda out: out.logits, "left")


# --------------------------------------------------------------------------------------------------------------
# attention_matrix == value placement where the maths says so
# --------------------------------------------------------------------------------------------------------------


def _value_vs_matrix(pde_type, config_fn, alpha=0.2, beta=0.1, steps=2, **kwargs):
    outputs = {}
    for placement in ("value", "attention_matrix"):
        torch.manual_seed(0)
        model = CTAModel(config_fn(pde_type=pde_type, pde_placement=placement, pde_alpha=alpha, pde_beta=beta,
                                   pde_steps=steps, **kwargs))
        outputs[placement] = model.eval()
    state = outputs["value"].state_dict()
    missing, unexpected = outputs["attention_matrix"].load_state_dict(state, strict=False)
    assert all("pde" in k for k in missing + unexpected)
    torch.manual_seed(5)
    ids, mask = _padded_batch([torch.randint(1, 61, (n,)) for n in (10, 6)], 10, "right")
    return [outputs[p](input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()] for p in outputs]


@pytest.mark.parametrize("pde_type", ["diffusion", "wave"])
def test_attention_matrix_equals_value_placement_for_symmetric_linear_pdes(pde_type):
    value, matrix = _value_vs_matrix(pde_type, tiny_encoder_config)
    assert torch.allclose(value, matrix, atol=1e-5), (value - matrix).abs().max()


@pytest.mark.parametrize("pde_type", ["advection_diffusion", "reaction_diffusion"])
def test_attention_matrix_differs_from_value_placement_where_documented(pde_type):
    # large weights: for small values tanh is linear and the reaction would commute with A
    value, matrix = _value_vs_matrix(pde_type, tiny_encoder_config, alpha=0.25, beta=0.5, steps=8,
                                     initializer_range=0.5)
    assert (value - matrix).abs().max() > 1e-3


def test_attention_matrix_stays_lower_triangular_and_rows_keep_mass():
    model = make_lm("diffusion", "attention_matrix")
    out = model(torch.randint(0, 61, (2, 9)), output_attentions=True)
    for weights in out.attentions:
        upper = torch.triu(torch.ones(9, 9, dtype=torch.bool), diagonal=1)
        assert torch.all(weights[..., upper] == 0)
    encoder = CTAModel(tiny_encoder_config(pde_placement="attention_matrix")).eval()
    weights = encoder(torch.randint(1, 61, (2, 9)), output_attentions=True).attentions[0]
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 9), atol=1e-5)  # zero-flux walls conserve each row


# --------------------------------------------------------------------------------------------------------------
# Cached generation is exact
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pde_type, placement", list(itertools.product(PDE_TYPES, DECODER_PLACEMENTS)))
def test_generation_with_cache_is_exact(pde_type, placement):
    model = make_lm(pde_type, placement)
    torch.manual_seed(2)
    prompts = [torch.randint(1, 61, (n,)) for n in (7, 4)]
    ids, mask = _padded_batch(prompts, 7, "left")
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without_cache = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without_cache)

    # Step logits with the cache (a chunked prefill of 4 + 3 tokens, then one token at a time) == full forward.
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1)
    full = model(input_ids=with_cache, attention_mask=full_mask, use_cache=False).logits
    cache = DynamicCache(config=model.config)
    pieces = []
    bounds = [0, 4, 7] + list(range(8, with_cache.shape[1] + 1))
    for start, end in zip(bounds[:-1], bounds[1:]):
        out = model(input_ids=with_cache[:, start:end], attention_mask=full_mask[:, :end], **{CACHE_ARGUMENT: cache},
                    use_cache=True)
        pieces.append(out.logits)
    stepped = torch.cat(pieces, 1)
    valid = full_mask.bool()
    assert torch.allclose(stepped[valid], full[valid], atol=1e-4), (stepped[valid] - full[valid]).abs().max()


def test_plain_dynamic_cache_gets_a_clear_error():
    model = make_lm("diffusion", "block_output")
    cache = DynamicCache()
    with pytest.raises(ValueError, match="DynamicCache\\(config=model.config\\)"):
        model(torch.randint(0, 61, (1, 4)), **{CACHE_ARGUMENT: cache}, use_cache=True)


def test_the_pde_states_of_a_cache_are_checked_once_it_holds_them(monkeypatch):
    """A decoded token does not check the cache again: once a cache holds every site's state, the model remembers
    it (weakly); a site given a cache that cannot hold its state still raises, naming it."""
    import cta.pde_cache as pde_cache

    model = make_lm("diffusion", ["value", "block_output"])
    ids = torch.randint(0, 61, (1, 5))
    cache = DynamicCache(config=model.config)
    model(ids[:, :4], **{CACHE_ARGUMENT: cache}, use_cache=True)
    assert model.model.pde_sites.checked is None  # (the prefill started an empty cache)
    model(ids[:, 4:], **{CACHE_ARGUMENT: cache}, use_cache=True)
    assert model.model.pde_sites.checked() is cache
    looked_up = []
    monkeypatch.setattr(pde_cache, "_state_layer", lambda *args: looked_up.append(args))
    model(ids[:, 4:], **{CACHE_ARGUMENT: cache}, use_cache=True)
    assert not looked_up
    with pytest.raises(ValueError, match="DynamicCache\\(config=model.config\\)"):
        model.model.layers[0].block_output_pde(torch.randn(1, 1, 32), cache=DynamicCache())


def test_cache_under_either_name_and_in_the_outputs():
    """The cache is read as `cache=` or `past_key_values=` (its name before transformers 5.24), returned under the
    installed release's name; two different caches are an error before 5.24, and from then on `cache` wins with
    transformers' warning."""
    model = make_lm("diffusion", ["value", "block_output"])
    ids = torch.randint(1, 61, (2, 6))
    results = []
    for name in ("cache", "past_key_values"):
        cache = DynamicCache(config=model.config)
        first = model(ids[:, :5], use_cache=True, **{name: cache})
        assert getattr(first, CACHE_ARGUMENT) is cache
        results.append(model(ids[:, 5:], use_cache=True, **{name: cache}).logits)
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)
    two = dict(cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))
    if CACHE_ARGUMENT == "cache":  # as transformers' own models there: a warning, and `cache` is used
        with pytest.warns(FutureWarning, match="Both `past_key_values` and `cache` are set"):
            out = model(ids, use_cache=True, **two)
        assert getattr(out, CACHE_ARGUMENT) is two["cache"]
    else:
        with pytest.raises(ValueError, match="not both"):
            model(ids, **two)


def test_a_cache_without_a_sites_state_raises():
    """A continuation step whose cache lacks one PDE site's state raises, naming the site and the transformers
    version, instead of refining the new token as if it started the sequence."""
    model = make_lm("wave", ["attention_output", "mlp_output"])
    ids = torch.randint(1, 61, (2, 6))
    cache = DynamicCache(config=model.config)
    model(ids[:, :5], use_cache=True, cache=cache)
    cache.layers[1].has_previous_state[0] = False  # layer 1's attention_output state
    with pytest.raises(ValueError, match=rf"'attention_output of layer 1'.*transformers {transformers.__version__}"):
        model(ids[:, 5:], use_cache=True, cache=cache)


def test_sliding_window_hybrid_generates_exactly():
    model = make_lm("diffusion", "block_output", sliding_window=4)
    ids = torch.randint(1, 61, (1, 9))
    a = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
    b = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------------------
# Model API
# --------------------------------------------------------------------------------------------------------------


def test_sdpa_matches_eager_and_outputs_are_complete():
    torch.manual_seed(0)
    config = tiny_decoder_config(pde_placement=["value", "block_output"])
    eager = CTAForCausalLM(config).eval()
    sdpa_config = tiny_decoder_config(pde_placement=["value", "block_output"], attn_implementation="sdpa")
    sdpa = CTAForCausalLM(sdpa_config).eval()
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 61, (2, 8))
    out = eager(ids, output_hidden_states=True, output_attentions=True)
    assert torch.allclose(out.logits, sdpa(ids).logits, atol=1e-5)
    assert len(out.hidden_states) == config.num_hidden_layers + 1 and len(out.attentions) == config.num_hidden_layers
    embeds = eager.get_input_embeddings()(ids)
    assert torch.allclose(eager(inputs_embeds=embeds).logits, out.logits, atol=1e-6)


def test_labels_give_shifted_loss_ignoring_minus_100():
    model = make_lm("diffusion", "block_output")
    ids = torch.randint(0, 61, (2, 8))
    labels = ids.clone()
    labels[:, :3] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 61)
    expected = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, expected, atol=1e-6)


@pytest.mark.parametrize("problem_type, labels", [
    ("single_label_classification", torch.tensor([0, 2])),
    ("multi_label_classification", torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])),
    ("regression", torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, 0.0]])),
])
def test_classifier_losses(problem_type, labels):
    torch.manual_seed(0)
    model = CTAForSequenceClassification(tiny_encoder_config(problem_type=problem_type)).eval()
    out = model(torch.randint(1, 61, (2, 6)), labels=labels)
    if problem_type == "single_label_classification":
        expected = torch.nn.functional.cross_entropy(out.logits, labels)
    elif problem_type == "multi_label_classification":
        expected = torch.nn.functional.binary_cross_entropy_with_logits(out.logits, labels)
    else:
        expected = torch.nn.functional.mse_loss(out.logits, labels)
    assert torch.allclose(out.loss, expected, atol=1e-6)


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = CTAForCausalLM(tiny_decoder_config(pde_placement=["value", "mlp_output"]))
    ids = torch.randint(0, 61, (2, 8))
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    enable_checkpointing(model)
    model.train()
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, grads[name], atol=1e-6), name


def test_auto_classes_and_save_reload(tmp_path):
    torch.manual_seed(0)
    config = tiny_decoder_config(pde_placement=["embedding", "block_output"], pde_per_channel=True)
    model = randomize_pde(CTAForCausalLM(config)).eval()
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "configuration_cta.py", "modeling_cta.py", "pde_cta.py"} <= files
    assert not any(name.endswith(".bin") for name in files)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), CTAConfig)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 61, (2, 7))
    assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-6)  # sdpa after reload vs eager
    assert isinstance(AutoModel.from_pretrained(tmp_path), CTAModel)
    assert type(AutoModelForSequenceClassification.from_config(tiny_encoder_config())) is CTAForSequenceClassification


def test_other_missing_weights_follow_transformers_reporting(tmp_path):
    """Only PDE weights are strict: another missing weight loads as transformers loads it, reported in
    `output_loading_info` (the strict override used to raise, unlike every transformers model)."""
    from safetensors.torch import load_file, save_file

    CTAForCausalLM(tiny_decoder_config()).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    _, info = CTAForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"model.norm.weight"} or list(info["missing_keys"]) == ["model.norm.weight"]


def test_missing_pde_weights_are_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    model = CTAForCausalLM(tiny_decoder_config())
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "pde" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(Exception, match="(?i)missing|pde"):
        CTAForCausalLM.from_pretrained(tmp_path)


# --------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, name", [
    (dict(pde_type="laplace"), "pde_type"),
    (dict(pde_placement="everywhere"), "pde_placement"),
    (dict(pde_placement=["value", "nope"]), "pde_placement"),
    (dict(pde_backend="cuda"), "pde_backend"),
    (dict(pde_steps=-1), "pde_steps"),
    (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
    (dict(pde_alpha=0.9), "pde_alpha"),
    (dict(pooling="max"), "pooling"),
    (dict(norm_type="batchnorm"), "norm_type"),
    (dict(pde_layers=[5]), "pde_layers"),
])
def test_bad_config_values_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CTAConfig(**kwargs)


def test_mask_shape_mismatch_names_the_argument():
    model = CTAModel(tiny_encoder_config()).eval()
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.randint(1, 61, (2, 6)), attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.randint(1, 61, (2, 6)), attention_mask=torch.ones(3, 6))


# --------------------------------------------------------------------------------------------------------------
# 8 and 16 PDE steps train without NaN
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [8, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_many_pde_steps_train_without_nan(steps, causal):
    torch.manual_seed(0)
    pde_type = "wave" if causal else "diffusion"
    if causal:
        model = CTAForCausalLM(tiny_decoder_config(pde_steps=steps, pde_type=pde_type, pde_alpha=0.1,
                                                   pde_placement=["value", "block_output"], pde_per_channel=True))
    else:
        model = CTAForSequenceClassification(tiny_encoder_config(pde_steps=steps, pde_alpha=0.4,
                                                                 pde_placement=["embedding", "block_output"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # aggressive on purpose
    losses = []
    for step in range(200):
        ids = torch.randint(1, 61, (8, 16))
        classes = torch.arange(8) % 3
        if causal:
            ids[:, 1::2] = ids[:, ::2]  # every odd token repeats the previous one: learnable
            loss = model(ids, labels=ids).loss
        else:
            ids = 1 + 20 * classes[:, None] + ids % 20  # each class draws its tokens from its own range
            loss = model(ids, labels=classes).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        assert all(torch.isfinite(p).all() for p in model.parameters()), step
    assert all(map(lambda x: x == x and abs(x) < 1e6, losses))
    assert sum(losses[-20:]) / 20 < 0.9 * sum(losses[:20]) / 20


def test_encoder_sliding_window_limits_the_receptive_field():
    torch.manual_seed(0)
    model = CTAModel(tiny_encoder_config(num_hidden_layers=1, sliding_window=2, pde_steps=0)).eval()
    ids = torch.randint(1, 61, (1, 10))
    changed = ids.clone()
    changed[0, 9] = (changed[0, 9] + 1) % 61
    diff = (model(ids).last_hidden_state - model(changed).last_hidden_state).abs().amax(-1)[0]
    assert torch.all(diff[:7] == 0) and diff[7:].min() > 0  # one layer, window 2: positions 7..9 see position 9
    assert CTAForSequenceClassification.accepts_loss_kwargs is False  # per-device mean loss: no DDP rescaling


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = CTAForCausalLM(tiny_decoder_config(pde_placement=["value", "block_output"], pde_backend="torch")).eval()
    ids = torch.randint(0, 61, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    eager = model(ids, attention_mask=mask, use_cache=False).logits
    compiled = torch.compile(model)(ids, attention_mask=mask, use_cache=False).logits
    assert torch.allclose(compiled, eager, atol=1e-5)
