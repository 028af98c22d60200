"""cta-hub for CTA adapters (``cta.CTALoraConfig``, PEFT type ``CTA_LORA``): ``export --adapter``, ``card --adapter``,
``push``.

* export of a LoRA + PDE adapter (Python API) and of a PDE-alone adapter (command line): the folder's files, the card's
  Hub metadata (parsed with ``huggingface_hub.ModelCard``), the PDE summary equal to the coefficients set before saving
  (non-identity values, so that a dropped PDE would show), and the load checks the export runs (``python -I``: with
  ``import cta`` the plain base + adapter gives the original's logits; without ``cta`` PEFT refuses it);
* the load check fails against a reference without the PDE;
* refusals: a plain LoRA adapter, a full checkpoint, pickle-only weights, a base model given only as a local path;
* push with ``HfApi`` mocked, ``cta-hub card --adapter`` and ``cta-hub export --help``.
"""

import contextlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

peft = pytest.importorskip("peft")

from huggingface_hub import ModelCard  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import cta  # noqa: E402
from cta import hub, hub_adapter  # noqa: E402

BASE_ID = "me/tiny-llama"


def _base_config():
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)


def _peft_site(name: str) -> str:
    return name.split(".modules_to_save.")[0].removeprefix("base_model.model.")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-adapter")
    torch.manual_seed(0)
    LlamaForCausalLM(_base_config()).save_pretrained(root / "base")
    out = {"root": root, "base": root / "base"}

    # LoRA + PDE: scalar diffusion coefficients, one value per site; LoRA B non-zero so that LoRA changes the output.
    model = cta.patch_model(LlamaForCausalLM.from_pretrained(root / "base"), pde_type="diffusion", pde_steps=2,
                            placement="block_output")
    lora = peft.get_peft_model(model, cta.CTALoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                        task_type="CAUSAL_LM"))
    expected = {}
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if ".modules_to_save.default." in name and name.endswith(".alpha"):
                param.fill_(0.1 + 0.2 * len(expected))
                expected[_peft_site(name)] = {"alpha": param.detach().clone()}
            elif "lora_B" in name:
                param.normal_(0, 0.05)
    lora.save_pretrained(root / "lora_pde")
    out["lora_pde"] = dict(dir=root / "lora_pde", coefficients=expected)

    # PDE alone: per-channel advection-diffusion at two placements (alpha per channel, beta per site).
    model = cta.patch_model(LlamaForCausalLM.from_pretrained(root / "base"), pde_type="advection_diffusion",
                            pde_steps=2, placement=["embedding", "block_output"], per_channel=True)
    pde_only = peft.get_peft_model(model, cta.CTALoraConfig(target_modules=[], task_type="CAUSAL_LM"))
    expected = {}
    with torch.no_grad():
        for name, param in pde_only.named_parameters():
            if ".modules_to_save.default." in name:
                site = expected.setdefault(_peft_site(name), {})
                param.copy_(torch.linspace(0.05, 0.2, param.numel()) if name.endswith(".alpha")
                            else torch.full_like(param, 0.1 * len(expected)))
                site[name.rsplit(".", 1)[-1]] = param.detach().clone()
    pde_only.save_pretrained(root / "pde_only")
    out["pde_only"] = dict(dir=root / "pde_only", coefficients=expected)

    plain = peft.get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"),
                                peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    plain.save_pretrained(root / "plain_lora")

    # the LoRA + PDE adapter through the API, its load checks comparing with the original folder loaded here
    out["lora_pde"]["report"] = hub_adapter.export_adapter_for_hub(
        root / "lora_pde", root / "lora_pde-hub", base_model=BASE_ID, base_model_dir=root / "base",
        repo_id="me/tiny-llama-cta-lora", datasets=["wikitext"], language=["en"])
    out["lora_pde"]["folder"] = root / "lora_pde-hub"
    # the PDE-alone adapter through the command line
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = hub.main(["export", "--adapter", str(root / "pde_only"), str(root / "pde_only-hub"), "--base-model",
                         BASE_ID, "--base-model-dir", str(root / "base"), "--license", "mit"])
    assert code == 0, printed.getvalue()
    out["pde_only"].update(folder=root / "pde_only-hub", printed=printed.getvalue())
    return out


KINDS = ["lora_pde", "pde_only"]


# ---------------------------------------------------------------------------------------------------------------------
# Export: files, card, PDE summary, load checks
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_export_folder_contents(adapters, kind):
    entry = adapters[kind]
    folder, original = Path(entry["folder"]), Path(entry["dir"])
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json",
                                                        "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    source = json.loads((original / "adapter_config.json").read_text())
    assert config["peft_type"] == "CTA_LORA" and config["cta_patch"] == source["cta_patch"]
    # AutoPeftModel loads the base named here: the Hub id, not the training machine's folder
    assert source["base_model_name_or_path"] == str(adapters["base"])
    assert config["base_model_name_or_path"] == BASE_ID
    assert {k: v for k, v in config.items() if k != "base_model_name_or_path"} == \
        {k: v for k, v in source.items() if k != "base_model_name_or_path"}
    saved, before = load_file(str(folder / "adapter_model.safetensors")), load_file(
        str(original / "adapter_model.safetensors"))
    assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in saved)
    assert any("lora_" in k for k in saved) == (kind == "lora_pde")


@pytest.mark.parametrize("kind", KINDS)
def test_card_metadata(adapters, kind):
    card = ModelCard.load(str(adapters[kind]["folder"] / "README.md"))
    data = card.data.to_dict()
    assert data["base_model"] == BASE_ID and data["library_name"] == "peft"
    assert data["pipeline_tag"] == "text-generation"
    assert {"cta", "pde", f"base_model:adapter:{BASE_ID}"} <= set(data["tags"])
    assert ("lora" in data["tags"]) == (kind == "lora_pde")  # a PDE-alone adapter has no LoRA layer
    if kind == "lora_pde":
        assert data["datasets"] == ["wikitext"] and data["language"] == ["en"] and data["license"] == "other"
        assert "pde-diffusion" in data["tags"]
        repo = "me/tiny-llama-cta-lora"
    else:
        assert data["license"] == "mit" and "pde-advection-diffusion" in data["tags"]
        repo = "pde_only-hub"  # default: the folder's name
    text = card.text
    snippet = text[text.index("```python"):]
    # `import cta` comes before the load, which goes onto the plain base
    assert snippet.index("import cta") < snippet.index(f'PeftModel.from_pretrained(base, "{repo}")')
    assert f'AutoModelForCausalLM.from_pretrained("{BASE_ID}")' in snippet
    assert 'pip install "cta[peft]"' in text
    assert "needs the `cta` package" in text and "KeyError: 'CTA_LORA'" in text and "no remote code" in text
    assert "2025.emnlp-main.1097" in text  # the shared citation section
    if kind == "lora_pde":
        assert "| LoRA target modules | `q_proj`, `v_proj` |" in text
    else:
        assert "| LoRA | none: the PDE coefficients alone (`target_modules=[]`) |" in text


@pytest.mark.parametrize("kind", KINDS)
def test_pde_summary_equals_the_trained_coefficients(adapters, kind):
    entry = adapters[kind]
    info = hub_adapter.read_adapter(entry["folder"])
    summary = hub_adapter.adapter_pde_summary(info["config"], info["coefficients"])
    expected = entry["coefficients"]
    names = [site["name"] for site in summary["sites"]]  # PEFT's prefix dropped, in natural order
    assert sorted(names) == sorted(expected) and names == sorted(names, key=hub_adapter._natural)
    assert summary["num_sites"] == len(expected)
    for site in summary["sites"]:
        for name, value in expected[site["name"]].items():
            assert torch.equal(torch.tensor(site[name]), value.flatten()), (site["name"], name)
            assert torch.equal(torch.tensor(site[f"{name}_effective"]), value.flatten())  # inside the stable bounds
    text = (entry["folder"] / "README.md").read_text()
    if kind == "lora_pde":
        assert summary["type"] == "diffusion" and summary["steps"] == 2 and summary["beta_bounds"] is None
        assert "| `model.layers.0.cta_block_output_pde` | 0.1 |" in text
        assert "| `model.layers.1.cta_block_output_pde` | 0.3 |" in text
    else:
        assert summary["per_channel"] and summary["placements"] == ["embedding", "block_output"]
        assert names == ["model.layers.0.cta_block_output_pde", "model.layers.0.cta_embedding_pde",
                         "model.layers.1.cta_block_output_pde"]
        assert ("| `model.layers.0.cta_embedding_pde` | mean 0.125 (min 0.05, max 0.2) | 0.1 (all 32 channels) |"
                in text)
        assert "| PDE type | `advection_diffusion` |" in text and "| coefficient shape | per channel |" in text


def test_load_checks_pass(adapters):
    report = adapters["lora_pde"]["report"]
    assert report["folder"] == adapters["lora_pde"]["folder"] and report["base_model"] == BASE_ID
    assert report["max_abs_diff"] <= 1e-4
    assert report["with_cta"]["cls"] == "CTAPatchedLlamaForCausalLM" and report["with_cta"]["sites"] == 2
    assert Path(report["with_cta"]["cta"]).parent.name == "cta"  # the installed package, imported under python -I
    assert "CTA_LORA" in report["without_cta"]  # refused, not loaded without its PDE
    printed = adapters["pde_only"]["printed"]
    assert "Load with cta (python -I, plain base + adapter): CTAPatchedLlamaForCausalLM with 3 PDE sites" in printed
    assert "Load without cta: refused, as it must be (KeyError: 'CTA_LORA')" in printed
    assert "Static checks passed: CTA_LORA adapter, 3 PDE sites, 0 LoRA tensors" in printed


def test_load_check_detects_a_dropped_pde(adapters, monkeypatch):
    """Compared with the plain base (the PDE-alone adapter without its PDE), the load check fails. (The check without
    cta, run by the exports above, is stubbed here: it is the other subprocess, and costs seconds of imports.)"""
    monkeypatch.setattr(hub_adapter, "_WITHOUT_CTA_SCRIPT", 'print("REFUSED \\"KeyError: stub\\"")')
    plain = LlamaForCausalLM.from_pretrained(adapters["base"])
    with pytest.raises(hub_adapter.AdapterExportError, match="logits differ from the reference's"):
        hub_adapter.verify_adapter_folder(adapters["pde_only"]["folder"], base_model_dir=adapters["base"],
                                          reference_model=plain)


def test_load_checks_are_skipped_without_a_base_folder(adapters, tmp_path, capsys):
    assert hub.main(["export", "--adapter", str(adapters["lora_pde"]["dir"]), str(tmp_path / "out"),
                     "--base-model", BASE_ID]) == 0
    out = capsys.readouterr().out
    assert "Static checks passed" in out and "Load checks skipped: pass --base-model-dir DIR" in out
    report = hub_adapter.export_adapter_for_hub(adapters["lora_pde"]["dir"], tmp_path / "out", base_model=BASE_ID,
                                                base_model_dir=adapters["base"], verify_load=False, overwrite=True)
    assert report["load_check"] == "skipped (--no-verify-load)" and "max_abs_diff" not in report


# ---------------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------------


def test_refuses_what_is_not_a_cta_adapter(adapters, tmp_path, capsys):
    root, out = adapters["root"], tmp_path / "out"
    with pytest.raises(hub_adapter.AdapterExportError, match="plain LoRA adapter .*cta.CTALoraConfig"):
        hub_adapter.export_adapter_for_hub(root / "plain_lora", out, base_model=BASE_ID)
    with pytest.raises(hub_adapter.AdapterExportError, match="full checkpoint .*without --adapter"):
        hub_adapter.export_adapter_for_hub(root / "base", out, base_model=BASE_ID)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapters["lora_pde"]["dir"] / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(hub_adapter.AdapterExportError, match="only pickle weights"):
        hub_adapter.export_adapter_for_hub(pickled, out, base_model=BASE_ID)
    # the recorded base model is a local folder: the card needs its Hub id
    with pytest.raises(hub_adapter.AdapterExportError, match="--base-model ORG/NAME"):
        hub_adapter.export_adapter_for_hub(adapters["lora_pde"]["dir"], out)
    patched = cta.patch_model(LlamaForCausalLM.from_pretrained(root / "base"), pde_type="diffusion")
    patched.save_pretrained(tmp_path / "patched")
    with pytest.raises(hub_adapter.AdapterExportError, match="--base-model-dir .* patched checkpoint"):
        hub_adapter.export_adapter_for_hub(adapters["lora_pde"]["dir"], out, base_model=BASE_ID,
                                           base_model_dir=tmp_path / "patched")
    assert not out.exists()  # nothing written by a refused export
    with pytest.raises(hub_adapter.AdapterExportError, match="not empty"):
        hub_adapter.export_adapter_for_hub(adapters["lora_pde"]["dir"], adapters["lora_pde"]["folder"],
                                           base_model=BASE_ID)
    # the command line: errors name the problem and the option
    assert hub.main(["export", "--adapter", str(root / "plain_lora"), str(out), "--base-model", BASE_ID]) == 2
    assert "plain LoRA adapter (peft_type 'LORA')" in capsys.readouterr().err
    assert hub.main(["export", str(adapters["lora_pde"]["dir"]), str(out)]) == 2
    assert "PEFT adapter folder: pass --adapter" in capsys.readouterr().err
    assert hub.main(["export", "--adapter", str(adapters["lora_pde"]["dir"]), str(out), "--base-model", BASE_ID,
                     "--tokenizer", str(root / "base")]) == 2
    assert "--tokenizer does not apply to --adapter" in capsys.readouterr().err
    assert hub.main(["export", str(root / "base"), str(out), "--base-model-dir", str(root / "base")]) == 2
    assert "--base-model-dir is for --adapter" in capsys.readouterr().err


def test_card_reads_the_result_file_of_its_adapter(adapters, tmp_path, capsys):
    """--results with --adapter: the card's evaluation table and model-index are the result file's numbers, and a
    result file about other weights (another sha256) is refused before anything is written."""
    import hashlib

    source = adapters["lora_pde"]["dir"]
    digest = hashlib.sha256((source / "adapter_model.safetensors").read_bytes()).hexdigest()
    block = dict(source="results/study.json", run="lora_pde|diffusion|identity|0.01|seed1", adapter_sha256=digest,
                 description="Fine-tuned for 3 steps.", columns=["model", "test perplexity, 1024 tokens"],
                 rows=[["this adapter (seed 1)", 12.345], ["LoRA alone, 3 seeds", "12.400 ± 0.010"]],
                 model_index=[dict(task_type="text-generation", dataset_type="wikitext", dataset_name="WikiText-2",
                                   dataset_split="test", metric_type="perplexity",
                                   metric_name="test perplexity (1024 tokens)", metric_value=12.345)])
    results = tmp_path / "study.json"
    results.write_text(json.dumps({"card_results": block, "cells": []}))
    out = tmp_path / "hub"
    assert hub.main(["export", "--adapter", str(source), str(out), "--base-model", BASE_ID, "--results",
                     str(results), "--no-verify-load"]) == 0, capsys.readouterr().err
    card = ModelCard.load(str(out / "README.md"))
    assert "## Evaluation" in card.text and "Fine-tuned for 3 steps." in card.text
    assert "| this adapter (seed 1) | 12.345 |" in card.text and "| LoRA alone, 3 seeds | 12.400 ± 0.010 |" in card.text
    assert digest in card.text and "results/study.json" in card.text
    (entry,) = card.data.eval_results
    assert (entry.metric_type, entry.metric_value, entry.dataset_split) == ("perplexity", 12.345, "test")
    # without results: no evaluation section
    assert "## Evaluation" not in (adapters["lora_pde"]["folder"] / "README.md").read_text()
    # numbers of other weights, or a file without a card_results block: refused, nothing written
    results.write_text(json.dumps({"card_results": dict(block, adapter_sha256="0" * 64)}))
    assert hub.main(["export", "--adapter", str(source), str(tmp_path / "other"), "--base-model", BASE_ID,
                     "--results", str(results), "--no-verify-load"]) == 2
    assert "reports on another adapter" in capsys.readouterr().err and not (tmp_path / "other").exists()
    results.write_text(json.dumps({"eval_loss": 1.0}))
    with pytest.raises(hub_adapter.AdapterExportError, match="no adapter results"):
        hub_adapter.render_adapter_card(source, base_model=BASE_ID, results=results)


def test_the_committed_study_card_reads_the_committed_result_file():
    """results/pretrained_finetune_adapter/README.md (the SmolLM2 study's exported adapter card) carries the numbers,
    description and model-index of results/pretrained_finetune.json's card_results, for the adapter it names."""
    root = Path(__file__).resolve().parents[1] / "results"
    block = json.loads((root / "pretrained_finetune.json").read_text())["card_results"]
    card = ModelCard.load(str(root / "pretrained_finetune_adapter" / "README.md"))
    assert block["description"] in card.text and block["adapter_sha256"] in card.text
    for row in block["rows"]:
        assert "| " + " | ".join(str(cell) for cell in row) + " |" in card.text, row
    indexed = {(e.metric_name, e.metric_value) for e in card.data.eval_results}
    assert indexed == {(e["metric_name"], e["metric_value"]) for e in block["model_index"]}


# ---------------------------------------------------------------------------------------------------------------------
# Push, card, help
# ---------------------------------------------------------------------------------------------------------------------


def test_push_uploads_the_adapter_folder(adapters, capsys):
    folder = adapters["lora_pde"]["folder"]
    assert hub.verify_hub_folder(folder)["sites"] == list(adapters["lora_pde"]["coefficients"])
    with mock.patch.object(hub, "HfApi") as api_class:
        api = api_class.return_value
        api.upload_folder.return_value = SimpleNamespace(commit_url="https://hub.test/me/a/commit/1")
        assert hub.main(["push", str(folder), "me/tiny-llama-cta-lora", "--private", "--token", "hf_test"]) == 0
        api_class.assert_called_once_with(endpoint=None, token="hf_test")
        api.create_repo.assert_called_once_with("me/tiny-llama-cta-lora", private=True, exist_ok=True,
                                                repo_type="model")
        api.upload_folder.assert_called_once_with(
            repo_id="me/tiny-llama-cta-lora", folder_path=str(folder), repo_type="model", revision=None,
            commit_message=f"Upload CTA adapter ({folder.name}) with cta-hub", create_pr=False)
    assert "https://hub.test/me/a/commit/1" in capsys.readouterr().out


def test_push_refuses_a_broken_adapter_folder(adapters, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(adapters["pde_only"]["folder"], broken)
    (broken / "README.md").unlink()
    (broken / "adapter_model.bin").write_bytes(b"pickle")
    plain = tmp_path / "plain"  # a plain LoRA adapter folder is no CTA adapter either
    shutil.copytree(adapters["root"] / "plain_lora", plain)
    with mock.patch.object(hub, "HfApi") as api_class:
        with pytest.raises(hub.HubPushError) as err:
            hub.push_to_hub_folder(broken, "me/x")
        assert "README.md missing" in str(err.value) and "adapter_model.bin" in str(err.value)
        with pytest.raises(hub.HubPushError, match="plain LoRA adapter"):
            hub.push_to_hub_folder(plain, "me/x")
        api_class.assert_not_called()


def test_card_command_prints_the_adapter_card(adapters, capsys):
    assert hub.main(["card", "--adapter", str(adapters["pde_only"]["dir"]), "--base-model", BASE_ID, "--repo-id",
                     "me/pde", "--pip-spec", "cta[peft] @ git+https://github.com/me/cta"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("---\n") and "library_name: peft" in text and f"base_model: {BASE_ID}" in text
    assert 'pip install "cta[peft] @ git+https://github.com/me/cta"' in text
    assert 'PeftModel.from_pretrained(base, "me/pde")' in text
    assert hub.main(["card", "--adapter", str(adapters["pde_only"]["dir"])]) == 2
    assert "pass --base-model ORG/NAME" in capsys.readouterr().err


def test_export_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        hub.main(["export", "--help"])  # what `cta-hub export --help` runs (console script cta.hub:main)
    help_text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    for option in ("--adapter", "--base-model-dir", "--base-model", "--pip-spec", "--no-verify-load"):
        assert option in help_text, option
    assert "cta.CTALoraConfig" in help_text and "plain LoRA adapter is refused" in help_text
    parser = hub._parser()
    for name, sub in next(a for a in parser._actions if a.dest == "command").choices.items():
        assert all(action.help for action in sub._actions), name
