"""Adapters of patched models carry their patch: every PEFT way of loading one gives the trained model exactly or
raises (``cta/peft_cta.py``); so does every operation after the first load (a second adapter, ``add_adapter``,
``add_weighted_adapter``, ``unload()``, transformers' ``load_adapter``, patching a model PEFT adapts), each compared
with a model made the right way (trained, reloaded onto a fresh plain base, the plain base itself); the documented
flow warns for nothing of cta's; and ``patch_model`` leaves other models of a shared config alone."""

import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version
from transformers import LlamaConfig, LlamaForCausalLM

import cta
from cta.patching_cta import is_patched, make_patch_spec, patch_model, unpatch_model
from shared_data import STORIES260K

peft = pytest.importorskip("peft")
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model  # noqa: E402

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


# ---------------------------------------------------------------------------------------------------------------------
# Operations after the first load: exact, or an error before anything changes
# ---------------------------------------------------------------------------------------------------------------------

OTHER_TYPE = dict(SPEC, pde_type="reaction_diffusion")


def _train(root, name, spec, seed, pde_value, targets=("q_proj", "v_proj")):
    """Trains and saves adapter ``name`` of the plain base patched with ``spec`` (LoRA a few SGD steps, the PDE then
    set to ``pde_value``, away from its initial 0); returns its logits."""
    torch.manual_seed(seed)
    model = patch_model(LlamaForCausalLM.from_pretrained(root / "plain"), **spec)
    peft_model = get_peft_model(model, cta.CTALoraConfig(r=4, target_modules=list(targets), lora_dropout=0.0))
    _sgd(peft_model, steps=3)
    loads._fill_pde(peft_model, pde_value)
    expected = logits(peft_model, *batch())
    peft_model.save_pretrained(root / name)
    return expected


def _sgd(model, steps):
    ids, mask = batch()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    for _ in range(steps):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def more(folders):
    """Besides ``folders``' adapters (``lora_pde``: SPEC, PDE at 2.0): one more of SPEC (other LoRA, PDE at 1.0), one
    of SPEC with 4 steps, one of reaction-diffusion, one of SPEC with ``init="paper"``; the logits of each as
    trained."""
    root, expected = folders
    trained = {"lora_pde": expected["lora_pde"], "second": _train(root, "second", SPEC, 1, 1.0),
               "other_steps": _train(root, "other_steps", OTHER_SPEC, 2, 1.5),
               "other_type": _train(root, "other_type", OTHER_TYPE, 3, 1.5),
               "paper_init": _train(root, "paper_init", dict(SPEC, init="paper"), 4, 1.0)}
    assert (trained["second"] - trained["lora_pde"]).abs().max() > 1e-2
    return root, trained


def _plain(root):
    return LlamaForCausalLM.from_pretrained(root / "plain")


def _state(model):
    """What an operation that raises must leave as it was: the adapters, every parameter's name and value."""
    return sorted(getattr(model, "peft_config", {})), {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_unchanged(model, before, expected):
    names, params = _state(model)
    assert names == before[0] and params.keys() == before[1].keys()
    for name, param in params.items():
        torch.testing.assert_close(param, before[1][name], atol=0, rtol=0, msg=name)
    torch.testing.assert_close(logits(model, *batch()), expected, atol=1e-5, rtol=0)


def test_second_adapter_of_the_same_patch_runs_its_own_pde(more):
    """Each adapter keeps its own PDE coefficients (PEFT's `modules_to_save` copies); switching is exact both ways."""
    root, trained = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    model.load_adapter(root / "second", "second")
    torch.testing.assert_close(logits(model, *batch()), trained["lora_pde"], atol=1e-5, rtol=0)  # (not activated)
    model.set_adapter("second")
    torch.testing.assert_close(logits(model, *batch()), trained["second"], atol=1e-5, rtol=0)
    model.set_adapter("default")
    torch.testing.assert_close(logits(model, *batch()), trained["lora_pde"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("first, second, named", [
    ("lora_pde", "other_steps", (r"pde_steps=4", r"pde_steps=2")),
    ("lora_pde", "other_type", (r"pde_type='reaction_diffusion'", r"pde_type='diffusion'")),
    ("other_type", "lora_pde", (r"pde_type='diffusion'", r"pde_type='reaction_diffusion'")),  # (was a bare KeyError)
])
def test_second_adapter_of_another_patch_raises_naming_both(more, first, second, named):
    root, trained = more
    model = PeftModel.from_pretrained(_plain(root), root / first)
    before = _state(model)
    message = (rf"'b' was trained with the patch \(.*{named[0]}.*\), but this model carries adapters \['default'\] "
               rf"under the patch \(.*{named[1]}.*PeftModel.from_pretrained")
    with pytest.raises(ValueError, match=message):
        model.load_adapter(root / second, "b")
    _assert_unchanged(model, before, trained[first])


def test_add_adapter_records_the_patch_and_trains_its_own_pde(more, tmp_path):
    root, trained = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde", is_trainable=True)
    model.add_adapter("b", cta.CTALoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    config = model.peft_config["b"]
    assert cta.peft_cta.patch_summary(config.cta_patch) == cta.peft_cta.patch_summary(
        make_patch_spec(tiny_config(), **SPEC))
    assert sorted(config.modules_to_save) == ["cta_block_output_pde", "cta_value_pde"]
    model.set_adapter("b")
    pde = {n: p for n, p in model.named_parameters() if ".modules_to_save.b." in n}
    assert pde and all(p.requires_grad for p in pde.values())
    assert all(float(p.abs().max()) == 0.0 for p in pde.values())  # b starts at the patch's initial coefficients
    loads._fill_pde(model, 1.0)  # ("trained": b's own coefficients, default's are not trainable now)
    _sgd(model, steps=2)
    assert all(float(p.abs().max()) > 0.5 for p in pde.values())
    expected = logits(model, *batch())
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(_plain(root), tmp_path / "b")  # (PEFT saves a second adapter in a subfolder)
    torch.testing.assert_close(logits(reloaded, *batch()), expected, atol=1e-5, rtol=0)
    model.set_adapter("default")
    torch.testing.assert_close(logits(model, *batch()), trained["lora_pde"], atol=1e-5, rtol=0)


def test_add_adapter_of_another_patch_raises(more):
    root, trained = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    before = _state(model)
    other = cta.CTALoraConfig(r=4, target_modules=["q_proj"], cta_patch=make_patch_spec(tiny_config(), **OTHER_SPEC))
    with pytest.raises(ValueError, match=r"'b' was trained with the patch \(.*pde_steps=4.*pde_steps=2"):
        model.add_adapter("b", other)
    _assert_unchanged(model, before, trained["lora_pde"])


@pytest.mark.parametrize("deleted", ["default", "second"])
def test_delete_adapter_leaves_the_other_exact(more, deleted):
    root, trained = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    model.load_adapter(root / "second", "second")
    kept = {"default": "second", "second": "default"}[deleted]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PEFT: the deleted adapter was active; it activates the other)
        model.delete_adapter(deleted)
    assert model.active_adapters == [kept]
    torch.testing.assert_close(logits(model, *batch()), trained[{"default": "lora_pde"}.get(kept, kept)], atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("adapter", ["lora_pde", "paper_init"])
def test_disable_adapter_gives_the_patch_at_its_initial_coefficients(more, adapter):
    """docs/adapters.md: the plain model's outputs under init="identity" only."""
    root, _ = more
    model = PeftModel.from_pretrained(_plain(root), root / adapter)
    init = "paper" if adapter == "paper_init" else "identity"
    expected = logits(patch_model(_plain(root), init=init, **SPEC), *batch())
    plain = logits(_plain(root), *batch())
    with model.disable_adapter():
        got = logits(model, *batch())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert ((got - plain).abs().max() > 1e-3) == (init == "paper")


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_weighted_adapter_of_one_adapter_keeps_its_pde(more, tmp_path, weight):
    """The weight scales LoRA's delta; the PDE coefficients are the adapter's. Expected: the adapter loaded anew with
    its LoRA B scaled by the weight (what a linear combination of one adapter is)."""
    root, trained = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    model.add_weighted_adapter(["default"], [weight], "scaled", combination_type="linear")
    model.set_adapter("scaled")
    got = logits(model, *batch())
    expected = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    with torch.no_grad():
        for name, param in expected.named_parameters():
            if "lora_B" in name:
                param.mul_(weight)
    torch.testing.assert_close(got, logits(expected, *batch()), atol=1e-5, rtol=0)
    if weight == 1.0:
        torch.testing.assert_close(got, trained["lora_pde"], atol=1e-5, rtol=0)
        model.save_pretrained(tmp_path, selected_adapters=["scaled"])
        reloaded = PeftModel.from_pretrained(_plain(root), tmp_path / "scaled")
        torch.testing.assert_close(logits(reloaded, *batch()), got, atol=1e-5, rtol=0)


def test_weighted_adapter_of_two_cta_adapters_raises(more):
    root, _ = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    model.load_adapter(root / "second", "second")
    with pytest.raises(ValueError, match="modules_to_save"):
        model.add_weighted_adapter(["default", "second"], [0.5, 0.5], "mix", combination_type="linear")


def test_unload_gives_back_the_plain_base(more):
    root, _ = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    model.load_adapter(root / "second", "second")
    model.set_adapter("second")
    base = model.unload()
    assert type(base) is LlamaForCausalLM and not is_patched(base) and type(base.config) is LlamaConfig
    assert not [n for n, _ in base.named_modules() if "cta_" in n or "lora" in n]
    torch.testing.assert_close(logits(base, *batch()), logits(_plain(root), *batch()), atol=0, rtol=0)


def test_unload_gives_back_a_patched_base_with_its_own_coefficients(more):
    root, _ = more
    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(root / "same_spec"),
                                      root / "lora_pde")
    base = model.unload()
    fresh = transformers.AutoModelForCausalLM.from_pretrained(root / "same_spec")
    assert type(base) is type(fresh) and is_patched(base)
    assert sorted(n for n, _ in base.named_parameters()) == sorted(n for n, _ in fresh.named_parameters())
    torch.testing.assert_close(logits(base, *batch()), logits(fresh, *batch()), atol=0, rtol=0)


def test_merge_and_unload_keeps_the_trained_model(more):
    root, trained = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    merged = model.merge_and_unload()
    assert is_patched(merged)
    torch.testing.assert_close(logits(merged, *batch()), trained["lora_pde"], atol=1e-5, rtol=0)


@pytest.mark.skipif(version.parse(transformers.__version__) < version.parse("5.18"),
                    reason="transformers before 5.18 refuses the first load_adapter already (test above)")
def test_transformers_load_adapter_of_a_second_adapter_raises(more):
    root, trained = more
    model = _plain(root)
    model.load_adapter(str(root / "lora_pde"))
    before = _state(model)
    with pytest.raises(ValueError, match=r"second CTA adapter \('a2'.*initial coefficients.*PeftModel.from_pretrained"):
        model.load_adapter(str(root / "second"), adapter_name="a2")
    _assert_unchanged(model, before, trained["lora_pde"])


def test_patching_a_model_peft_adapts_raises(more, tmp_path):
    """A plain LoRA adapter (PEFT's way and transformers'): patching its model would train PDE coefficients that the
    saved adapter does not hold."""
    root, _ = more
    peft_model = get_peft_model(_plain(root), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    base = peft_model.get_base_model()
    before = logits(peft_model, *batch())
    with pytest.raises(ValueError, match=r"PEFT already adapts this LlamaForCausalLM.*Patch the plain model first"):
        patch_model(base, **SPEC)
    with pytest.raises(ValueError, match=r"`model` is a PEFT model \(PeftModel\)"):
        patch_model(peft_model, **SPEC)
    assert not is_patched(base) and not [n for n, _ in base.named_modules() if "cta_" in n]
    torch.testing.assert_close(logits(peft_model, *batch()), before, atol=0, rtol=0)
    peft_model.save_pretrained(tmp_path)
    loaded = _plain(root)
    loaded.load_adapter(str(tmp_path))  # transformers' way
    with pytest.raises(ValueError, match=r"PEFT already adapts this LlamaForCausalLM"):
        patch_model(loaded, **SPEC)
    unloaded = peft_model.unload()
    assert is_patched(patch_model(unloaded, **SPEC))  # PEFT gone: patching is fine again


def test_unpatching_a_model_peft_adapts_raises(more):
    root, trained = more
    model = PeftModel.from_pretrained(_plain(root), root / "lora_pde")
    with pytest.raises(ValueError, match=r"PEFT adapts this CTAPatchedLlamaForCausalLM.*unload\(\)"):
        unpatch_model(model.get_base_model())
    torch.testing.assert_close(logits(model, *batch()), trained["lora_pde"], atol=1e-5, rtol=0)


@contextlib.contextmanager
def _collected_warnings():
    """Every warning transformers' and PEFT's loggers emit, and every Python warning, while the block runs."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    handler = Collect(logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("transformers", "peft")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    records += [f"{w.category.__name__}: {w.message} ({w.filename})" for w in caught]


# peft 0.21's PeftModel reads transformers' deprecated `is_gradient_checkpointing`: peft's call, for any model.
NOT_OURS = ("`is_gradient_checkpointing` is deprecated",)


def test_documented_flow_warns_for_nothing_of_ours(tmp_path):
    """docs/adapters.md's flow on a real checkpoint (stories260K): patch, get_peft_model, train, save, load every PEFT
    way. No warning but peft's own; in particular not transformers' "model of type `llama` to instantiate a model of
    type `cta_patched_llama`" (PEFT reads the base's config with the patched config class when it saves)."""
    base_dir = STORIES260K  # (shipped in examples/demo_data: no skip on a bare clone)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with _collected_warnings() as records:
        model = patch_model(transformers.AutoModelForCausalLM.from_pretrained(base_dir), pde_type="diffusion",
                            pde_steps=2, placement="block_output")
        model = get_peft_model(model, cta.CTALoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                        task_type="CAUSAL_LM"))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.train()
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        expected = logits(model, ids, torch.ones_like(ids))
        model.save_pretrained(tmp_path / "adapter")
        reloaded = [PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir),
                                              tmp_path / "adapter"),
                    AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")]
    ours = [r for r in records if not any(text in r for text in NOT_OURS)]
    assert not ours, ours
    for model in reloaded:
        torch.testing.assert_close(logits(model, ids, torch.ones_like(ids)), expected, atol=1e-5, rtol=0)


def test_patched_config_class_reads_a_plain_config_as_plain(folders):
    root, _ = folders
    patched = type(patch_model(LlamaForCausalLM(tiny_config()), **SPEC).config)
    config = patched.from_pretrained(root / "plain")
    assert type(config) is LlamaConfig and not hasattr(config, "cta_patch")
    assert type(patched.from_pretrained(root / "same_spec")) is patched
