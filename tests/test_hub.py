"""cta-hub: self-contained export, model card, push.

* export (API and CLI) -> folder contents: config with auto_map, the code files every relative import needs,
  safetensors only (equal to the model's weights), tokenizer, README card;
* card metadata from the JSON that transformers' own `Trainer.save_metrics` writes (model-index round trip);
* repo-id validation (huggingface_hub's validator);
* push: the `HfApi` calls we make, with `HfApi` mocked;
* end to end: the exported folders load with `trust_remote_code=True` in an environment where `cta` is not
  installed (`remote_code_env.py`) and give the original logits.
"""

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.repocard_data import model_index_to_eval_results
from safetensors.torch import load_file
from transformers import BertTokenizer, Trainer

from cta import CTAConfig, CTAForCausalLM, CTAForSequenceClassification
from cta import hub
from remote_code_env import run_in_clean_env
from shared_data import BERT_TOKENIZER, STORIES260K

STORIES = STORIES260K
pytestmark = pytest.mark.shared_data  # reads $CTA_SHARED_DIR: CI reruns this file with an empty one


def paper_tokenizer(root: Path) -> Path:
    """The paper's bert-base-uncased tokenizer folder where a checkout has it beside it; else (a bare clone) a small
    BERT WordPiece tokenizer built here, in a folder that, like the real one, also holds a BERT ``config.json``."""
    if BERT_TOKENIZER.is_dir():
        return BERT_TOKENIZER
    folder = root / "bert-tokenizer"
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a movie film was is good bad great not".split()
    BertTokenizer(vocab={word: i for i, word in enumerate(words)}).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": len(words)}))
    return folder


def save_metrics(output_dir, split, metrics):
    """transformers' own writer of all_results.json / {split}_results.json (Trainer.save_metrics)."""
    Trainer.save_metrics(SimpleNamespace(args=SimpleNamespace(output_dir=str(output_dir)),
                                         is_world_process_zero=lambda: True), split, metrics)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    out = {"root": root}

    clf = CTAForSequenceClassification(CTAConfig(
        vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        pde_type="advection_diffusion", pde_steps=2, num_labels=2, id2label={0: "neg", 1: "pos"},
        label2id={"neg": 0, "pos": 1}, pde_placement=["embedding", "block_output"], pde_per_channel=True)).eval()
    with torch.no_grad():  # move the coefficients off their init so the card shows learned values
        for name, p in clf.named_parameters():
            if name.endswith("alpha"):
                p.add_(torch.linspace(-0.02, 0.02, p.numel()).view_as(p))
    clf.save_pretrained(root / "clf")
    save_metrics(root / "clf", "train", {"train_loss": 0.52, "train_runtime": 10.0, "epoch": 3.0})
    save_metrics(root / "clf", "eval", {"eval_accuracy": 0.8125, "eval_loss": 0.43, "eval_runtime": 1.2,
                                        "eval_samples_per_second": 100.0, "epoch": 3.0})
    save_metrics(root / "clf", "test", {"test_accuracy": 0.79, "test_loss": 0.47, "test_runtime": 1.0})
    tok = paper_tokenizer(root)
    # the classifier goes through the API, including its own load-and-compare check in a cta-free subprocess
    out["classifier"] = dict(model=clf, auto="AutoModelForSequenceClassification", tokenizer=True,
                             folder=hub.export_for_hub(root / "clf", root / "clf-hub", tokenizer=tok, datasets=["imdb"],
                                                       results=root / "clf" / "all_results.json",
                                                       repo_id="me/imdb-cta", verify_load=True))

    lm = CTAForCausalLM(CTAConfig.modern_decoder(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        pde_type="wave", pde_steps=3, pde_placement=["value", "block_output"], pde_per_channel=True)).eval()
    lm.save_pretrained(root / "lm")
    save_metrics(root / "lm", "eval", {"eval_loss": 3.2, "eval_perplexity": 24.5, "eval_runtime": 2.0})
    # the causal LM goes through the command line
    assert hub.main(["export", str(root / "lm"), str(root / "lm-hub"), "--results",
                     str(root / "lm" / "eval_results.json"), "--dataset", "wikitext", "--repo-id", "me/wikitext-cta",
                     "--no-verify-load"]) == 0
    out["causal_lm"] = dict(model=lm, auto="AutoModelForCausalLM", tokenizer=False, folder=root / "lm-hub")

    from transformers import AutoModelForCausalLM

    from cta.patching_cta import patch_model

    llama = AutoModelForCausalLM.from_pretrained(str(STORIES)).eval()
    patch_model(llama, pde_type="diffusion", pde_steps=2, placement=["embedding", "block_output"], init="paper")
    llama.save_pretrained(root / "llama")
    out["patched_llama"] = dict(
        model=llama, auto="AutoModelForCausalLM", tokenizer=True,
        folder=hub.export_for_hub(root / "llama", root / "llama-hub", tokenizer=STORIES, license="mit",
                                  base_model="karpathy/tinyllamas", repo_id="me/stories260K-cta",
                                  verify_load=False))
    return out


KINDS = ["classifier", "causal_lm", "patched_llama"]


def _card(folder):
    card = ModelCard.load(str(Path(folder) / "README.md"))
    return card, card.data.to_dict()


# ---------------------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_export_folder_contents(exports, kind):
    entry = exports[kind]
    folder, model = Path(entry["folder"]), entry["model"]
    files = {p.name for p in folder.iterdir()}
    assert not any(p.is_dir() for p in folder.iterdir())
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"][entry["auto"]].endswith("." + type(model).__name__)
    assert config["architectures"] == [type(model).__name__]
    # every module of auto_map, and every module those import relatively, is a flat file of the folder
    needed = {ref.split(".")[0] for ref in config["auto_map"].values()}
    for py in [f for f in files if f.endswith(".py")]:
        needed |= set(re.findall(r"^\s*from \.(\w+) import", (folder / py).read_text(), flags=re.M))
    assert {f"{m}.py" for m in needed} <= files and "pde_cta.py" in files
    # weights: safetensors only, equal to the model's
    assert "model.safetensors" in files and not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
    saved, state = load_file(str(folder / "model.safetensors")), model.state_dict()
    assert any("_pde." in k for k in saved)
    for key, tensor in saved.items():
        assert torch.equal(tensor, state[key]), key
    assert "README.md" in files
    if entry["tokenizer"]:
        assert {"tokenizer.json", "tokenizer_config.json"} <= files
        assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
    else:
        assert "tokenizer_config.json" not in files
    if kind == "classifier":  # the BERT tokenizer folder's own config.json did not replace the model's
        assert config["model_type"] == "cta"
    assert hub.verify_hub_folder(folder)["code_files"] == sorted(f"{m}.py" for m in needed)


def test_export_refuses_plain_models_and_full_folders(exports, tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    plain = tmp_path / "bert"
    BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=16)).save_pretrained(plain)
    with pytest.raises(hub.HubExportError, match="without PDE refinement"):
        hub.export_for_hub(plain, tmp_path / "out")
    with pytest.raises(hub.HubExportError, match="not empty"):
        hub.export_for_hub(exports["root"] / "lm", exports["causal_lm"]["folder"])


def test_verification_names_every_problem(exports, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(exports["causal_lm"]["folder"], bad)
    (bad / "pde_cta.py").unlink()  # modeling_cta.py imports it
    (bad / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(hub.HubExportError) as err:
        hub.verify_hub_folder(bad)
    assert "pde_cta.py" in str(err.value) and "pytorch_model.bin" in str(err.value)


def test_load_check_detects_other_weights(exports):
    """The export's load-and-compare check fails when the folder's outputs are not the reference model's."""
    torch.manual_seed(1)
    other = CTAForCausalLM(exports["causal_lm"]["model"].config).eval()
    with pytest.raises(hub.HubExportError, match="differ from the original"):
        hub.verify_hub_folder(exports["causal_lm"]["folder"], reference_model=other)


# ---------------------------------------------------------------------------------------------------------------------
# Card and metrics
# ---------------------------------------------------------------------------------------------------------------------


def test_load_results_reads_save_metrics(exports, tmp_path):
    results = hub.load_results(exports["root"] / "clf" / "all_results.json")
    # test_ wins over eval_; runtimes and throughputs are not metrics; train_* / epoch are the training record
    assert results["metrics"] == {"accuracy": (0.79, "test"), "loss": (0.47, "test")}
    assert results["training"] == {"epoch": 3.0, "train_loss": 0.52, "train_runtime": 10.0}
    eval_only = hub.load_results(exports["root"] / "clf" / "eval_results.json")
    assert eval_only["metrics"] == {"accuracy": (0.8125, None), "loss": (0.43, None)}
    table = tmp_path / "table1.json"  # another schema (a reproduce.py table): refused, naming the expected one
    table.write_text(json.dumps({"table": "table1", "cells": [{"row": "IMDb", "mean": 82.0}]}))
    with pytest.raises(hub.HubExportError, match="save_metrics"):
        hub.load_results(table)
    with pytest.raises(hub.HubExportError, match="Cannot read"):
        hub.load_results(tmp_path / "missing.json")


def test_classifier_card(exports):
    card, data = _card(exports["classifier"]["folder"])
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-classification"
    assert {"custom_code", "continuous-time-attention", "pde-advection-diffusion"} <= set(data["tags"])
    assert data["license"] == "apache-2.0" and "base_model" not in data
    assert data["datasets"] == ["imdb"] and data["metrics"] == ["accuracy", "loss"]
    name, results = model_index_to_eval_results(data["model-index"])
    assert name == "imdb-cta"
    got = {r.metric_type: (r.metric_value, r.task_type, r.dataset_type, r.dataset_split) for r in results}
    assert got == {"accuracy": (0.79, "text-classification", "imdb", "test"),
                   "loss": (0.47, "text-classification", "imdb", "test")}
    ModelCardData(**data)  # the metadata, model-index included, re-parses
    text = card.text
    assert 'repo_id = "me/imdb-cta"' in text and "AutoModelForSequenceClassification.from_pretrained(repo_id, " \
                                                "trust_remote_code=True)" in text
    assert "AutoTokenizer.from_pretrained(repo_id, trust_remote_code=True)" in text
    assert "| accuracy | 0.79 | test |" in text and "| train_loss | 0.52 |" in text
    assert "eval_runtime" not in text and "0.8125" not in text  # eval_accuracy lost to test_accuracy
    n = exports["classifier"]["model"].num_parameters()
    assert f"({n:,})" in text and "`neg`, `pos`" in text
    assert "| `model.layers.0.block_output_pde` | mean " in text  # learned per-channel coefficients
    for section in ("## Usage", "## PDE configuration", "## Training setup", "## Evaluation", "## Limitations",
                    "## Citation"):
        assert section in text, section
    assert "2025.emnlp-main.1097" in text and "2510.03272" in text  # both papers


def test_causal_lm_card(exports):
    card, data = _card(exports["causal_lm"]["folder"])
    assert data["pipeline_tag"] == "text-generation" and "pde-wave" in data["tags"]
    assert data["datasets"] == ["wikitext"]
    _, results = model_index_to_eval_results(data["model-index"])
    by_metric = {r.metric_type: r for r in results}
    assert set(by_metric) == {"loss", "perplexity"}
    assert by_metric["perplexity"].metric_value == 24.5
    assert by_metric["perplexity"].dataset_config == "wikitext-2-raw-v1"
    assert by_metric["perplexity"].dataset_split is None  # eval_ metrics; WikiText's split is not known
    assert "No tokenizer was exported" in card.text and "causal: reads only the left neighbour" in card.text


def test_patched_card(exports):
    card, data = _card(exports["patched_llama"]["folder"])
    assert data["base_model"] == "karpathy/tinyllamas" and data["license"] == "mit"
    assert {"cta-patched", "llama", "custom_code"} <= set(data["tags"]) and "model-index" not in data
    assert "`LlamaForCausalLM`" in card.text and "| PDE initialisation | `paper` |" in card.text
    assert "cta_block_output_pde" in card.text  # the patched sites' learned coefficients


def test_repo_ids_are_validated(exports, capsys):
    with pytest.raises(HFValidationError):
        hub.render_model_card(exports["root"] / "clf", repo_id="a/b/c")
    with pytest.raises(HFValidationError):
        hub.render_model_card(exports["root"] / "llama",
                              base_model="bad--name")
    assert hub.main(["card", str(exports["root"] / "clf"), "--repo-id", "me/bad..name"]) == 2
    assert "me/bad..name" in capsys.readouterr().err
    with mock.patch.object(hub, "HfApi") as api:
        assert hub.main(["push", str(exports["classifier"]["folder"]), "not/a/repo"]) == 2
        api.assert_not_called()
    assert "not/a/repo" in capsys.readouterr().err


def test_cli_help_explains_every_option(capsys):
    parser = hub._parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    assert set(subparsers) == {"export", "push", "card"}
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"cta-hub {name} {action.option_strings or action.dest} has no help"
    with pytest.raises(SystemExit) as exit_:
        hub.main(["push", "--help"])
    assert exit_.value.code == 0 and "--private" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------------
# Push (HfApi mocked: the calls we make)
# ---------------------------------------------------------------------------------------------------------------------


def test_push_calls(exports, capsys):
    folder = exports["classifier"]["folder"]
    with mock.patch.object(hub, "HfApi") as api_class:
        api = api_class.return_value
        api.upload_folder.return_value = SimpleNamespace(commit_url="https://hub.test/me/imdb-cta/commit/abc")
        assert hub.main(["push", str(folder), "me/imdb-cta", "--private", "--revision", "v1", "--commit-message",
                         "first upload", "--token", "hf_test"]) == 0
        api_class.assert_called_once_with(endpoint=None, token="hf_test")
        api.create_repo.assert_called_once_with("me/imdb-cta", private=True, exist_ok=True, repo_type="model")
        api.create_branch.assert_called_once_with("me/imdb-cta", branch="v1", exist_ok=True, repo_type="model")
        api.upload_folder.assert_called_once_with(repo_id="me/imdb-cta", folder_path=str(folder), repo_type="model",
                                                  revision="v1", commit_message="first upload", create_pr=False)
        assert "https://hub.test/me/imdb-cta/commit/abc" in capsys.readouterr().out

        api_class.reset_mock()
        hub.push_to_hub_folder(folder, "me/public", endpoint="https://hub.test")
        api_class.assert_called_once_with(endpoint="https://hub.test", token=None)
        api.create_repo.assert_called_once_with("me/public", private=False, exist_ok=True, repo_type="model")
        api.create_branch.assert_not_called()
        kwargs = api.upload_folder.call_args.kwargs
        assert kwargs["revision"] is None and kwargs["repo_id"] == "me/public"
        assert folder.name in kwargs["commit_message"]


def test_push_refuses_missing_or_broken_folders(exports, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(exports["classifier"]["folder"], broken)
    (broken / "modeling_cta.py").unlink()
    with mock.patch.object(hub, "HfApi") as api_class:
        with pytest.raises(hub.HubPushError, match="modeling_cta.py"):
            hub.push_to_hub_folder(broken, "me/x")
        assert hub.main(["push", str(tmp_path / "missing"), "me/x"]) == 2
        api_class.assert_not_called()
    assert "cta-hub export" in capsys.readouterr().err


def test_push_reports_the_hubs_error(exports, capsys):
    with mock.patch.object(hub, "HfApi") as api_class:
        api_class.return_value.create_repo.side_effect = HfHubHTTPError(
            "403 Forbidden: You don't have the rights to create a model under the namespace 'other'",
            response=mock.MagicMock(status_code=403))
        assert hub.main(["push", str(exports["classifier"]["folder"]), "other/x"]) == 2
        api_class.return_value.upload_folder.assert_not_called()
    assert "403 Forbidden: You don't have the rights" in capsys.readouterr().err


def test_trainer_hooks(exports, tmp_path):
    """examples/common.py: write_model_card(output_dir, results=run, task=..., dataset=...), then
    publish_trainer_model(trainer, ...), which exports output_dir/hub_export and pushes with --push_to_hub."""
    out = tmp_path / "run"
    shutil.copytree(exports["root"] / "clf", out)
    run = dict(eval_accuracy=0.9, eval_loss=0.3, eval_split="validation", script="run_classification.py",
               learning_rate=5e-4, argv=["--task", "sst2"], model_config={"pde_steps": 2})
    path = hub.write_model_card(out, results=run, task="text-classification", dataset="sst2")
    _, data = _card(out)
    assert path == out / "README.md" and data["datasets"] == ["glue"]
    _, results = model_index_to_eval_results(data["model-index"])
    assert [(r.metric_type, r.metric_value, r.dataset_config, r.dataset_split) for r in results] == [
        ("accuracy", 0.9, "sst2", "validation"), ("loss", 0.3, "sst2", "validation")]
    assert hub.write_model_card(tmp_path / "nothing-here", results=run) is None  # logged, never raises

    args = SimpleNamespace(output_dir=str(out), hub_model_id="me/sst2-cta", push_to_hub=True, hub_private_repo=True,
                           hub_token="hf_test", hub_revision=None)
    trainer = SimpleNamespace(args=args, is_world_process_zero=lambda: True)
    with mock.patch.object(hub, "HfApi") as api_class:
        hub.publish_trainer_model(trainer, results=run, dataset="sst2", verify_load=False)
        api_class.assert_called_once_with(endpoint=None, token="hf_test")
        api_class.return_value.create_repo.assert_called_once_with("me/sst2-cta", private=True, exist_ok=True,
                                                                   repo_type="model")
        kwargs = api_class.return_value.upload_folder.call_args.kwargs
    assert (kwargs["repo_id"], kwargs["folder_path"]) == ("me/sst2-cta", str(out / "hub_export"))
    assert (out / "hub_export" / "model.safetensors").is_file()
    assert 'repo_id = "me/sst2-cta"' in (out / "hub_export" / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------------------
# End to end: the exported folders load where `cta` is not installed
# ---------------------------------------------------------------------------------------------------------------------

CLEAN_SCRIPT = """
import json, torch, transformers
out = dict()
for kind, spec in json.loads({specs!r}).items():
    model = getattr(transformers, spec["auto"]).from_pretrained(spec["path"], trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(spec["ids"]), attention_mask=torch.tensor(spec["mask"])).logits
    tok = None
    if spec["tokenizer"]:
        tok = transformers.AutoTokenizer.from_pretrained(spec["path"], trust_remote_code=True)
        tok = [type(tok).__name__, tok("Once upon a time")["input_ids"]]
    out[kind] = dict(logits=logits.tolist(), tokenizer=tok, cls=type(model).__name__)
print("RESULT " + json.dumps(out))
"""


def _inputs(kind, vocab):
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    if kind == "classifier":
        mask[1, 7:] = 0  # right padding
    else:
        mask[1, :3] = 0  # left padding
    return ids, mask


def test_exports_load_without_cta_with_identical_logits(exports):
    specs = {}
    for kind in [k for k in KINDS if k in exports]:
        ids, mask = _inputs(kind, exports[kind]["model"].config.vocab_size)
        specs[kind] = dict(auto=exports[kind]["auto"], path=str(exports[kind]["folder"]), ids=ids.tolist(),
                           mask=mask.tolist(), tokenizer=exports[kind]["tokenizer"])
    out = run_in_clean_env(CLEAN_SCRIPT.format(specs=json.dumps(specs)))
    assert "custom code" not in out  # neither a model nor a tokenizer prompts for remote code again
    got = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert set(got) == set(specs)
    for kind, result in got.items():
        model = exports[kind]["model"]
        ids, mask = _inputs(kind, model.config.vocab_size)
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
        logits = torch.tensor(result["logits"])
        assert result["cls"] == type(model).__name__
        valid = mask.bool() if logits.dim() == 3 else torch.ones(logits.shape[0], dtype=torch.bool)
        assert torch.allclose(logits[valid], expected[valid], atol=1e-5), (kind, (logits - expected).abs().max())
        if exports[kind]["tokenizer"]:
            assert result["tokenizer"] and len(result["tokenizer"][1]) > 0
