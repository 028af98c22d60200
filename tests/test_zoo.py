"""The zoo: patch_model on a tiny random model of every covered architecture (``tests/zoo_models.py``), each checked
against an independent expectation: the unpatched model (identity init), ``use_cache=False`` generation (cached
greedy tokens, DynamicCache and StaticCache, with and without left padding), the same inputs with a changed future
(no leak), the saved folder reloaded (``cta.load_patched``; a subset also with ``trust_remote_code=True`` where cta is
not installed), LoRA by PEFT's target names for the base model through ``cta.CTALoraConfig``, and every head of the
family. Plus a walk over every model type the installed transformers ships: covered here, or refused with a reason.

Every covered type gets every check but one: the reload where cta is not installed (a subprocess) runs on
:data:`REMOTE` (structural variants: separate and fused value projections, OPT's decoder-only call, `layer_past`
layers, encoders; a causal / masked LM and a generic sequence-classification head each), to keep the zoo within a
few minutes on 2 CPU cores.
"""

import json
import re

import pytest
import torch
import transformers
from packaging import version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import cta
from cta.patching_cta import load_patched, patch_model, pde_modules, supported_placements
from cta.patching_structure import REFUSED_BEFORE, model_type_refusal
from pde_testing import randomize_pde as randomize_interior
from remote_code_env import run_in_clean_env
from zoo_models import (ALL_DECODERS, ALL_ENCODERS, DECODERS, ENCODERS, ISSUE_ENCODERS, RELEASE_REFUSED, VOCAB, ZOO,
                        head_classes, tiny_model)

# StaticCache refused before the first token: these build their own 2D generation mask for a static cache (BLOOM's
# ALiBi), which cannot be sized for a cache whose layers hold the PDE state (generation_cta).
STATIC_REFUSED = {"bloom"}


def randomize_pde(model, seed=0):
    return randomize_interior(model, seed, margin=0.2)


def inputs(model_type, length=8, pad=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding for decoders
    return ids, (mask if model_type in DECODERS else mask.flip(-1))


def outputs(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return out.logits if getattr(out, "logits", None) is not None else (
        out.start_logits if getattr(out, "start_logits", None) is not None else out.last_hidden_state)


def patched(model_type, **kwargs):
    model = tiny_model(model_type, **kwargs)
    patch_model(model, pde_type="wave", pde_steps=2, placement=supported_placements(model), init="paper",
                per_channel=True)
    randomize_pde(model)
    return model


def greedy(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                              pad_token_id=0, **kwargs)


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_zoo_exact(model_type, tmp_path):
    plain = tiny_model(model_type)
    placements = supported_placements(plain)
    assert {"embedding", "block_output"} <= set(placements)
    ids, mask = inputs(model_type)
    reference = outputs(plain, ids, mask)
    patch_model(plain, pde_steps=2, placement=placements)  # identity init
    assert plain.config.cta_patch["causal"] == (model_type in DECODERS)
    torch.testing.assert_close(outputs(plain, ids, mask), reference, atol=1e-5, rtol=0)

    model = patched(model_type)
    expected = outputs(model, ids, mask)
    assert (expected - reference).abs().max() > 1e-4  # the PDE sites run
    if model_type in DECODERS:
        full = outputs(model, ids, None)
        changed = ids.clone()
        changed[:, 5:] = (changed[:, 5:] + 5) % VOCAB
        torch.testing.assert_close(outputs(model, changed, None)[:, :5], full[:, :5], atol=1e-5, rtol=0)
        for left_padding in (False, True):
            m = mask if left_padding else torch.ones_like(mask)
            uncached = greedy(model, ids, m, use_cache=False)
            assert torch.equal(greedy(model, ids, m), uncached), f"DynamicCache, left padding {left_padding}"
            if not left_padding and model_type not in STATIC_REFUSED:  # (static with left padding: its own test)
                static = greedy(model, ids, m, cache_implementation="static", disable_compile=True)
                assert torch.equal(static, uncached), "StaticCache"
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"].startswith("cta_patched_")
    reloaded = load_patched(tmp_path).eval()
    assert type(reloaded) is type(model)
    torch.testing.assert_close(outputs(reloaded, ids, mask), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_zoo_static_cache_left_padding(model_type):
    model = patched(model_type)
    ids, mask = inputs(model_type)
    if model_type in STATIC_REFUSED:
        with pytest.raises(ValueError, match="a static cache is refused: bloom builds its own 2D attention mask"):
            greedy(model, ids, mask, cache_implementation="static", disable_compile=True)
        return
    static = greedy(model, ids, mask, cache_implementation="static", disable_compile=True)
    assert torch.equal(static, greedy(model, ids, mask, use_cache=False))


def lora_targets(model_type, model):
    """PEFT's default LoRA targets of the base model's type, else its value projection's name."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in TARGETS.get(model_type, ()) if t in present]  # (DeepSeek-V3 with q_lora_rank: no q_proj)
    if targets:
        return targets
    from cta.patching_structure import find_layer_stack

    from transformers.pytorch_utils import Conv1D

    # No PEFT default for this type: every plain linear layer of a block, by name (as a user would write them), but
    # those that hold a PDE site (a Linear that is the attention / MLP output of BioGPT-like blocks: PEFT refuses a
    # saved module inside a LoRA layer) and subclasses (MoE routers that return tuples).
    _, layers, _ = find_layer_stack(model)
    return sorted({name.rsplit(".", 1)[-1] for name, module in layers[0].named_modules()
                   if type(module) in (torch.nn.Linear, Conv1D) and not any(
                       child.startswith("cta_") for child, _ in module.named_children())})


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_zoo_lora_trains_and_reloads(model_type, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel, get_peft_model

    model = patched(model_type)
    config = cta.CTALoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(model_type, model), lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    ids, mask = inputs(model_type)
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    peft_model.train()
    for _ in range(2):
        peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()
    changed = {n for n, p in peft_model.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert any("lora_B" in n for n in changed) and any("_pde." in n for n in changed), sorted(changed)
    expected = outputs(peft_model, ids, mask)
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_model(model_type), tmp_path).eval()  # the adapter patches the plain base
    torch.testing.assert_close(outputs(reloaded, ids, mask), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_zoo_every_head(model_type, tmp_path):
    """Base model, causal LM / masked LM, sequence and token classification, QA: identity keeps the outputs, the
    patched head saves and reloads as itself (transformers' generic heads build their backbone with AutoModel: it
    must be patched once, not twice)."""
    ids, mask = inputs(model_type)
    heads = head_classes(model_type)
    assert len(heads) >= 2 or model_type == "trocr", heads  # (TrOCR ships its causal-LM head alone)
    for auto, name in heads.items():
        plain = tiny_model(model_type, head=auto)
        assert type(plain).__name__ == name
        reference = outputs(plain, ids, mask)
        patch_model(plain, pde_steps=2, placement=supported_placements(plain))
        torch.testing.assert_close(outputs(plain, ids, mask), reference, atol=1e-5, rtol=0, msg=name)
        model = patched(model_type, head=auto)
        expected = outputs(model, ids, mask)
        model.save_pretrained(tmp_path / name)
        reloaded = load_patched(tmp_path / name).eval()
        assert type(reloaded) is type(model) and len(pde_modules(reloaded)) == len(pde_modules(model)), name
        torch.testing.assert_close(outputs(reloaded, ids, mask), expected, atol=1e-5, rtol=0, msg=name)


REMOTE = ["llama", "gpt_neox", "opt", "falcon", "bert", "distilbert", "modernbert"]
REMOTE_SCRIPT = """
import json, torch, transformers
results = {{}}
for path, auto_name, ids, mask in {cases!r}:
    model = getattr(transformers, auto_name).from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        results[path] = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.tolist()
print("RESULT " + json.dumps(results))
"""


def test_zoo_reloads_with_remote_code_without_cta(tmp_path):
    """A subset (the structural variants, a generic sequence-classification head among them) loads through
    ``AutoModel*.from_pretrained(..., trust_remote_code=True)`` where cta is not installed, with the same logits."""
    cases, expected = [], {}
    for model_type in REMOTE:
        for auto in ("AutoModelForCausalLM" if model_type in DECODERS else "AutoModelForMaskedLM",
                     "AutoModelForSequenceClassification"):
            model = patched(model_type, head=auto)
            path = str(tmp_path / f"{model_type}-{auto}")
            model.save_pretrained(path)
            ids, mask = inputs(model_type)
            expected[path] = outputs(model, ids, mask)
            cases.append((path, auto, ids.tolist(), mask.tolist()))
    stdout = run_in_clean_env(REMOTE_SCRIPT.format(cases=cases))
    results = json.loads([line for line in stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    for path, want in expected.items():
        torch.testing.assert_close(torch.tensor(results[path]), want, atol=1e-5, rtol=0, msg=path)


def test_zoo_covers_the_issue_lists():
    """Counted over what the installed transformers ships (DECODERS / ENCODERS are version-dependent, see
    zoo_models): the zoo leaves out only the types the release does not have or that patch_model refuses on it."""
    shipped = set(CONFIG_MAPPING_NAMES)
    assert set(DECODERS) == (set(ALL_DECODERS) & shipped) - set(RELEASE_REFUSED)
    assert set(ENCODERS) == (set(ALL_ENCODERS) & shipped) - set(RELEASE_REFUSED)
    assert len(DECODERS) >= 55
    assert set(ISSUE_ENCODERS) == {"bert", "roberta", "distilbert", "deberta-v2", "electra", "modernbert",
                                   "xlm-roberta"}
    assert set(ISSUE_ENCODERS) <= set(ENCODERS)
    for model_type in DECODERS:
        assert model_type_refusal(model_type) is None, model_type


def test_zoo_types_the_installed_release_breaks_are_refused_before_the_model_is_touched():
    """The zoo's types whose model code in the installed transformers cannot work (REFUSED_BEFORE; none on the newest
    release): patch_model refuses them by type, naming the architecture and the release, and leaves the model as it
    was. On a release that fixed them, they are in the zoo and not refused."""
    for model_type, (since, _) in REFUSED_BEFORE.items():
        if model_type in CONFIG_MAPPING_NAMES and (model_type in ALL_DECODERS or model_type in ALL_ENCODERS):
            fixed = version.parse(transformers.__version__) >= version.parse(since)
            assert (model_type in ZOO) == fixed and (model_type in RELEASE_REFUSED) == (not fixed), model_type
    for model_type, reason in RELEASE_REFUSED.items():
        assert model_type_refusal(model_type) == reason and transformers.__version__ in reason, model_type
        model = tiny_model(model_type)
        before = {n: p.clone() for n, p in model.state_dict().items()}
        modules = [n for n, _ in model.named_modules()]
        named = rf"does not support .*\(model_type '{re.escape(model_type)}'\): {re.escape(reason)}"
        with pytest.raises(ValueError, match=named):
            patch_model(model, pde_steps=2, placement=["embedding", "block_output"])
        assert [n for n, _ in model.named_modules()] == modules and not pde_modules(model), model_type
        assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items()), model_type


@pytest.mark.parametrize("model_type", ["mamba", "jamba", "falcon_h1", "lfm2", "qwen3_next", "recurrent_gemma",
                                        "rwkv"])
def test_recurrent_state_architectures_are_refused_up_front(model_type):
    reason = model_type_refusal(model_type)
    assert reason is not None and ("recurrent" in reason or "state" in reason), reason


# Text decoders / encoders that patch_model does not refuse but the zoo has no working tiny config for yet (their
# config needs more than TINY gives): listed, so that a new release's types still fail the walk below.
NOT_CHECKED = {
    "axk1": "tiny config: rotary / head sizes", "cohere_compass_text": "tiny config: layer types",
    "dbrx": "tiny config: nested attention / FFN configs", "dory": "tiny config: head sizes",
    "esmc": "tiny config: no grouped-query attention", "glm4_moe_lite": "tiny config: MLA sizes",
    "longcat_flash": "tiny config: MLA sizes", "mobilebert": "tiny config: bottleneck sizes",
    "sarvam_mla": "tiny config: MLA sizes", "squeezebert": "tiny config: embedding size",
    "xmod": "needs a default language adapter", "youtu": "tiny config: MLA sizes",
    "big_bird": "block-sparse attention pads inside the model (a tiny input falls back to full attention)",
}


def test_every_model_type_is_covered_or_refused_with_a_reason():
    """A new transformers release's architectures show up here: each model type it ships is in the zoo or refused by
    patch_model with a reason (or listed in NOT_CHECKED)."""
    assert not set(NOT_CHECKED) & set(ZOO)
    unaccounted = [t for t in sorted(CONFIG_MAPPING_NAMES)
                   if t not in ZOO and t not in NOT_CHECKED and not model_type_refusal(t)]
    assert not unaccounted, f"model types neither covered by the zoo nor refused with a reason: {unaccounted}"


def test_readme_table_of_architectures_is_generated_from_the_code():
    """The table lists the installed release's model types and refusals, so the committed file can only match on the
    transformers release it was generated with (recorded in ARCHITECTURES.md). On another release the script refuses
    to compare (exit 2) and renders that release's own table, every zoo type in it."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = root / "scripts" / "supported_architectures.py"
    recorded = re.search(r"with transformers ([^ ]+) \(", (root / "ARCHITECTURES.md").read_text())
    assert recorded, "ARCHITECTURES.md does not record the transformers release it was generated with"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    if recorded.group(1) == transformers.__version__:
        assert result.returncode == 0, result.stdout + result.stderr
        return
    assert result.returncode == 2, result.stdout + result.stderr
    spec = importlib.util.spec_from_file_location("supported_architectures", script)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    page, _ = generator.table()
    assert f"with transformers {transformers.__version__} (" in page
    assert [t for t in sorted(ZOO) if f"| `{t}` |" not in page] == []
