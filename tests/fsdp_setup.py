"""The models, batch and step count shared by test_fsdp.py and its torchrun worker (fsdp_worker.py)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cta

STEPS = 3
ENGINES = ("fsdp1", "fsdp2")


def tiny_patched_model():
    """A tiny Llama patched with the default (scalar, 1-element) coefficients, at the paper's values."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    return cta.patch_model(LlamaForCausalLM(config), pde_steps=2, init="paper", backend="torch")


def tiny_native_model():
    """A tiny native CTA decoder with its default coefficients."""
    torch.manual_seed(0)
    config = cta.CTAConfig.modern_decoder(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, pde_steps=2, pde_backend="torch")
    return cta.CTAForCausalLM(config)


MODELS = {"patched": tiny_patched_model, "native": tiny_native_model}


def batch():
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
