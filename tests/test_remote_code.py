"""Saved CTA folders load with `trust_remote_code=True` where `cta` is not installed, with identical outputs."""

import json

import pytest
import torch

from cta import CTAConfig, CTAForCausalLM, CTAForSequenceClassification
from remote_code_env import run_in_clean_env

SCRIPT = """
import json, sys, torch
import transformers
auto = getattr(transformers, {auto!r})
model = auto.from_pretrained({path!r}, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
ids = torch.tensor({ids!r})
mask = torch.tensor({mask!r})
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
print(json.dumps(logits.tolist()))
"""


@pytest.mark.parametrize("kind", ["causal_lm", "classifier"])
def test_remote_code_load_without_package(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "causal_lm":
        config = CTAConfig.modern_decoder(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=32, pde_type="wave", pde_steps=3,
                                          pde_placement=["value", "block_output"], pde_per_channel=True)
        model, auto = CTAForCausalLM(config), "AutoModelForCausalLM"
    else:
        config = CTAConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, pde_type="advection_diffusion", pde_steps=2, num_labels=3,
                           pde_placement=["embedding", "attention_output"])
        model, auto = CTAForSequenceClassification(config), "AutoModelForSequenceClassification"
    model.eval().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"][auto].startswith("modeling_cta.")
    ids = torch.randint(1, 50, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    out = run_in_clean_env(SCRIPT.format(auto=auto, path=str(tmp_path), ids=ids.tolist(), mask=mask.tolist()))
    got = torch.tensor(json.loads(out.strip().splitlines()[-1]))
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
