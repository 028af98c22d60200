"""patch_model on pretrained architectures: identity init, walls, exact cached decoding, save/reload, PEFT."""

import copy
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import cta

from cta.patching_cta import (
    PATCH_PLACEMENTS,
    load_patched,
    mark_pde_trainable,
    patch_model,
    pde_modules,
    pde_parameter_names,
    unpatch_model,
)
from cta.pde_cache import CACHE_ARGUMENT
from remote_code_env import run_in_clean_env
from shared_data import STORIES260K
from pde_testing import enable_checkpointing, randomize_pde as randomize_interior

STORIES = STORIES260K  # (shipped in examples/demo_data: tests/shared_data.py)

DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]
ENCODERS = ["bert", "roberta"]
VOCAB = 100


def tiny_model(arch, seed=0):
    """A tiny random model of `arch` (hidden 32, 2 layers, vocab 100), eval mode, fp32."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common))
    elif arch == "mistral":  # sliding window -> the cache gets hybrid_sliding layers
        model = transformers.MistralForCausalLM(transformers.MistralConfig(num_key_value_heads=2, sliding_window=64,
                                                                          **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **common))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_key_value_heads=2, head_dim=8, **common))
    elif arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                                     n_positions=64))
    elif arch == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=3, **common))
    elif arch == "roberta":
        model = transformers.RobertaForSequenceClassification(
            transformers.RobertaConfig(num_labels=3, pad_token_id=1, max_position_embeddings=66, **common))
    else:
        raise KeyError(arch)
    return model.eval()


def batch(seed=1, length=10, pad=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding in row 1
    return ids, mask


def positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kwargs).logits


def randomize_pde(model, seed=0):
    return randomize_interior(model, seed, margin=0.2)


# ------------------------------------------------------------------------------------------------------------------
# identity / paper init
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pde_type", ["diffusion", "wave", "reaction_diffusion", "advection_diffusion"])
def test_identity_init_stories260k(pde_type):
    model = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    ids, mask = batch(length=16)
    ids = ids % model.config.vocab_size
    reference = logits(model, ids, mask)
    patch_model(model, pde_type=pde_type, pde_steps=4, placement=list(PATCH_PLACEMENTS), per_channel=True)
    assert len(pde_modules(model)) == 1 + 4 * model.config.num_hidden_layers
    torch.testing.assert_close(logits(model, ids, mask), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", DECODERS + ENCODERS)
def test_identity_and_paper_init_tiny(arch):
    model = tiny_model(arch)
    ids, mask = batch()
    reference = logits(model, ids, mask)
    patch_model(model, pde_steps=2, placement=list(PATCH_PLACEMENTS))
    assert type(model).__name__.startswith("CTAPatched") and model.config.cta_patch["causal"] == (arch in DECODERS)
    torch.testing.assert_close(logits(model, ids, mask), reference, atol=1e-5, rtol=0)
    # paper init changes the outputs
    paper = patch_model(tiny_model(arch), pde_steps=2, placement=list(PATCH_PLACEMENTS), init="paper")
    assert (logits(paper, ids, mask) - reference).abs().max() > 1e-3
    # unpatch gives the plain model back
    unpatch_model(model)
    assert not type(model).__name__.startswith("CTAPatched") and not hasattr(model.config, "cta_patch")
    assert not any("cta_" in name for name, _ in model.named_parameters())
    assert not any(name.startswith(("forward", "_cta")) for name in vars(model.base_model))  # the class's forward again
    torch.testing.assert_close(logits(model, ids, mask), reference, atol=0, rtol=0)


def test_patch_arguments_and_unsupported_architecture():
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16,
                                                                   num_hidden_layers=1, state_size=4))
    with pytest.raises(ValueError, match=r"MambaConfig \(model_type 'mamba'\): keeps its own recurrent"):
        patch_model(mamba)
    # a placement the architecture does not offer: refused before anything changes, naming what it supports
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)).eval()
    ids, mask = batch()
    before, names = logits(neox, ids, mask), [n for n, _ in neox.named_modules()]
    with pytest.raises(ValueError, match=r"cannot place `value` in GPTNeoXForCausalLM \(model_type 'gpt_neox'\): "
                                         r".*interleaved.*supports there: embedding, attention_output, mlp_output, "
                                         r"block_output\."):
        patch_model(neox, placement=["block_output", "value"])
    assert type(neox) is transformers.GPTNeoXForCausalLM and not hasattr(neox.config, "cta_patch")
    assert [n for n, _ in neox.named_modules()] == names
    torch.testing.assert_close(logits(neox, ids, mask), before, atol=0, rtol=0)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="attention_matrix"):
        patch_model(model, placement="attention_matrix")
    with pytest.raises(ValueError, match="`placement`"):
        patch_model(model, placement="ffn")
    with pytest.raises(ValueError, match="`layers`"):
        patch_model(model, layers=[5])
    with pytest.raises(ValueError, match="`init`"):
        patch_model(model, init="random")
    with pytest.raises(ValueError, match="`alpha`"):
        patch_model(model, alpha=0.9)
    with pytest.raises(ValueError, match="`pde_steps`"):
        patch_model(model, pde_steps=-1)
    with pytest.raises(ValueError, match="pde_type"):
        patch_model(model, pde_type="heat_equation")
    patch_model(model, layers=[1], placement="mlp_output")
    assert [name for name, _ in pde_modules(model)] == ["model.layers.1.mlp.cta_mlp_output_pde"]
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model)


# ------------------------------------------------------------------------------------------------------------------
# causal exactness: no leak, walls, cached decoding
# ------------------------------------------------------------------------------------------------------------------

PDE_TYPE_FOR = dict(zip(PATCH_PLACEMENTS, ["wave", "advection_diffusion", "reaction_diffusion", "diffusion", "wave"]))


def patched_decoder(arch, placement, steps=3):
    model = patch_model(tiny_model(arch), pde_type=PDE_TYPE_FOR.get(placement, "diffusion") if isinstance(placement, str) else "diffusion", pde_steps=steps,
                        placement=placement, per_channel=True)
    randomize_pde(model)
    return model


@pytest.mark.parametrize("base_model", [False, True], ids=["with_head", "base_model"])
@pytest.mark.parametrize("arch", DECODERS + ENCODERS)
def test_output_hidden_states_are_what_each_layer_receives(arch, base_model):
    """``output_hidden_states``: entry k is the input of layer k, refined (transformers records them with hooks on
    the layers, which fire after the refining hooks; and a base model patched in place has a new class)."""
    model = tiny_model(arch)
    if base_model:
        model = model.base_model
    ids, mask = batch()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    patch_model(model, pde_steps=2, placement=["embedding", "block_output"], init="paper")
    received = []
    for layer in [m for m in model.modules() if hasattr(m, "cta_block_output_pde")]:
        layer.register_forward_pre_hook(
            lambda module, args, kwargs: received.append(args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True)
    with torch.no_grad():
        states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert states is not None and len(states) == len(plain) == len(received) + 1
    for k, layer_input in enumerate(received):
        torch.testing.assert_close(states[k], layer_input, atol=0, rtol=0)
    assert (states[1] - plain[1]).abs().max() > 1e-3  # refined, not the unpatched model's


@pytest.mark.parametrize("arch", DECODERS)
def test_no_future_leak(arch):
    model = patched_decoder(arch, list(PATCH_PLACEMENTS))
    ids, _ = batch(length=12, pad=0)
    base = logits(model, ids, None)
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 5) % VOCAB
    out = logits(model, changed, None)
    torch.testing.assert_close(out[:, :7], base[:, :7], atol=1e-6, rtol=0)
    assert (out[:, 7:] - base[:, 7:]).abs().max() > 1e-4


@pytest.mark.parametrize("arch", DECODERS + ENCODERS)
def test_padding_is_a_wall(arch):
    """Changing the padded tokens changes no valid output (the PDE never reads padding)."""
    model = patch_model(tiny_model(arch), pde_steps=3, placement=list(PATCH_PLACEMENTS), init="paper")
    randomize_pde(model)
    ids, mask = batch(pad=4)
    if arch in ENCODERS:  # right padding: the classifier pools the first token
        mask = mask.flip(-1)
    other = torch.where(mask.bool(), ids, (ids + 7) % VOCAB)
    a, b = logits(model, ids, mask), logits(model, other, mask)
    twin = copy.deepcopy(model)  # runs its own forward, with its own padding context, after the original changes
    randomize_pde(model)
    twin_b = logits(twin, other, mask)
    if arch in DECODERS:
        a, b, twin_b = a[1, 4:], b[1, 4:], twin_b[1, 4:]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(twin_b, b, atol=0, rtol=0)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_gradient_checkpointing_gives_the_same_gradients(arch, reentrant):
    """transformers' gradient checkpointing recomputes each layer in the backward pass, after the forward's padding
    context was released; the wrappers nested in a layer (value / attention / MLP placements) must still see the
    padding walls there (they did not: the recomputed layer ran without walls, and the gradients were off by 0.1)."""
    model = patch_model(tiny_model(arch), pde_steps=3, placement=list(PATCH_PLACEMENTS), init="paper")
    randomize_pde(model)
    ids, mask = batch(pad=4)
    if arch in ENCODERS:
        mask = mask.flip(-1)
    twin = copy.deepcopy(model)
    enable_checkpointing(twin, use_reentrant=reentrant)
    grads = []
    for m in (model, twin):
        m.train()
        torch.manual_seed(0)  # the same dropout masks
        labels = ids if arch in DECODERS else torch.tensor([0, 2])
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("cta_value" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.skipif(not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"),
                    reason="this transformers has no activation_checkpointing_enable(every_n_layers=...) (5.24 has)")
def test_checkpointing_every_other_layer_gives_the_same_gradients():
    """Newer transformers checkpoint every n-th layer only (``activation_checkpointing_enable(every_n_layers=2)``): each
    site reads its own layer's flag, so the recomputed layer and the kept one both see the padding walls."""
    model = patch_model(tiny_model("llama"), pde_steps=3, placement=list(PATCH_PLACEMENTS), init="paper")
    randomize_pde(model)
    ids, mask = batch(pad=4)
    twin = copy.deepcopy(model)
    twin.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in twin.model.layers] == [True, False]
    grads = []
    for m in (model, twin):
        m.train()
        m(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("cta_value" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recomputation_never_takes_another_forwards_walls(reentrant):
    """Gradient checkpointing recomputes a layer after the forwards returned. Two training forwards with different
    padding masks, then one backward through both: the recomputed layer cannot tell which forward's walls apply, and
    raises. A forward whose outputs were released without a backward (a loop that skips a step) is no rival, nor is
    one with the same mask."""
    model = patch_model(tiny_model("llama"), pde_steps=2, placement=["mlp_output"], init="paper")
    enable_checkpointing(model, use_reentrant=reentrant)
    model.train()
    ids, mask = batch(pad=4)
    other = mask.clone()
    other[0, :2] = 0

    def loss(attention_mask):
        return model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss

    first, second = loss(mask), loss(other)
    with pytest.raises(ValueError, match="different attention masks"):
        (first + second).backward()
    del first, second
    skipped = loss(mask)
    del skipped
    loss(other).backward()
    (loss(mask) + loss(mask.clone())).backward()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_pde_modules_run_as_modules_and_refine_in_the_first_hook(arch):
    """The PDE modules are called as ordinary modules (a global forward hook sees each once); the refinement is the
    refined module's first forward hook, so a hook added to a layer sees the refined output (as the next layer does)
    and one prepended before it the layer's own; hooks change no output."""
    model = patch_model(tiny_model(arch), pde_steps=3, placement=list(PATCH_PLACEMENTS), init="paper")
    randomize_pde(model)
    ids, mask = batch(pad=4)
    if arch in ENCODERS:
        mask = mask.flip(-1)
    pdes = [m for _, m in pde_modules(model)]
    plain = logits(model, ids, mask)

    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.append(module) if any(module is p for p in pdes) else None)
    try:
        hooked = logits(model, ids, mask)
    finally:
        handle.remove()
    assert len(seen) == len(pdes) and all(any(m is p for m in seen) for p in pdes)
    torch.testing.assert_close(hooked, plain, atol=0, rtol=0)

    layer = next(m for m in model.modules() if hasattr(m, "cta_block_output_pde"))
    outputs = {}
    handles = [layer.register_forward_hook(lambda module, args, output: outputs.setdefault("layer", output),
                                           prepend=True),
               layer.register_forward_hook(lambda module, args, output: outputs.setdefault("after", output))]
    try:
        hooked = logits(model, ids, mask)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(hooked, plain, atol=0, rtol=0)
    unrefined, refined = (out if torch.is_tensor(out) else out[0] for out in (outputs["layer"], outputs["after"]))
    assert (refined - unrefined).abs().max() > 1e-4  # the prepended hook saw the layer's own output


@pytest.mark.parametrize("arch", DECODERS + ENCODERS)
def test_patched_model_keeps_the_base_model_names(arch):
    """No module between a parent and its child: the parameter names are the base model's plus the PDE
    coefficients ``...cta_<placement>_pde.alpha/beta`` (submodules of the modules they refine), the base weights'
    ``state_dict`` keys are unchanged, and ``unpatch_model`` removes exactly the PDE modules and their hooks."""
    plain = tiny_model(arch)
    names = [n for n, _ in plain.named_parameters()]
    keys = list(plain.state_dict())
    model = patch_model(tiny_model(arch), pde_type="reaction_diffusion", pde_steps=2,
                        placement=list(PATCH_PLACEMENTS), init="paper")
    patched_names = [n for n, _ in model.named_parameters()]
    added = [n for n in patched_names if n not in names]
    assert [n for n in patched_names if n in names] == names
    assert added and all(re.fullmatch(r".+\.cta_(embedding|value|attention_output|mlp_output|block_output)_pde\."
                                      r"(alpha|beta)", n) for n in added), added
    assert [k for k in model.state_dict() if k in keys] == keys and all("_pde." in k for k in model.state_dict()
                                                                         if k not in keys)
    if arch == "llama":
        assert "model.layers.1.self_attn.q_proj.weight" in patched_names
        assert {"model.layers.1.self_attn.cta_value_pde.alpha", "model.layers.1.mlp.cta_mlp_output_pde.alpha",
                "model.layers.0.cta_embedding_pde.alpha", "model.layers.1.cta_block_output_pde.alpha"} <= set(added)
    added_types = {type(m).__name__ for m in list(model.modules())[1:]} - {type(m).__name__ for m in plain.modules()}
    assert added_types == {"PDERefinement"}  # (the model itself has its patched class)
    unpatch_model(model)
    assert [n for n, _ in model.named_parameters()] == names
    ids, mask = batch()
    torch.testing.assert_close(logits(model, ids, mask), logits(plain, ids, mask), atol=0, rtol=0)


class _ProjectionWithDelta(torch.nn.Module):
    """Stands for a PEFT LoRA layer put in place of a projection: ``base(x) + delta(x)``."""

    def __init__(self, base, delta):
        super().__init__()
        self.base_layer, self.delta = base, delta

    def forward(self, x):
        return self.base_layer(x) + self.delta(x)


def test_value_site_refines_the_module_that_is_the_projection_at_call_time():
    """A module put in place of ``v_proj`` after patching (as PEFT's LoRA does) is refined with its delta: the same
    logits as a ``v_proj`` whose weight holds the delta; and putting the original back refines it again."""
    model = patch_model(tiny_model("llama"), pde_type="wave", pde_steps=3, placement="value", init="paper")
    randomize_pde(model)
    merged = copy.deepcopy(model)
    ids, mask = batch()
    before = logits(model, ids, mask)
    torch.manual_seed(3)
    originals = []
    for layer, merged_layer in zip(model.model.layers, merged.model.layers):
        v_proj = layer.self_attn.v_proj
        delta = torch.nn.Linear(v_proj.in_features, v_proj.out_features, bias=False)
        originals.append(v_proj)
        layer.self_attn.v_proj = _ProjectionWithDelta(v_proj, delta)
        with torch.no_grad():
            merged_layer.self_attn.v_proj.weight += delta.weight
    torch.testing.assert_close(logits(model, ids, mask), logits(merged, ids, mask), atol=1e-5, rtol=0)
    for layer, v_proj in zip(model.model.layers, originals):
        layer.self_attn.v_proj = v_proj
    torch.testing.assert_close(logits(model, ids, mask), before, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_deepcopy_refines_with_its_own_pde_modules_and_context(arch):
    """A deep copy's hooks are bound to the copy's sites: it refines with its own coefficients and padding context,
    never calls the original's PDE modules, and unpatching one leaves the other patched."""
    model = patch_model(tiny_model(arch), pde_steps=2, placement=list(PATCH_PLACEMENTS), init="paper")
    randomize_pde(model)
    ids, mask = batch(pad=4)
    if arch in ENCODERS:
        mask = mask.flip(-1)
    expected = logits(model, ids, mask)
    twin = copy.deepcopy(model)
    called = []
    handles = [m.register_forward_hook(lambda *a: called.append(1)) for _, m in pde_modules(model)]
    try:
        torch.testing.assert_close(logits(twin, ids, mask), expected, atol=0, rtol=0)
        assert not called  # the copy ran its own PDE modules only
        randomize_pde(twin, seed=5)
        assert (logits(twin, ids, mask) - expected).abs().max() > 1e-4
        torch.testing.assert_close(logits(model, ids, mask), expected, atol=0, rtol=0)
        assert len(called) == len(pde_modules(model))
    finally:
        for handle in handles:
            handle.remove()
    unpatch_model(twin)
    torch.testing.assert_close(logits(model, ids, mask), expected, atol=0, rtol=0)


@pytest.mark.parametrize("placement", list(PATCH_PLACEMENTS) + ["all"])
@pytest.mark.parametrize("arch", DECODERS)
def test_cached_decoding_is_exact(arch, placement):
    model = patched_decoder(arch, list(PATCH_PLACEMENTS) if placement == "all" else placement)
    cache = DynamicCache(config=model.config)  # the model's own cache class builds the PDE-state layers
    assert all(hasattr(layer, "conv_states") for layer in cache.layers), [type(l).__name__ for l in cache.layers]
    ids, mask = batch(length=11, pad=3)
    pos = positions(mask)
    full = logits(model, ids, mask, position_ids=pos, use_cache=False)
    # prefill 4 tokens, a chunk of 3, then one token at a time
    steps, cache = [], None
    with torch.no_grad():
        for start, end in [(0, 4), (4, 7)] + [(t, t + 1) for t in range(7, 11)]:
            out = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=pos[:, start:end],
                        **{CACHE_ARGUMENT: cache}, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    stepped = torch.cat(steps, dim=1)
    valid = mask.bool()
    torch.testing.assert_close(stepped[valid], full[valid], atol=1e-4, rtol=0)
    # generate() with the cache gives the same tokens as without
    with torch.no_grad():
        kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        with_cache = model.generate(ids, use_cache=True, **kwargs)
        without = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without)


def test_training_forward_keeps_no_pde_state_in_a_cache_it_starts():
    """A training forward with the config's use_cache starts a cache where the unpatched model does (no `position_ids`:
    its mask builder then asks the device nothing). With a cache it gives the cache-free outputs and gradients and
    keeps no PDE state there: continuing that cache raises. A training forward that continues a cache (a prefix)
    reads its PDE state: the full sequence's outputs."""
    plain = tiny_model("llama").train()
    model = patched_decoder("llama", list(PATCH_PLACEMENTS)).train()
    ids, _ = batch(length=10, pad=0)
    grads = []
    for use_cache in (True, False):
        out = model(input_ids=ids, labels=ids, use_cache=use_cache)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad()
    default = model(input_ids=ids, labels=ids)  # (the config's use_cache)
    assert (default.past_key_values is None) == (plain(input_ids=ids, labels=ids).past_key_values is None)
    assert torch.equal(default.logits, model(input_ids=ids, use_cache=False).logits)
    assert model.eval()(input_ids=ids).past_key_values is not None
    model.train()
    assert grads[0].keys() == grads[1].keys() and any("_pde." in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0, msg=name)
    started = model(input_ids=ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="no PDE state .* keeps no PDE state in a cache it starts"):
        model(input_ids=ids[:, :1], **{CACHE_ARGUMENT: started}, use_cache=True)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        prefix = model(input_ids=ids[:, :6], use_cache=True).past_key_values
    continued = model(input_ids=ids[:, 6:], **{CACHE_ARGUMENT: prefix}, use_cache=True).logits
    assert continued.requires_grad
    torch.testing.assert_close(continued, full[:, 6:], atol=1e-5, rtol=0)


def test_the_cache_view_is_kept_until_the_config_changes():
    """transformers asks the config for its cache view at every forward that starts a cache: the view is kept, and made
    again when a field changes, also one changed in place, so a cache always holds the states the patch needs."""
    model = patched_decoder("llama", ["block_output"])
    config = model.config
    view = config.get_text_config(decoder=True)
    assert config.get_text_config(decoder=True) is view
    assert view.number_of_conv_states == config.cta_patch["pde_steps"] == 3
    config.cta_patch["pde_steps"] = 2  # (changed in place: the view must not be the one kept)
    changed = config.get_text_config(decoder=True)
    assert changed is not view and changed.number_of_conv_states == 2
    config.cta_patch["pde_steps"] = 3
    assert config.get_text_config(decoder=True).number_of_conv_states == 3
    assert "_cta_cache_view" not in config.to_dict() and config == copy.deepcopy(config)
    # The kept view lives on the config itself, never saved, copied or compared.
    from cta.patching_classes import KEPT_CACHE_VIEW

    assert KEPT_CACHE_VIEW in config.__dict__ and KEPT_CACHE_VIEW not in config.to_json_string()
    assert KEPT_CACHE_VIEW not in copy.copy(config).__dict__ and KEPT_CACHE_VIEW not in copy.deepcopy(config).__dict__
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        assert KEPT_CACHE_VIEW not in (Path(folder) / "config.json").read_text()


# ------------------------------------------------------------------------------------------------------------------
# save / reload
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", DECODERS + ENCODERS)
def test_save_reload_patched(tmp_path, arch):
    model = patch_model(tiny_model(arch), pde_type="advection_diffusion", pde_steps=2,
                        placement=["embedding", "value", "mlp_output"], per_channel=True)
    randomize_pde(model)
    ids, mask = batch()
    expected = logits(model, ids, mask)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == f"cta_patched_{arch}" and config["cta_patch"]["pde_steps"] == 2
    assert {"patching_cta.py", "pde_cta.py", "model.safetensors"} <= {p.name for p in tmp_path.iterdir()}
    auto = transformers.AutoModelForCausalLM if arch in DECODERS else transformers.AutoModelForSequenceClassification
    for reloaded in (auto.from_pretrained(tmp_path), load_patched(tmp_path)):
        assert type(reloaded) is type(model)
        torch.testing.assert_close(logits(reloaded.eval(), ids, mask), expected, atol=1e-6, rtol=0)


def test_load_patched_reads_config_and_weights_from_one_subfolder(tmp_path):
    """`subfolder` applies to the config as to the weights (a repository whose root holds another model)."""
    model = patch_model(tiny_model("llama"), pde_steps=2, placement="block_output")
    randomize_pde(model)
    ids, mask = batch()
    model.save_pretrained(tmp_path / "patched")
    tiny_model("llama", seed=1).save_pretrained(tmp_path)  # a plain model at the root
    reloaded = load_patched(tmp_path, subfolder="patched")
    assert type(reloaded) is type(model)
    torch.testing.assert_close(logits(reloaded.eval(), ids, mask), logits(model, ids, mask), atol=1e-6, rtol=0)


def test_missing_or_unexpected_pde_weights_are_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    model = patch_model(tiny_model("llama"), placement="block_output", init="paper")
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    pde_key = next(k for k in weights if "_pde." in k)
    save_file({k: v for k, v in weights.items() if k != pde_key}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    weights["model.layers.0.mlp.cta_mlp_output_pde.alpha"] = torch.tensor([0.1])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weights"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


REMOTE_SCRIPT = """
import json, torch, transformers
results = {{}}
for path, auto_name, ids, mask in {cases!r}:
    auto = getattr(transformers, auto_name)
    try:
        auto.from_pretrained(path, trust_remote_code=False)  # without remote code: must refuse, never load the plain base model
        refused = False
    except Exception:
        refused = True
    model = auto.from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert type(model).__name__.startswith("CTAPatched"), type(model).__name__
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    results[path] = dict(refused=refused, logits=out.tolist())
print("RESULT " + json.dumps(results))
"""


def test_remote_code_reload_without_package(tmp_path):
    cases, expected = [], {}
    models = [("gpt2", tiny_model("gpt2"), "AutoModelForCausalLM"),
              ("bert", tiny_model("bert"), "AutoModelForSequenceClassification"),
              ("stories", AutoModelForCausalLM.from_pretrained(STORIES).eval(), "AutoModelForCausalLM")]
    for name, model, auto in models:
        patch_model(model, pde_type="wave", pde_steps=2, placement=["value", "attention_output", "block_output"],
                    per_channel=True)
        randomize_pde(model)
        path = str(tmp_path / name)
        model.save_pretrained(path)
        ids, mask = batch()
        ids = ids % model.config.vocab_size
        expected[path] = logits(model, ids, mask)
        cases.append((path, auto, ids.tolist(), mask.tolist()))
    stdout = run_in_clean_env(REMOTE_SCRIPT.format(cases=cases))
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-2000:]
    results = json.loads(lines[-1][len("RESULT "):])
    for path, want in expected.items():
        assert results[path]["refused"], f"{path} loaded without trust_remote_code"
        torch.testing.assert_close(torch.tensor(results[path]["logits"]), want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------------------
# PEFT: LoRA + PDE coefficients
# ------------------------------------------------------------------------------------------------------------------


def lora_patched(model_factory):
    from peft import get_peft_model

    model = patch_model(model_factory(), pde_steps=2, placement=["value", "block_output"])
    config = cta.CTALoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                               init_lora_weights=True)
    return get_peft_model(model, config)


def stories():
    return AutoModelForCausalLM.from_pretrained(STORIES).eval()


def test_peft_lora_and_pde_train_together_save_reload_merge(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel

    torch.manual_seed(0)
    peft_model = lora_patched(stories)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and any("_pde." in n for n in trainable)
    assert all("lora_" in n or "_pde." in n for n in trainable), sorted(trainable)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    ids, mask = batch(length=16)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    for _ in range(3):
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()
    changed = {n for n, p in peft_model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(("lora_" in n) or ("_pde." in n and "modules_to_save" in n) for n in changed), sorted(changed)
    assert any("_pde." in n for n in changed) and any("lora_B" in n for n in changed)
    expected = logits(peft_model, ids, mask)

    # adapter save -> load onto a freshly patched base, and onto the plain base (the adapter patches it) -> identical
    peft_model.save_pretrained(tmp_path / "adapter")
    for fresh in (patch_model(stories(), pde_steps=2, placement=["value", "block_output"]), stories()):
        reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
        torch.testing.assert_close(logits(reloaded, ids, mask), expected, atol=1e-5, rtol=0)

    # merge_and_unload -> save -> reload patched -> identical logits
    merged = peft_model.merge_and_unload()
    assert type(merged).__name__.startswith("CTAPatched") and not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids, mask), expected, atol=1e-5, rtol=0)
    merged.save_pretrained(tmp_path / "merged")
    again = load_patched(tmp_path / "merged").eval()
    torch.testing.assert_close(logits(again, ids, mask), expected, atol=1e-5, rtol=0)


def test_pde_only_training_helper():
    model = patch_model(tiny_model("gpt2"), pde_steps=2, placement="block_output")
    count = mark_pde_trainable(model, freeze_others=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert count == 2 and sorted(trainable) == sorted(pde_parameter_names(model))


@pytest.mark.parametrize("pde_type,per_channel", [("diffusion", False), ("wave", True), ("reaction_diffusion", False)])
def test_patched_decoder_static_cache_and_compiled_decode(pde_type, per_channel):
    """A patched decoder decodes through transformers' StaticCache (hybrid static layers hold the PDE state), and a
    `torch.compile(fullgraph=True)` decode step -- the CUDA-graph serving setting -- equals eager decoding, with
    the decode step traced as plain tensor operations (the scheme's recurrence on the token and one state write per
    level, which inductor fuses with their neighbours); no graph break."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    # CPU tensors need Triton's interpreter (set by conftest unless CTA_TEST_GPU); a GPU run uses the GPU.
    device = "cpu" if os.environ.get("CTA_TEST_GPU", "0") in ("", "0") else "cuda"
    model = LlamaForCausalLM(config).eval()
    patch_model(model, pde_type=pde_type, pde_steps=3, placement="block_output", init="paper", backend="triton",
                per_channel=per_channel)
    model.to(device)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1)).to(device)
    compiled = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        full = model(ids).logits
        for step in (model.forward, compiled):
            cache = StaticCache(config=model.config, max_cache_len=16)
            logits = [model(ids[:, :6], **{CACHE_ARGUMENT: cache}, use_cache=True).logits]
            for t in range(6, 10):  # with the attention mask generate() passes at every step
                logits.append(step(input_ids=ids[:, t:t + 1], **{CACHE_ARGUMENT: cache}, use_cache=True,
                                   attention_mask=torch.ones(1, t + 1, dtype=torch.long, device=device)).logits)
            torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-4, atol=1e-5)


def test_patched_generate_with_static_cache_and_left_padding():
    """generate(cache_implementation="static") on a left-padded batch gives the same tokens as the dynamic cache
    and as no cache at all (every step recomputed from scratch)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    patch_model(model, pde_type="diffusion", pde_steps=3, placement="block_output", init="paper")
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 7, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, model.generate(ids, **kwargs))
    assert torch.equal(static, model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.parametrize("zero3", [False, True])
def test_pde_modules_take_the_models_dtype_under_deepspeed_zero3(zero3, monkeypatch):
    """DeepSpeed ZeRO-3 partitions the parameters of one dtype together and refuses an fp32 coefficient among bf16
    weights (found on 2 GPUs): a model loaded under ZeRO-3 gets PDE modules of its own dtype; elsewhere the
    coefficients stay fp32 (their updates are far below bf16's resolution)."""
    import cta.site_spec as site_spec

    monkeypatch.setattr(site_spec, "is_deepspeed_zero3_enabled", lambda: zero3)
    model = tiny_model("llama").to(torch.bfloat16)
    patch_model(model, pde_type="diffusion", pde_steps=2, placement="block_output")
    dtypes = {p.dtype for _, module in pde_modules(model) for p in module.parameters()}
    assert dtypes == ({torch.bfloat16} if zero3 else {torch.float32})


@pytest.mark.parametrize("head", ["LlamaForSequenceClassification", "Qwen2ForTokenClassification",
                                  "LlamaForQuestionAnswering", "MistralForSequenceClassification"])
def test_generic_heads_patch_once_and_reload(tmp_path, head):
    """transformers' generic heads build their backbone with ``AutoModel.from_config``; the patched type is
    registered with AutoModel, so the backbone patches itself in the head's constructor. patch_model used to patch
    the same layers again, after changing the model ("already has a cta_block_output_pde"), and the saved folder
    failed to load with the same error."""
    family = head.split("For")[0]
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    model = getattr(transformers, head)(config).eval()
    ids, mask = batch()
    reference = model(input_ids=ids, attention_mask=mask)[0]
    patch_model(model, pde_steps=2, placement=list(PATCH_PLACEMENTS))
    assert len(pde_modules(model)) == 1 + 4 * 2
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask)[0], reference, atol=1e-5, rtol=0)
    randomize_pde(model)
    expected = model(input_ids=ids, attention_mask=mask)[0]
    model.save_pretrained(tmp_path)
    reloaded = load_patched(tmp_path).eval()
    assert type(reloaded) is type(model) and len(pde_modules(reloaded)) == len(pde_modules(model))
    torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask)[0], expected, atol=1e-6, rtol=0)
    unpatch_model(reloaded)
    assert not any(type(m).__name__.startswith("CTAPatched") for m in reloaded.modules())


def test_a_failing_patch_leaves_the_model_untouched(monkeypatch):
    """An error while the PDE sites are added (here: the model's third PDE module) removes what was added: the model keeps
    its class, config, modules and outputs, and can be patched afterwards."""
    import cta.patching_sites as patching

    model = tiny_model("llama")
    ids, mask = batch()
    before, names = logits(model, ids, mask), [n for n, _ in model.named_modules()]
    real, calls = patching.build_site, []

    def failing(*args, **kwargs):
        if next(args[-1].parameters()).device.type != "meta":  # (not the class's one-off build on the meta device)
            calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(patching, "build_site", failing)
    with pytest.raises(RuntimeError, match="boom"):
        patch_model(model, pde_steps=2, placement=list(PATCH_PLACEMENTS))
    assert type(model) is transformers.LlamaForCausalLM and type(model.config) is transformers.LlamaConfig
    assert not hasattr(model.config, "cta_patch") and [n for n, _ in model.named_modules()] == names
    assert not any("_cta_context" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(logits(model, ids, mask), before, atol=0, rtol=0)
    monkeypatch.setattr(patching, "build_site", real)
    patch_model(model, pde_steps=2, placement=list(PATCH_PLACEMENTS))
    torch.testing.assert_close(logits(model, ids, mask), before, atol=1e-5, rtol=0)
