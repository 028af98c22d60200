"""Checkpoints saved by cta 0.1.0 (tests/fixtures/v0_1_0, made by that release's code: see the script there) load
with the outputs that release computed, through every loading path, and save again in the current format.

0.1.0 stored scalar PDE coefficients as 0-d tensors (now 1-element tensors, which FSDP and DeepSpeed accept).
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import cta

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v0_1_0"
NATIVE = {"native_causal_lm": (cta.CTAForCausalLM, AutoModelForCausalLM),
          "native_classifier": (cta.CTAForSequenceClassification, AutoModelForSequenceClassification)}
PATCHED = ("patched_llama", "patched_gpt2", "patched_bert")


def expected(name):
    return load_file(str(FIXTURES / name / "expected.safetensors"))


def logits_of(model, name):
    data = expected(name)
    with torch.no_grad():
        return model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits


def assert_same_outputs_as_0_1_0(model, name):
    torch.testing.assert_close(logits_of(model.eval(), name), expected(name)["logits"], rtol=1e-5, atol=1e-5)


def coefficient_shapes(folder):
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.endswith(("_pde.alpha", "_pde.beta"))}


def test_fixtures_hold_0_d_coefficients():
    """What the tests below convert: every fixture's scalar coefficients are 0-d in the file."""
    for name in (*NATIVE, *PATCHED):
        shapes = coefficient_shapes(FIXTURES / name)
        assert shapes and set(shapes.values()) == {()}, (name, shapes)


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_0_1_0_checkpoint_loads_with_the_same_outputs(name, tmp_path):
    cta_class, auto_class = NATIVE[name]
    for model in (cta_class.from_pretrained(FIXTURES / name), auto_class.from_pretrained(FIXTURES / name)):
        assert type(model) is cta_class
        assert_same_outputs_as_0_1_0(model, name)
        assert all(p.dim() >= 1 for p in model.parameters())
    model.save_pretrained(tmp_path)
    assert set(coefficient_shapes(tmp_path).values()) == {(1,)}  # saved again: the current format
    assert_same_outputs_as_0_1_0(auto_class.from_pretrained(tmp_path), name)


@pytest.mark.parametrize("name", PATCHED)
def test_patched_0_1_0_checkpoint_loads_with_the_same_outputs(name, tmp_path):
    model = cta.load_patched(FIXTURES / name)
    assert cta.patching_cta.is_patched(model)
    assert_same_outputs_as_0_1_0(model, name)
    assert all(p.dim() >= 1 for p in model.parameters())
    model.save_pretrained(tmp_path)
    assert set(coefficient_shapes(tmp_path).values()) == {(1,)}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    # saved again in the current names (the base model's, no `.wrapped.`), not in the names it was read from
    assert saved <= set(model.state_dict()) and not any("wrapped" in key for key in saved), sorted(saved)
    assert_same_outputs_as_0_1_0(cta.load_patched(tmp_path), name)


def test_0_1_0_state_dict_loads_through_load_state_dict():
    """A 0.1.0 state dict (or a PEFT adapter holding PDE modules) goes through ``load_state_dict``: the PDE
    module's pre-hook reads 0-d coefficients."""
    name = "native_causal_lm"
    model = cta.CTAForCausalLM(cta.CTAForCausalLM.config_class.from_pretrained(FIXTURES / name))
    model.load_state_dict(load_file(str(FIXTURES / name / "model.safetensors")), strict=False)
    model.tie_weights()
    assert_same_outputs_as_0_1_0(model, name)


def _fixture_copy(name, tmp_path, edit):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("name", ["native_causal_lm", "patched_llama"])
def test_missing_or_misshapen_pde_weights_raise_naming_them(name, tmp_path):
    load = (lambda path: cta.CTAForCausalLM.from_pretrained(path)) if name.startswith("native") else cta.load_patched
    key = sorted(k for k in coefficient_shapes(FIXTURES / name) if k.endswith("alpha"))[-1]

    missing = _fixture_copy(name, tmp_path / "missing", lambda w: w.pop(key))
    with pytest.raises(ValueError, match="missing weights.*" + key.rsplit(".", 2)[-2]):
        load(missing)

    def misshape(w):
        w[key] = torch.zeros(3)

    wrong = _fixture_copy(name, tmp_path / "wrong", misshape)
    with pytest.raises(RuntimeError, match="size mismatch for .*" + key.rsplit(".", 2)[-2]):
        load(wrong)


def test_other_mismatches_still_raise_as_transformers_does(tmp_path):
    """Reading 0.1.0 coefficients must not hide a size mismatch elsewhere (transformers raises for those)."""
    name = "native_causal_lm"

    def misshape(w):
        w["lm_head.weight"] = torch.zeros(3, 3)

    folder = _fixture_copy(name, tmp_path, misshape)
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        cta.CTAForCausalLM.from_pretrained(folder)
    model = cta.CTAForCausalLM.from_pretrained(folder, ignore_mismatched_sizes=True)  # the caller's choice
    assert model.lm_head.weight.shape == (64, 16)


def test_a_legacy_load_changes_no_process_wide_log_state():
    """A 0.1.0 load holds back transformers' load report (the 0-d coefficients are no real mismatch) in its own
    context only: transformers' log level stays, its other warnings show, and another thread's report is kept."""
    import logging
    import threading

    from transformers.utils import logging as hf_logging

    from cta.transformers_compat import held_back_load_report

    logger, records, levels = logging.getLogger("transformers.modeling_utils"), [], []
    filters = list(logger.filters)
    handler = logging.Handler()
    handler.emit = lambda record: (records.append(record.getMessage()), levels.append(hf_logging.get_verbosity()))
    logger.addHandler(handler)
    try:
        with held_back_load_report():
            with held_back_load_report():  # (nested, or another thread's: the filter stays until the last leaves)
                logger.warning("W LOAD REPORT from: this load")
            logger.warning("X LOAD REPORT from: this load")
            logger.warning("another warning")
            thread = threading.Thread(target=logger.warning, args=("Y LOAD REPORT from: another thread",))
            thread.start()
            thread.join()
        assert logger.filters == filters
        logger.warning("Z LOAD REPORT from: a later load")
        level = hf_logging.get_verbosity()
        cta.load_patched(FIXTURES / "patched_llama")
        assert hf_logging.get_verbosity() == level
    finally:
        logger.removeHandler(handler)
    assert records == ["another warning", "Y LOAD REPORT from: another thread", "Z LOAD REPORT from: a later load"]
    assert set(levels) == {level}
