"""Adapters of patched models carry their patch: every PEFT way of loading one gives the trained model exactly or
raises (``cta/peft_cta.py``), and ``patch_model`` leaves other models of a shared config alone."""

import json
import subprocess
import sys

import pytest
import torch
import transformers
from packaging import version
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import cta
from cta.patching_cta import is_patched, patch_model

peft = pytest.importorskip("peft")
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model  # noqa: E402

SPEC = dict(pde_type="diffusion", pde_steps=2, placement=["value", "block_output"])
OTHER_SPEC = dict(pde_type="diffusion", pde_steps=4, placement=["value", "block_output"])
KINDS = ("lora_pde", "pde_alone")
BASES = ("plain", "same_spec", "other_spec")


def tiny_config():
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def batch():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the padding walls must load too
    return ids, mask


def logits(model, ids, mask):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The plain base, a base patched with the adapters' spec and one with another spec (saved checkpoints), and per
    kind a trained adapter with its logits."""
    root = tmp_path_factory.mktemp("adapters")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(root / "plain")
    for name, spec in (("same_spec", SPEC), ("other_spec", OTHER_SPEC)):
        patch_model(LlamaForCausalLM.from_pretrained(root / "plain"), **spec).save_pretrained(root / name)
    ids, mask = batch()
    expected = {}
    for kind in KINDS:
        model = patch_model(LlamaForCausalLM.from_pretrained(root / "plain"), **SPEC)
        targets = ["q_proj", "v_proj"] if kind == "lora_pde" else []
        peft_model = get_peft_model(model, cta.CTALoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM",
                                                             lora_dropout=0.0))
        optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
        peft_model.train()
        for _ in range(3):
            peft_model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        trained = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
        assert any("_pde." in n for n in trained) and (kind == "pde_alone") != any("lora_" in n for n in trained)
        with torch.no_grad():  # coefficients far from the identity, so that a dropped PDE shows
            for name, param in trained.items():
                if "_pde." in name:
                    param.fill_(2.0)
        expected[kind] = logits(peft_model, ids, mask)
        with torch.no_grad():
            for name, param in trained.items():
                if "_pde." in name:
                    param.fill_(-30.0)  # projected coefficient ~0: the PDE off
        assert (logits(peft_model, ids, mask) - expected[kind]).abs().max() > 1e-3, "the PDE does not change logits"
        with torch.no_grad():
            for name, param in trained.items():
                if "_pde." in name:
                    param.fill_(2.0)
        peft_model.save_pretrained(root / kind)
    return root, expected


def base_model(root, base):
    return AutoModelForCausalLM.from_pretrained(root / base)  # `import cta` registered the patched types


def load_peft_model(root, kind, base):
    return PeftModel.from_pretrained(base_model(root, base), root / kind)


def load_auto_peft(root, kind, base, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    for file in (root / kind).iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(root / base)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return AutoPeftModelForCausalLM.from_pretrained(folder)


def load_adapter_method(root, kind, base):
    model = base_model(root, base)
    model.load_adapter(str(root / kind))
    return model


LOADERS = {"PeftModel.from_pretrained": load_peft_model, "AutoPeftModelForCausalLM": load_auto_peft,
           "model.load_adapter": load_adapter_method}


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_every_load_path_is_exact_or_raises(folders, loader, kind, base, tmp_path):
    root, expected = folders
    args = (root, kind, base, tmp_path) if loader == "AutoPeftModelForCausalLM" else (root, kind, base)
    if loader == "model.load_adapter" and version.parse(transformers.__version__) < version.parse("5.18"):
        # (transformers before 5.18 loads no modules_to_save there: the coefficients would stay at their init)
        with pytest.raises(ValueError, match="does not load an adapter's `modules_to_save`"):
            LOADERS[loader](*args)
        return
    if base == "other_spec":
        with pytest.raises(ValueError, match=r"trained with the patch .*pde_steps=2.* patched with .*pde_steps=4"):
            LOADERS[loader](*args)
        return
    model = LOADERS[loader](*args)
    assert is_patched(model if loader == "model.load_adapter" else model.get_base_model())
    torch.testing.assert_close(logits(model, *batch()), expected[kind], atol=1e-5, rtol=0)


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
