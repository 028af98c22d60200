"""Adapters of patched models carry their patch: every PEFT way of loading one gives the trained model exactly or
raises (``cta/peft_cta.py``), and ``patch_model`` leaves other models of a shared config alone."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version
from transformers import LlamaConfig, LlamaForCausalLM

import cta
from cta.patching_cta import is_patched, patch_model

peft = pytest.importorskip("peft")
from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model  # noqa: E402

def _script(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


loads = _script("adapter_loads")  # the load matrix of docs/adapters.md (results/adapter_loads.md)
SPEC, OTHER_SPEC, tiny_config, batch = loads.SPEC, loads.OTHER_SPEC, loads.tiny_config, loads.batch


def logits(model, ids, mask):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The plain base, a base patched with the adapters' spec and one with another spec (saved checkpoints), and per
    kind a trained adapter with its logits (LoRA + PDE, PDE alone)."""
    root = tmp_path_factory.mktemp("adapters")
    trained = loads.make_adapters(root)
    for kind, (expected, pde_off) in trained.items():
        assert (expected - pde_off).abs().max() > 1e-3, f"{kind}: the PDE does not change the logits"
    return root, {kind: expected for kind, (expected, _) in trained.items()}


@pytest.mark.parametrize("base", loads.BASES)
@pytest.mark.parametrize("kind", sorted(loads.KINDS))
@pytest.mark.parametrize("loader", loads.LOADERS)
def test_every_load_path_is_exact_or_raises(folders, loader, kind, base):
    root, expected = folders
    if loader == "model.load_adapter" and version.parse(transformers.__version__) < version.parse("5.18"):
        # (transformers before 5.18 loads no modules_to_save there: the coefficients would stay at their init)
        with pytest.raises(ValueError, match="does not load an adapter's `modules_to_save`"):
            loads.load(root, loader, kind, base)
        return
    if base == "other_spec":
        with pytest.raises(ValueError, match=r"trained with the patch .*pde_steps=2.* patched with .*pde_steps=4"):
            loads.load(root, loader, kind, base)
        return
    model = loads.load(root, loader, kind, base)
    assert is_patched(model if loader == "model.load_adapter" else model.get_base_model())
    torch.testing.assert_close(logits(model, *batch()), expected[kind], atol=1e-5, rtol=0)


def test_committed_load_matrix_reads_as_the_tests_say():
    """results/adapter_loads.json (docs/adapters.md's table): exact where the tests above load, an error where they
    raise."""
    result = json.loads((Path(__file__).resolve().parents[1] / "results" / "adapter_loads.json").read_text())
    assert len(result["rows"]) == len(loads.LOADERS) * len(loads.KINDS) * len(loads.BASES)
    assert result["pde_effect"] > 1e-3
    for row in result["rows"]:
        if row["base"] == "other_spec":
            assert "patched with" in row["error"], row
        else:
            assert row.get("max_abs_diff", 1.0) < 1e-5 or "modules_to_save" in row.get("error", ""), row


def test_adapter_records_the_patch(folders):
    root, _ = folders
    config = json.loads((root / "lora_pde" / "adapter_config.json").read_text())
    assert config["peft_type"] == "CTA_LORA" and config["cta_version"] == cta.__version__
    recorded = {k: config["cta_patch"][k] for k in ("pde_type", "pde_steps", "placement", "per_channel", "causal")}
    assert recorded == {**SPEC, "per_channel": False, "causal": True}
    assert sorted(config["modules_to_save"]) == ["cta_block_output_pde", "cta_value_pde"]
    alone = json.loads((root / "pde_alone" / "adapter_config.json").read_text())
    assert alone["target_modules"] == peft.utils.constants.DUMMY_TARGET_MODULES


def test_without_cta_peft_refuses_the_adapter(folders):
    """Where `cta` is not imported, PEFT does not know the adapter's type: it raises instead of dropping the PDE."""
    root, _ = folders
    script = (
        "import sys\nfrom transformers import LlamaForCausalLM\nfrom peft import PeftModel\n"
        f"base = LlamaForCausalLM.from_pretrained({str(root / 'plain')!r})\n"
        "try:\n"
        f"    PeftModel.from_pretrained(base, {str(root / 'lora_pde')!r})\n"
        "except Exception as err:\n"
        "    print('REFUSED', type(err).__name__, err)\n"
        "    sys.exit(0)\n"
        "print('LOADED', 'cta' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED" in out.stdout and "CTA_LORA" in out.stdout, out.stdout + out.stderr[-2000:]


def test_plain_peft_config_on_a_patched_model_is_refused():
    model = patch_model(LlamaForCausalLM(tiny_config()), **SPEC)
    with pytest.raises(ValueError, match="does not record this model's CTA patch.*CTALoraConfig"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))


def test_cta_config_needs_a_patch():
    with pytest.raises(ValueError, match="not patched with CTA and the config records no patch"):
        get_peft_model(LlamaForCausalLM(tiny_config()), cta.CTALoraConfig(r=4, target_modules=["q_proj"]))


def test_auto_peft_model_without_task_type_loads_the_plain_class(tmp_path):
    """Without a task type PEFT saves the base class in `auto_mapping`: the plain transformers class (the patched one
    lives in cta, outside AutoPeftModel's import allowlist); the adapter patches it."""
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(tmp_path / "plain")
    model = patch_model(LlamaForCausalLM.from_pretrained(tmp_path / "plain"), **SPEC)
    peft_model = get_peft_model(model, cta.CTALoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "_pde." in name and param.requires_grad:
                param.fill_(1.0)
    ids, mask = batch()
    expected = logits(peft_model, ids, mask)
    peft_model.save_pretrained(tmp_path / "adapter")
    mapping = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["auto_mapping"]
    assert mapping["base_model_class"] == "LlamaForCausalLM" and mapping["parent_library"].startswith("transformers.")
    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded, ids, mask), expected, atol=1e-5, rtol=0)


def test_patch_model_leaves_other_models_of_the_config_alone(tmp_path):
    config = tiny_config()
    first, second = LlamaForCausalLM(config), LlamaForCausalLM(config)
    patch_model(first, **SPEC)
    assert not is_patched(second) and type(second.config) is LlamaConfig and not hasattr(config, "cta_patch")
    assert all(getattr(m, "config", first.config) is first.config for m in first.modules())  # one config per model
    patch_model(second, **OTHER_SPEC)  # not "already patched"
    LlamaForCausalLM(config).save_pretrained(tmp_path / "third")
    saved = json.loads((tmp_path / "third" / "config.json").read_text())
    assert saved["model_type"] == "llama" and "cta_patch" not in saved
    assert saved["architectures"] == ["LlamaForCausalLM"]
