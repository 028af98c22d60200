"""patch_model on pretrained architectures: identity init, walls, exact cached decoding, save/reload, PEFT."""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

from cta.patching_cta import (
    PATCH_PLACEMENTS,
    load_patched,
    mark_pde_trainable,
    patch_model,
    pde_modules,
    pde_modules_to_save,
    pde_parameter_names,
    unpatch_model,
)
from remote_code_env import run_in_clean_env

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("CTA_STORIES260K", REPO.parent / "shared" / "models" / "stories260K"))
needs_stories = pytest.mark.skipif(
    not (STORIES / "config.json").exists(),
    reason=f"stories260K not found at {STORIES} (set CTA_STORIES260K to the model folder)",
)

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
    """Moves every coefficient to a random point inside its stable interval (so a bug cannot hide behind 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in pde_modules(model):
            low, high = module.alpha_bounds
            module.alpha.copy_(low + (high - low) * (0.2 + 0.6 * torch.rand(module.alpha.shape, generator=g)))
            if module.beta is not None:
                low, high = module.beta_bounds
                module.beta.copy_(low + (high - low) * (0.2 + 0.6 * torch.rand(module.beta.shape, generator=g)))


# ------------------------------------------------------------------------------------------------------------------
# identity / paper init
# ------------------------------------------------------------------------------------------------------------------


@needs_stories
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
    torch.testing.assert_close(logits(model, ids, mask), reference, atol=0, rtol=0)


def test_patch_arguments_and_unsupported_architecture():
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                             num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16))
    with pytest.raises(ValueError, match="Supported architectures: Llama.*Mistral.*Qwen2.*Qwen3.*GPT2.*Bert.*Roberta"):
        patch_model(opt)
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
    assert [name for name, _ in pde_modules(model)] == ["model.layers.1.wrapped.mlp.cta_mlp_output_pde"]
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model)
