"""cta-hub: self-contained Hub export, model cards, push (against a local stand-in for the Hub endpoint).

* export -> load in a clean environment (only torch + transformers; `cta` not importable; `remote_code_env.py`)
  with `trust_remote_code=True` -> identical logits, for a tiny classifier, a tiny causal LM and a patched
  pretrained Llama (stories260K; skipped with a reason when the model folder is absent);
* the card's metadata parses and validates (ModelCard.load, card.data.to_dict(), model-index round trip);
* the results-JSON layouts the card reads (reproduce.py tables, a single run, the generic schema);
* `cta-hub push` against an `http.server` on 127.0.0.1 given as HF_ENDPOINT, recording every call: the uploaded
  file set and contents equal the exported folder; clear errors when not logged in / offline / unreachable.
"""

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch

from cta import CTAConfig, CTAForCausalLM, CTAForSequenceClassification
from cta import hub
from remote_code_env import run_in_clean_env

REPO_ROOT = Path(__file__).resolve().parent.parent
STORIES = Path(os.environ.get("CTA_STORIES260K", REPO_ROOT.parent / "shared" / "models" / "stories260K"))
BERT_TOKENIZER = Path(os.environ.get("CTA_PAPER_TOKENIZER", REPO_ROOT.parent / "shared" / "tokenizers" / "bert-base-uncased"))


def _cli_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["PYTHONPATH"] = str(REPO_ROOT)  # this checkout's cta, whatever the installed one points to
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    env.update(extra)
    return env


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "cta.hub", *map(str, args)], cwd=REPO_ROOT, env=env or _cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def _results_table(path):
    """A results JSON in the layout examples/reproduce.py writes (two rows, baseline + CTA, three seeds)."""
    cells = []
    for row in ("IMDb 2L", "AG News 2L"):
        for variant, vargs, base in (("baseline (0 PDE steps)", ["--pde_steps", "0"], 80.0),
                                     ("CTA (advection, 2 steps)", ["--pde_steps", "2"], 82.0)):
            values = [base, base + 1.0, base + 2.0]
            cells.append(dict(row=row, variant=variant, variant_args=vargs, values=values, seeds=[0, 1, 2],
                              mean=sum(values) / 3, std=1.0, n=3, failed=[],
                              runs=[dict(seed=s, epochs=3, device="cpu (2 cores)") for s in range(3)]))
    data = dict(table="table1", title="Paper Table 1: text classification (accuracy %)", metric="eval_accuracy",
                metric_scale=100.0, higher_is_better=True, baseline_variant="baseline (0 PDE steps)",
                rows=["IMDb 2L", "AG News 2L"], cells=cells, settings=dict(seeds=3, quick=False))
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints and exports (module scope: built once)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    out = {}

    clf_cfg = CTAConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, pde_type="advection_diffusion", pde_steps=2, num_labels=2,
                        id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1},
                        pde_placement=["embedding", "block_output"], pde_per_channel=True)
    clf = CTAForSequenceClassification(clf_cfg).eval()
    with torch.no_grad():  # move the coefficients off their init so the card shows learned values
        for name, p in clf.named_parameters():
            if name.endswith("alpha"):
                p.add_(torch.linspace(-0.02, 0.02, p.numel()).view_as(p))
    clf.save_pretrained(root / "clf")
    results = _results_table(root / "table1.json")
    if BERT_TOKENIZER.is_dir():
        tok = BERT_TOKENIZER
    else:
        tok = None
    # the classifier goes through the full export path, including its own cta-free load check
    out["classifier"] = dict(
        model=clf, auto="AutoModelForSequenceClassification",
        folder=hub.export_for_hub(root / "clf", root / "clf-hub", results=results, results_row="IMDb 2L",
                                  tokenizer=tok, repo_id="me/imdb-cta", verify_load=True),
        tokenizer=tok is not None)

    lm_cfg = CTAConfig.modern_decoder(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32, pde_type="wave", pde_steps=3,
                                      pde_placement=["value", "block_output"], pde_per_channel=True)
    lm = CTAForCausalLM(lm_cfg).eval()
    lm.save_pretrained(root / "lm")
    run = dict(script="run_clm.py", task="wikitext_lm", seed=0, eval_loss=3.2, eval_perplexity=24.5,
               test_loss=3.1, test_perplexity=22.2, leak_check=dict(passed=True, max_abs_diff=0.0, tolerance=1e-5),
               learning_rate=1e-3, epochs=3, block_size=32, argv=["--block_size", "32"])
    out["causal_lm"] = dict(
        model=lm, auto="AutoModelForCausalLM",
        folder=hub.export_for_hub(root / "lm", root / "lm-hub", results=run, repo_id="me/wikitext-cta",
                                  verify_load=False),
        tokenizer=False)

    if STORIES.is_dir():
        from transformers import AutoModelForCausalLM

        from cta.patching_cta import patch_model

        llama = AutoModelForCausalLM.from_pretrained(str(STORIES)).eval()
        patch_model(llama, pde_type="diffusion", pde_steps=2, placement=["embedding", "block_output"], init="paper")
        llama.save_pretrained(root / "llama")
        out["patched_llama"] = dict(
            model=llama, auto="AutoModelForCausalLM",
            folder=hub.export_for_hub(root / "llama", root / "llama-hub", tokenizer=STORIES, license="mit",
                                      base_model="karpathy/tinyllamas", repo_id="me/stories260K-cta",
                                      verify_load=False),
            tokenizer=True)
    out["root"] = root
    return out


def _get(exports, kind):
    if kind not in exports:
        pytest.skip(f"stories260K not found at {STORIES} (set CTA_STORIES260K)")
    return exports[kind]


KINDS = ["classifier", "causal_lm", "patched_llama"]

CLEAN_SCRIPT = """
import json, torch, transformers
out = dict()
for kind, spec in json.loads({specs!r}).items():
    auto = getattr(transformers, spec["auto"])
    model = auto.from_pretrained(spec["path"], trust_remote_code=True).eval()
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
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    if kind == "classifier":
        mask[1, 7:] = 0  # right padding
    else:
        mask[1, :3] = 0  # left padding
    return ids, mask


@pytest.fixture(scope="module")
def clean_env_outputs(exports):
    """Every export loaded in ONE clean-environment process (torch + transformers only)."""
    specs = {}
    for kind in KINDS:
        if kind in exports:
            entry = exports[kind]
            ids, mask = _inputs(kind, entry["model"].config.vocab_size)
            specs[kind] = dict(auto=entry["auto"], path=str(entry["folder"]), ids=ids.tolist(), mask=mask.tolist(),
                               tokenizer=entry["tokenizer"])
    out = run_in_clean_env(CLEAN_SCRIPT.format(specs=json.dumps(specs)))
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert lines, out[-3000:]
    assert "custom code" not in out  # neither a model nor a tokenizer prompts for remote code again
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_without_cta_with_identical_logits(exports, clean_env_outputs, kind):
    entry = _get(exports, kind)
    ids, mask = _inputs(kind, entry["model"].config.vocab_size)
    with torch.no_grad():
        expected = entry["model"](input_ids=ids, attention_mask=mask).logits
    got = clean_env_outputs[kind]
    logits = torch.tensor(got["logits"])
    assert got["cls"] == type(entry["model"]).__name__
    if logits.dim() == 3:
        valid = mask.bool()
        assert torch.allclose(logits[valid], expected[valid], atol=1e-5), (logits[valid] - expected[valid]).abs().max()
    else:
        assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()
    if entry["tokenizer"]:
        assert got["tokenizer"] is not None and len(got["tokenizer"][1]) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_export_folder_is_self_contained(exports, kind):
    entry = _get(exports, kind)
    folder = Path(entry["folder"])
    files = {p.name for p in folder.iterdir()}
    config = json.loads((folder / "config.json").read_text())
    assert entry["auto"] in config["auto_map"]
    for ref in config["auto_map"].values():
        assert (folder / (ref.split(".")[0] + ".py")).is_file(), ref
    assert "model.safetensors" in files and "README.md" in files and "pde_cta.py" in files
    assert not [f for f in files if f.endswith(hub.PICKLE_SUFFIXES)], files
    assert not any(p.is_dir() for p in folder.iterdir())
    if entry["tokenizer"]:
        assert "tokenizer_config.json" in files and "tokenizer.json" in files
    if kind == "classifier" and BERT_TOKENIZER.is_dir():
        # the tokenizer folder's own (BERT) config.json must not replace the model's
        assert config["model_type"] == "cta" and "vocab.txt" in files
    report = hub.verify_hub_folder(folder)  # static checks pass on the exported folder
    assert set(report["code_files"]) <= files


def test_verification_catches_broken_folders(exports, tmp_path):
    import shutil

    src = Path(exports["causal_lm"]["folder"])
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "pde_cta.py").unlink()  # modeling_cta.py imports it
    (bad / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(hub.HubExportError, match=r"pde_cta\.py.*missing|pickle files") as err:
        hub.verify_hub_folder(bad)
    assert "pde_cta.py" in str(err.value) and "pytorch_model.bin" in str(err.value)


# ---------------------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_card_metadata_parses_and_validates(exports, kind):
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.repocard_data import model_index_to_eval_results

    entry = _get(exports, kind)
    card = ModelCard.load(str(Path(entry["folder"]) / "README.md"))
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert {"custom_code", "continuous-time-attention"} <= set(data["tags"])
    assert data["pipeline_tag"] == {"classifier": "text-classification"}.get(kind, "text-generation")
    assert data["license"]
    assert hub.check_card(Path(entry["folder"]) / "README.md") == data
    assert "trust_remote_code=True" in card.text and "## Citation" in card.text
    assert "2025.emnlp-main.1097" in card.text and "2510.03272" in card.text  # both papers
    assert "## Limitations" in card.text and "## PDE configuration" in card.text
    ModelCardData(**data)  # round trip: the metadata (model-index included) re-parses
    config = json.loads((Path(entry["folder"]) / "config.json").read_text())
    if kind == "classifier":
        name, results = model_index_to_eval_results(data["model-index"])
        assert name == "imdb-cta" and len(results) == 1
        r = results[0]
        assert (r.task_type, r.dataset_type, r.dataset_split, r.metric_type) == (
            "text-classification", "imdb", "test", "accuracy")
        assert r.metric_value == pytest.approx(83.0)  # the CTA row, not the baseline
        assert data["datasets"] == ["imdb"] and data["metrics"] == ["accuracy"]
        assert "| baseline (0 PDE steps) | 81.00 ± 1.00 | 3 |" in card.text
        assert "`model.layers.0.block_output_pde`" in card.text  # learned coefficients per site
        assert "me/imdb-cta" in card.text and "AutoTokenizer.from_pretrained(repo_id, trust_remote_code=True)" in card.text
        assert "base_model" not in data
    elif kind == "causal_lm":
        name, results = model_index_to_eval_results(data["model-index"])
        by_metric = {r.metric_type: r for r in results}
        assert by_metric["perplexity"].metric_value == pytest.approx(22.2)  # test split wins over eval
        assert by_metric["perplexity"].dataset_config == "wikitext-2-raw-v1"
        assert "future-token leak check | passed" in card.text
        assert f"`{config['pde_type']}`" in card.text
    else:
        assert data["base_model"] == "karpathy/tinyllamas" and data["license"] == "mit"
        assert "llama" in data["tags"] and "model-index" not in data
        assert "`LlamaForCausalLM`" in card.text and "cta_block_output_pde" in card.text


def test_results_layouts():
    table = {
        "table": "lm_steps", "title": "Paper Table 4: PDE steps", "metric": "test_perplexity", "metric_scale": 1.0,
        "higher_is_better": False, "baseline_variant": "0 steps (baseline)",
        "cells": [dict(row="WikiText-2, L=512", variant=v, variant_args=a, mean=m, std=0.1, n=3, seeds=[0, 1, 2])
                  for v, a, m in (("0 steps (baseline)", ["--pde_steps", "0"], 30.0),
                                  ("2 steps", ["--pde_steps", "2"], 29.0), ("4 steps", ["--pde_steps", "4"], 28.5))],
        "settings": {"quick": True},
    }
    summary = hub.load_results(table, config={"pde_steps": 4, "pde_type": "diffusion"})
    assert summary.variant().name == "4 steps"  # matched by variant_args against the config
    assert (summary.dataset_id, summary.dataset_config, summary.dataset_split) == ("wikitext", "wikitext-2-raw-v1",
                                                                                   "test")
    assert summary.warning and "meaningless" in summary.warning
    with pytest.raises(hub.HubExportError, match="results-variant"):
        hub.load_results(table).variant()  # two CTA variants, nothing to match
    generic = hub.load_results({
        "task": "text-classification", "dataset": {"id": "ag_news", "split": "test"},
        "runs": [{"variant": v, "seed": s, "metrics": {"eval_accuracy": a + s / 100, "eval_runtime": 9.0}}
                 for v, a in (("baseline", 0.6), ("cta", 0.7)) for s in range(3)],
    })
    cta_variant = generic.variant()
    assert cta_variant.name == "cta" and set(cta_variant.metrics) == {"accuracy"}
    assert cta_variant.metrics["accuracy"]["mean"] == pytest.approx(0.71)
    assert cta_variant.metrics["accuracy"]["std"] == pytest.approx(0.01)
    failed = hub.load_results({"script": "run_clm.py", "task": "wikitext_lm", "seed": 0, "error": "LEAK CHECK FAILED"})
    assert failed.variants == [] and "LEAK" in failed.warning  # nothing is published from a failed run
    with pytest.raises(hub.HubExportError, match="not found"):
        hub.load_results("/nonexistent/results.json")


def test_export_errors_are_clear(exports, tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    plain = tmp_path / "bert"
    BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=16)).save_pretrained(plain)
    with pytest.raises(hub.HubExportError, match="without PDE refinement"):
        hub.export_for_hub(plain, tmp_path / "out")
    with pytest.raises(hub.HubExportError, match="not empty"):
        hub.export_for_hub(exports["root"] / "lm", exports["causal_lm"]["folder"])
    with pytest.raises(hub.HubExportError, match="several rows"):
        hub.render_model_card(exports["root"] / "clf", results=exports["root"] / "table1.json")


def test_cli_help(capsys):
    for args in (["--help"], ["export", "--help"], ["push", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            hub.main(args)
        assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--results", "--tokenizer", "--license", "--private", "--revision", "--commit-message", "--token"):
        assert flag in text, flag


# ---------------------------------------------------------------------------------------------------------------------
# Push against a local stand-in for the Hub
# ---------------------------------------------------------------------------------------------------------------------


class LocalHub:
    """The few Hub endpoints create_repo / create_branch / upload_folder call (regular, base64 uploads: every
    test file is small, so the preupload answer is "regular" as the real Hub's would be for them). Records every
    call; shuts itself down after `lifetime` seconds at the latest."""

    def __init__(self, lifetime=120.0):
        self.calls, self.created, self.branches, self.commits = [], [], [], []
        local = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def _handle(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = unquote(urlparse(self.path).path)
                local.calls.append(dict(method=method, path=path, auth=self.headers.get("Authorization")))
                parts = path.strip("/").split("/")
                if method == "POST" and path == "/api/repos/create":
                    payload = json.loads(body)
                    local.created.append(payload)
                    repo = "/".join(x for x in (payload.get("organization"), payload["name"]) if x)
                    return self._reply(200, {"url": f"{local.url}/{repo}", "name": repo})
                if method == "POST" and path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                if method == "POST" and len(parts) >= 6 and parts[:2] == ["api", "models"]:
                    repo, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
                    if kind == "branch":
                        local.branches.append((repo, rev))
                        return self._reply(200, {})
                    if kind == "preupload":
                        files = json.loads(body)["files"]
                        return self._reply(200, {"files": [dict(path=f["path"], uploadMode="regular",
                                                                shouldIgnore=False, oid=None) for f in files]})
                    if kind == "commit":
                        lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                        local.commits.append(dict(repo=repo, revision=rev, lines=lines))
                        return self._reply(200, {"commitUrl": f"{local.url}/{repo}/commit/{'0' * 40}",
                                                 "commitOid": "0" * 40, "pullRequestUrl": None})
                self._reply(404, {"error": f"not served by the local hub: {method} {path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs=dict(poll_interval=0.1), daemon=True)
        self._timer = threading.Timer(lifetime, self.server.shutdown)
        self._timer.daemon = True

    def __enter__(self):
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def uploaded(self):
        files = {}
        for commit in self.commits:
            for line in commit["lines"]:
                if line["key"] == "file":
                    value = line["value"]
                    assert value.get("encoding", "base64") == "base64"
                    files[value["path"]] = base64.b64decode(value["content"])
        return files


def test_push_uploads_exactly_the_exported_folder(exports, tmp_path):
    folder = Path(exports["classifier"]["folder"])
    with LocalHub() as local:
        env = _cli_env(HF_ENDPOINT=local.url, HF_TOKEN="hf_local_test_token", HF_HOME=str(tmp_path / "hf"))
        proc = _cli("push", folder, "me/imdb-cta", "--private", "--revision", "v1", "--commit-message",
                    "first upload", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Pushed" in proc.stdout and local.url in proc.stdout
        assert local.created == [dict(name="imdb-cta", organization="me", visibility="private", type="model")] or (
            local.created and local.created[0]["name"] == "imdb-cta" and local.created[0].get("private", True))
        assert local.branches == [("me/imdb-cta", "v1")]
        assert len(local.commits) == 1 and local.commits[0]["revision"] == "v1"
        header = local.commits[0]["lines"][0]
        assert header["key"] == "header" and header["value"]["summary"] == "first upload"
        uploaded = local.uploaded()
        exported = {p.name: p.read_bytes() for p in folder.iterdir()}
        assert sorted(uploaded) == sorted(exported)
        for name, data in exported.items():
            assert uploaded[name] == data, name
        hub_calls = [c for c in local.calls if c["path"].startswith(("/api/repos", "/api/models"))]
        assert hub_calls and all(c["auth"] == "Bearer hf_local_test_token" for c in hub_calls)

        # the python API pushes the same way (token argument, explicit endpoint, default branch)
        url = hub.push_to_hub_folder(folder, "me/imdb-cta-2", token="hf_api_token", endpoint=local.url)
        assert url.startswith(local.url) and local.commits[-1]["revision"] == "main"
        assert sorted(local.uploaded()) == sorted(exported)


def test_push_errors_are_clear(exports, tmp_path, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub import constants

    folder = exports["causal_lm"]["folder"]
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no HF_TOKEN, no saved login
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert hub.main(["push", str(folder), "me/x"]) == 2
    err = capsys.readouterr().err
    assert "Not logged in" in err and "hf auth login" in err and "--token" in err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.main(["push", str(folder), "me/x", "--token", "hf_x"]) == 2
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(hub.HubPushError, match="Cannot reach the Hub"):  # nothing listens on port 9
        hub.push_to_hub_folder(folder, "me/x", token="hf_x", endpoint="http://127.0.0.1:9")
    assert hub.main(["push", str(tmp_path / "missing"), "me/x", "--token", "hf_x"]) == 2
    assert "cta-hub export" in capsys.readouterr().err
    with pytest.raises(hub.HubPushError, match="REPO_ID"):
        hub.push_to_hub_folder(folder, "a/b/c", token="hf_x")


def test_trainer_hooks(exports, tmp_path):
    """examples/common.py calls write_model_card(output_dir, results=run_results, task=..., dataset=...);
    publish_trainer_model exports output_dir (and pushes only with --push_to_hub)."""
    import shutil
    from types import SimpleNamespace

    from huggingface_hub import ModelCard

    out = tmp_path / "run"
    shutil.copytree(exports["root"] / "lm", out)
    run = dict(script="run_clm.py", task="wikitext_lm", seed=3, test_perplexity=40.0, test_loss=3.7,
               eval_perplexity=41.0, learning_rate=1e-3)
    path = hub.write_model_card(out, results=run, task="text-generation", dataset="wikitext")
    data = ModelCard.load(str(path)).data.to_dict()
    assert data["datasets"] == ["wikitext"] and data["model-index"][0]["results"][0]["metrics"][0]["value"] == 40.0
    assert hub.write_model_card(tmp_path / "nothing-here", results=run) is None  # logged, never raises

    args = SimpleNamespace(output_dir=str(out), hub_model_id=None, push_to_hub=False, hub_private_repo=None,
                           hub_token=None, hub_revision=None)
    trainer = SimpleNamespace(args=args, is_world_process_zero=lambda: True)
    assert hub.publish_trainer_model(trainer, results=run, task="text-generation", dataset="wikitext",
                                     verify_load=False) is None
    exported = out / "hub_export"
    assert (exported / "README.md").is_file() and (exported / "model.safetensors").is_file()
    assert "run" in (exported / "README.md").read_text()  # repo id defaults to the output folder's name
