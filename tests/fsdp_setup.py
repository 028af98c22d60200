"""The model, batch and step count shared by test_fsdp.py and its torchrun worker (fsdp_worker.py)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cta

STEPS = 3


def tiny_patched_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    # Per-channel coefficients: torch's FSDP (1 and 2) refuses 0-d parameters, which the scalar default is.
    return cta.patch_model(model, pde_steps=2, init="paper", per_channel=True, backend="torch")


def batch():
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
