"""Publishing CTA checkpoints on the Hugging Face Hub: self-contained export, model card, push.

    cta-hub export MODEL_DIR OUT_DIR [--results all_results.json] [--tokenizer DIR] [--dataset imdb] ...
    cta-hub push OUT_DIR REPO_ID [--private] [--revision BRANCH] [--commit-message MSG] [--token TOKEN]
    cta-hub card MODEL_DIR [--results all_results.json]       # print the rendered README.md only
    cta-hub export --adapter ADAPTER_DIR OUT_DIR [--base-model ORG/NAME] [--base-model-dir DIR] [--results JSON]

``export`` re-saves a checkpoint with its code files, safetensors weights, tokenizer and a ``hub_cards/`` card, and
checks that it loads with ``trust_remote_code=True`` without ``cta``. Trainer hooks: :func:`write_model_card`,
:func:`publish_trainer_model` (``trainer.push_to_hub()`` would replace the card with Trainer's and upload pickles).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id
from transformers import AutoTokenizer

from . import hub_adapter
from .hub_adapter import (BLOCK_CTA, PICKLE_SUFFIXES, AdapterExportError, card_pde_fields, check_export_arguments,
                          coefficient_text, compare_outputs, hub_id_or_none, isolated_python, model_output,
                          padded_batch, render_card)
from .pde_cta import PDERefinement
from .transformers_compat import get_relative_import_files

HUB_TAGS = ["custom_code", "continuous-time-attention", "pde", "cta"]
DEFAULT_LICENSE = "apache-2.0"
PIPELINE_TAGS = {"AutoModelForSequenceClassification": "text-classification", "AutoModelForCausalLM": "text-generation",
                 "AutoModelForMaskedLM": "fill-mask", "AutoModelForTokenClassification": "token-classification",
                 "AutoModelForQuestionAnswering": "question-answering", "AutoModel": "feature-extraction"}
# Example-script task keys -> (Hub dataset id or None, config, split the scripts evaluate on).
TASK_DATASETS = {"imdb": ("imdb", None, "test"), "imdb_bytes": ("imdb", None, "test"),
                 "ag_news": ("ag_news", None, "test"), "sst2": ("glue", "sst2", "validation"),
                 "listops": (None, None, None), "wikitext": ("wikitext", "wikitext-2-raw-v1", None),
                 "wikitext_lm": ("wikitext", "wikitext-2-raw-v1", None)}
# Keys of a save_metrics JSON that are bookkeeping, not model quality.
_NOT_QUALITY = ("runtime", "per_second", "flos", "epoch", "step", "num_")


class HubExportError(RuntimeError):
    """The checkpoint cannot be exported, or an exported folder failed verification."""


class HubPushError(RuntimeError):
    """The folder cannot be pushed (missing, or fails verification). Hub errors are huggingface_hub's own."""


def load_results(path_or_dict) -> dict:
    """Reads a ``Trainer.save_metrics`` JSON (path or dict) into ``{"metrics": {name: (value, split)}, "training",
    "source"}``: ``eval_*``/``test_*`` quality numbers (``test_`` wins; no runtimes or throughputs), other scalars."""
    if isinstance(path_or_dict, dict):
        data, source = path_or_dict, "<metrics>"
    else:
        source = str(path_or_dict)
        try:
            data = json.loads(Path(source).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise HubExportError(f"Cannot read the results JSON {source}: {err}") from None
    metrics, training = {}, {}
    for key, value in (data.items() if isinstance(data, dict) else ()):
        prefix, _, name = key.partition("_")
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if prefix in ("eval", "test") and numeric and not any(w in name for w in _NOT_QUALITY):
            if prefix == "test" or name not in metrics:
                metrics[name] = (float(value), "test" if prefix == "test" else None)
        elif isinstance(value, (str, int, float, bool)) and prefix not in ("eval", "test"):
            training[key] = value
    if not metrics:
        raise HubExportError(f"{source} holds no eval_*/test_* metrics: pass the JSON that Trainer.save_metrics "
                             "writes (all_results.json, eval_results.json or test_results.json).")
    return {"metrics": metrics, "training": training, "source": Path(source).name}


def _datasets(names) -> list:
    """(hub id, config, split) per dataset; example task keys (``sst2``...) map to their Hub dataset."""
    out = []
    for name in [names] if isinstance(names, str) else list(names or []):
        entry = TASK_DATASETS.get(name, (name, None, None))
        if entry[0] and entry[0] not in [d[0] for d in out]:
            out.append(entry)
    return out


def _read_config(model_dir: Path) -> dict:
    if not (model_dir / "config.json").is_file():
        hint = " It is a PEFT adapter folder: pass --adapter." if hub_adapter.is_adapter_folder(model_dir) else ""
        raise HubExportError(f"{model_dir} has no config.json: not a saved transformers checkpoint.{hint}")
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))


def _is_patched(config: dict) -> bool:
    return isinstance(config.get("cta_patch"), dict) and config.get("model_type") != "cta"


def _architecture(config: dict) -> str:
    return (config.get("architectures") or ["CTAModel"])[0]


def _auto_class(config: dict) -> str:
    """The Auto class of ``auto_map`` that loads the saved architecture."""
    return next((auto for auto, ref in (config.get("auto_map") or {}).items()
                 if str(ref).rsplit(".", 1)[-1] == _architecture(config)), "AutoModel")


def _load_model(model_dir: Path, config: dict):
    import cta

    if _is_patched(config):
        return cta.load_patched(str(model_dir), dtype="auto")
    if config.get("model_type") != "cta":
        raise HubExportError(f"{model_dir} holds a {config.get('model_type')!r} model without PDE refinement: export a "
                             "native CTA model or one patched with `cta.patch_model` and saved with `save_pretrained`.")
    return getattr(cta, _architecture(config)).from_pretrained(str(model_dir), dtype="auto")


def pde_summary(config: dict, model=None, max_sites: int = 24) -> dict:
    """The PDE settings of a native (``pde_*`` keys) or patched (``cta_patch``) config, plus learned coefficients."""
    patched = _is_patched(config)
    src = {k.removeprefix("pde_"): v for k, v in (config["cta_patch"] if patched else config).items()
           if patched or k.startswith("pde_")}
    src.setdefault("causal", config.get("is_causal", False))
    sites = [(n, m) for n, m in (model.named_modules() if model is not None else []) if isinstance(m, PDERefinement)]
    return dict(card_pde_fields(src), num_sites=len(sites), sites=[
        dict(name=n, **{k: coefficient_text(c) or "—" for k, c in zip(("alpha", "beta"), m.coefficients())})
        for n, m in sites[:max_sites]])


def render_model_card(model_dir, *, repo_id: Optional[str] = None, results=None, license: Optional[str] = None,
                      datasets=None, base_model: Optional[str] = None, language: Optional[list] = None,
                      templates=None, model=None, title: Optional[str] = None) -> ModelCard:
    """The README card (``huggingface_hub.ModelCard``) of the checkpoint in ``model_dir``. ``results``: see
    :func:`load_results`; ``datasets``: Hub ids or example task keys, the first is the ``model-index``'s; ``model``:
    the loaded model (learned coefficients, parameter count); ``templates``: a folder like ``hub_cards/``."""
    model_dir = Path(model_dir)
    config = _read_config(model_dir)
    for hub_id in (repo_id, base_model):
        validate_repo_id(hub_id)  # None passes
    repo_id = repo_id or model_dir.resolve().name
    results = load_results(results) if results is not None else None
    auto_class = _auto_class(config)
    task = PIPELINE_TAGS.get(auto_class, "feature-extraction")
    patched = _is_patched(config)
    base_model = (base_model or hub_id_or_none(config.get("_name_or_path"))) if patched else None
    base_type = str(config.get("model_type")).removeprefix("cta_patched_")
    pde = pde_summary(config, model)
    datasets = _datasets(datasets)
    hub_id, ds_config, ds_split = datasets[0] if datasets else (None, None, None)
    metric_rows = [dict(name=name, value=f"{value:.4g}", split=split or ds_split or "eval")
                   for name, (value, split) in (results["metrics"].items() if results else ())]
    eval_results = [EvalResult(task_type=task, task_name=task.replace("-", " ").capitalize(), dataset_type=hub_id,
                               dataset_name=hub_id, dataset_config=ds_config, dataset_split=split or ds_split,
                               metric_type=name, metric_value=value)
                    for name, (value, split) in results["metrics"].items()] if results and hub_id else None
    card_data = ModelCardData(
        library_name="transformers", pipeline_tag=task, license=license or ("other" if patched else DEFAULT_LICENSE),
        tags=HUB_TAGS + [f"pde-{pde['type'].replace('_', '-')}"] + (["cta-patched", base_type] if patched else []),
        language=language or None, datasets=[d[0] for d in datasets] or None,
        metrics=sorted(results["metrics"]) if results else None, base_model=base_model,
        model_name=repo_id.split("/")[-1] if eval_results else None, eval_results=eval_results)
    tok_config = model_dir / "tokenizer_config.json"
    n_params = model.num_parameters() if model is not None else None
    id2label = config.get("id2label") or {}
    name = "patched_model.md" if patched else {"text-classification": "cta_classifier.md",
                                               "text-generation": "cta_causal_lm.md"}.get(task, "cta_base_model.md")
    return render_card(
        name, templates, card_data, task, title=title or repo_id.split("/")[-1], repo_id=repo_id, auto_class=auto_class,
        architecture=_architecture(config), arch=config, has_tokenizer=tok_config.is_file(),
        tokenizer_name=json.loads(tok_config.read_text()).get("tokenizer_class") if tok_config.is_file() else None,
        pde=pde, patched=patched, patch=config.get("cta_patch") or {}, base_model=base_model, base_model_type=base_type,
        labels=[id2label[k] for k in sorted(id2label, key=int)], datasets=[d[0] for d in datasets],
        num_parameters=f"{n_params / 1e6:.2f}M ({n_params:,})" if n_params else None,
        results=results, metric_rows=metric_rows, eval_dataset=hub_id, eval_config=ds_config)


def export_for_hub(model_dir, out_dir, *, results=None, tokenizer=None, license: Optional[str] = None,
                   datasets=None, base_model: Optional[str] = None, language: Optional[list] = None,
                   repo_id: Optional[str] = None, templates=None, overwrite: bool = False, verify: bool = True,
                   verify_load: bool = True, atol: float = 1e-4) -> Path:
    """Writes a self-contained Hub folder for the checkpoint in ``model_dir`` (re-saved with ``tokenizer``, default
    ``model_dir``'s if any), then :func:`verify_hub_folder` (load check unless ``verify_load=False``); returns it."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_export_arguments(model_dir, "MODEL_DIR", out_dir, overwrite, repo_id, HubExportError)
    config = _read_config(model_dir)
    model = _load_model(model_dir, config).eval()
    tok_src = tokenizer or (model_dir if (model_dir / "tokenizer_config.json").is_file() else None)
    try:
        tok = AutoTokenizer.from_pretrained(str(tok_src)) if tok_src else None
    except (OSError, ValueError) as err:
        raise HubExportError(f"The tokenizer in {tok_src} does not load: {err}") from err
    if out_dir.exists():
        shutil.rmtree(out_dir)  # --overwrite
    model.save_pretrained(str(out_dir))
    if tok is not None:
        tok.save_pretrained(str(out_dir))
    render_model_card(out_dir, repo_id=repo_id or out_dir.resolve().name, results=results, license=license,
                      datasets=datasets, base_model=base_model, language=language, templates=templates,
                      model=model).save(out_dir / "README.md")
    if verify:
        verify_hub_folder(out_dir, reference_model=model if verify_load else None, atol=atol)
    return out_dir


def verify_hub_folder(folder, *, reference_model=None, atol: float = 1e-4, timeout: int = 600) -> dict:
    """Checks an exported folder (``auto_map``, its code files and their relative imports, safetensors only, a card;
    an adapter's: :func:`cta.hub_adapter.verify_adapter_folder`); with ``reference_model``, that it loads with
    ``trust_remote_code=True`` without ``cta`` and gives its outputs within ``atol`` (relative to their scale). Raises
    :class:`HubExportError` naming every problem."""
    folder = Path(folder)
    if hub_adapter.is_adapter_folder(folder):
        if reference_model is not None:
            raise HubExportError(f"{folder} is an adapter folder: check its load with "
                                 "`cta.hub_adapter.verify_adapter_folder(folder, base_model_dir=...)`.")
        try:
            return hub_adapter.verify_adapter_folder(folder)
        except AdapterExportError as err:
            raise HubExportError(str(err)) from err
    config = _read_config(folder)
    auto_map, problems, code_files = config.get("auto_map") or {}, [], set()
    if _auto_class(config) not in auto_map:
        problems.append(f"config.json's `auto_map` has no entry for {config.get('architectures')}")
    for module in {str(ref).split(".")[0] for ref in auto_map.values()}:
        try:
            code_files |= {module + ".py"} | {Path(f).name for f in get_relative_import_files(folder / f"{module}.py")}
        except FileNotFoundError as err:
            problems.append(f"code file missing (needed by auto_map or a relative import): {Path(err.filename).name}")
    files = sorted(p.name for p in folder.iterdir())
    if "README.md" not in files:
        problems.append("README.md missing")
    if not any(f.endswith(".safetensors") for f in files):
        problems.append("no .safetensors weights")
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    problems += [f"pickle files present (safetensors only): {pickles}"] if pickles else []
    if problems:
        raise HubExportError(f"{folder} failed verification:\n- " + "\n- ".join(problems))
    report = {"files": files, "code_files": sorted(code_files)}
    if reference_model is not None:
        report["max_abs_diff"] = _verify_load(folder, config, reference_model, atol, timeout)
    return report


_LOAD_SCRIPT = BLOCK_CTA + r"""
import torch, transformers
spec = json.load(open(sys.argv[1]))
model = getattr(transformers, spec["auto"]).from_pretrained(spec["folder"], trust_remote_code=True, dtype="auto")
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    out = model.eval()(input_ids=torch.tensor(spec["ids"]), attention_mask=torch.tensor(spec["mask"]))
torch.save((out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float(), spec["out"])
"""


def _verify_load(folder: Path, config: dict, reference_model, atol: float, timeout: int) -> float:
    auto = _auto_class(config)
    ids, mask = padded_batch(int(config.get("vocab_size") or 100), PIPELINE_TAGS.get(auto) == "text-generation")
    expected = model_output(reference_model, ids, mask)
    with tempfile.TemporaryDirectory(prefix="cta-hub-verify-") as work:
        spec = dict(folder=str(folder.resolve()), auto=auto, ids=ids.tolist(), mask=mask.tolist(),
                    out=str(Path(work) / "out.pt"))
        (Path(work) / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run(**isolated_python(_LOAD_SCRIPT, Path(work) / "spec.json"), capture_output=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise HubExportError(f"{folder} does not load with trust_remote_code=True without the cta package:\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        got = torch.load(spec["out"])
    diff, problem = compare_outputs(got, expected, mask, atol)
    if problem:
        raise HubExportError(f"{folder}: outputs after reload differ from the original model's: {problem}.")
    return diff


def push_to_hub_folder(folder, repo_id: str, *, private: bool = False, revision: Optional[str] = None,
                       commit_message: Optional[str] = None, token: Optional[str] = None,
                       endpoint: Optional[str] = None, create_pr: bool = False, check: bool = True) -> str:
    """``HfApi.create_repo`` (+ ``create_branch`` for ``revision``) + ``upload_folder`` after the static checks of
    :func:`verify_hub_folder` (unless ``check=False``); returns the commit URL. Hub errors are huggingface_hub's own."""
    validate_repo_id(repo_id)
    folder = Path(folder)
    if not folder.is_dir():
        raise HubPushError(f"OUT_DIR {folder} is not a folder: run `cta-hub export MODEL_DIR {folder}` first.")
    if check:
        try:
            verify_hub_folder(folder)
        except HubExportError as err:
            raise HubPushError(f"Refusing to push a folder that fails verification: {err}") from err
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
    kind = "adapter" if hub_adapter.is_adapter_folder(folder) else "model"
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                             commit_message=commit_message or f"Upload CTA {kind} ({folder.name}) with cta-hub",
                             create_pr=create_pr)
    return str(getattr(info, "commit_url", info))


def write_model_card(output_dir, *, results=None, task: Optional[str] = None, dataset=None,
                     repo_id: Optional[str] = None, **card_kwargs) -> Optional[Path]:
    """Example-script hook: writes ``output_dir/README.md`` for the checkpoint saved there; returns its path (``task``
    is informational). Never raises: a card problem is logged, not fatal to a finished training run."""
    try:
        card = render_model_card(output_dir, repo_id=repo_id, results=results, datasets=dataset, **card_kwargs)
        card.save(Path(output_dir) / "README.md")
        return Path(output_dir) / "README.md"
    except Exception as err:  # noqa: BLE001
        logging.getLogger(__name__).warning("cta.hub: could not write the model card in %s: %s", output_dir, err)
        return None


def publish_trainer_model(trainer, *, results=None, task: Optional[str] = None, dataset=None, tokenizer=None,
                          export_dir=None, **export_kwargs) -> Optional[str]:
    """Trainer hook (main process only): exports ``output_dir`` to ``export_dir`` (default ``output_dir/hub_export``)
    and, with ``args.push_to_hub``, pushes it to ``hub_model_id`` (default: folder name); returns its URL or None."""
    args = trainer.args
    if not trainer.is_world_process_zero():
        return None
    out = Path(export_dir) if export_dir is not None else Path(args.output_dir) / "hub_export"
    repo_id = args.hub_model_id or Path(args.output_dir).resolve().name
    export_kwargs.setdefault("datasets", dataset)
    export_for_hub(args.output_dir, out, results=results, tokenizer=tokenizer, repo_id=repo_id, overwrite=True,
                   **export_kwargs)
    return push_to_hub_folder(out, repo_id, private=bool(args.hub_private_repo), token=args.hub_token,
                              revision=getattr(args, "hub_revision", None)) if args.push_to_hub else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cta-hub", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Export CTA checkpoints (native or patched) or CTA adapters (--adapter) as Hugging Face Hub "
                    "folders with a card, verify them, and push them.",
        epilog="examples:\n  cta-hub export runs/imdb-cta hub/imdb-cta --results runs/imdb-cta/all_results.json "
               "--dataset imdb --repo-id me/imdb-cta\n  cta-hub push hub/imdb-cta me/imdb-cta --private\n"
               "  cta-hub export --adapter runs/llama-cta/adapter hub/llama-cta-adapter --base-model "
               "meta-llama/Llama-3.2-1B --base-model-dir ~/models/Llama-3.2-1B")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{export,push,card}")

    def model_options(p):
        p.add_argument("model_dir", metavar="MODEL_DIR", help="saved checkpoint (save_pretrained / Trainer "
                       "output_dir); with --adapter, a PeftModel.save_pretrained folder")
        p.add_argument("--adapter", action="store_true", help="MODEL_DIR is an adapter of a patched model saved with "
                       "cta.CTALoraConfig: publish it with an adapter card (library_name: peft). A plain LoRA adapter "
                       "is refused: it would load without its PDE")
        p.add_argument("--results", metavar="JSON", help="Trainer.save_metrics JSON (all_results.json...) whose "
                       "eval_*/test_* values fill the card's model-index; with --adapter, a result file with a "
                       "card_results block naming the adapter by its sha256 (results/pretrained_finetune.json)")
        p.add_argument("--dataset", action="append", dest="datasets", metavar="DATASET_ID", help="Hub dataset id or "
                       "example task key (imdb, sst2...); repeatable, the first is the model-index's")
        p.add_argument("--license", help=f"license id (default: {DEFAULT_LICENSE}; 'other' for patched models and "
                                         "adapters, whose base model's license applies)")
        p.add_argument("--language", action="append", help="language code of the training data (repeatable), e.g. en")
        p.add_argument("--base-model", help="Hub id of the base model of a patched checkpoint or an adapter (default: "
                                            "the recorded _name_or_path / base_model_name_or_path if a Hub id)")
        p.add_argument("--repo-id", help="repository id the card's usage snippet loads (default: the folder's name)")
        p.add_argument("--templates", metavar="DIR", help="folder with model-card templates named like hub_cards/")
        p.add_argument("--pip-spec", default=hub_adapter.DEFAULT_PIP_SPEC, metavar="SPEC", help="with --adapter: "
                       f"what the card's `pip install` line installs (default: {hub_adapter.DEFAULT_PIP_SPEC!r})")

    p = sub.add_parser("export", help="write a self-contained Hub folder (or an adapter's, --adapter) and verify it",
                       description="Write OUT_DIR (code files, safetensors weights, tokenizer, README.md card), then "
                                   "check that it loads with trust_remote_code=True without the cta package and gives "
                                   "the same outputs. With --adapter and --base-model-dir: check that the plain base + "
                                   "the adapter loads after `import cta` with the same logits and is refused without.")
    model_options(p)
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (flat; must be empty unless --overwrite)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer to save with the model (default: MODEL_DIR's, if "
                                                      "any; not with --adapter)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty OUT_DIR")
    p.add_argument("--base-model-dir", metavar="DIR", help="with --adapter: local folder of the plain base model for "
                                                           "the load checks (skipped without it)")
    p.add_argument("--no-verify-load", action="store_true", help="skip the load checks (static checks still run)")
    p.add_argument("--atol", type=float, default=1e-4, help="tolerance of the output comparison (default: 1e-4)")

    p = sub.add_parser("push", help="upload an exported folder to the Hub",
                       description="HfApi.create_repo + upload_folder. Token: --token, else HF_TOKEN, else the token "
                                   "saved by `hf auth login`; HF_ENDPOINT selects another endpoint.")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder written by `cta-hub export`")
    p.add_argument("repo_id", metavar="REPO_ID", help="target repository, user/name or org/name")
    p.add_argument("--private", action="store_true", help="create the repository as private (if it does not exist)")
    p.add_argument("--revision", help="branch to push to (created from the default branch if missing)")
    p.add_argument("--commit-message", help="commit message (default: 'Upload CTA model (OUT_DIR) with cta-hub')")
    p.add_argument("--token", help="Hub token with write access (default: HF_TOKEN or the saved login)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")

    p = sub.add_parser("card", help="print the model card of a saved checkpoint or adapter (--adapter; no export)")
    model_options(p)
    return parser


def _adapter_main(args, card_args: dict) -> None:
    """``export --adapter`` / ``card --adapter``."""
    if getattr(args, "tokenizer", None):
        raise HubExportError("--tokenizer does not apply to --adapter (the base model's tokenizer is used).")
    card_args = dict(card_args, datasets=[d[0] for d in _datasets(card_args["datasets"])], pip_spec=args.pip_spec)
    if args.command == "card":
        sys.stdout.write(str(hub_adapter.render_adapter_card(args.model_dir, **card_args)))
        return
    report = hub_adapter.export_adapter_for_hub(args.model_dir, args.out_dir, base_model_dir=args.base_model_dir,
                                                overwrite=args.overwrite, verify_load=not args.no_verify_load,
                                                atol=args.atol, **card_args)
    print("\n".join(hub_adapter.report_lines(report)))


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    card_args = {k: getattr(args, k, None) for k in ("results", "license", "datasets", "base_model", "language",
                                                     "repo_id", "templates")}
    try:
        if getattr(args, "adapter", False):
            _adapter_main(args, card_args)
        elif getattr(args, "base_model_dir", None):
            raise HubExportError("--base-model-dir is for --adapter exports (the plain base model's local folder).")
        elif args.command == "export":
            out = export_for_hub(args.model_dir, args.out_dir, tokenizer=args.tokenizer, overwrite=args.overwrite,
                                 verify_load=not args.no_verify_load, atol=args.atol, **card_args)
            print(f"Exported and verified {out}:")
            print("\n".join(f"  {path.name:40s} {path.stat().st_size:>12,d} bytes" for path in sorted(out.iterdir())))
        elif args.command == "push":
            url = push_to_hub_folder(args.out_dir, args.repo_id, private=args.private, revision=args.revision,
                                     commit_message=args.commit_message, token=args.token, create_pr=args.create_pr)
            print(f"Pushed {args.out_dir} to {args.repo_id}: {url}")
        else:
            sys.stdout.write(str(render_model_card(args.model_dir, **card_args)))
    except (HubExportError, HubPushError, AdapterExportError, HFValidationError, HfHubHTTPError,
            OfflineModeIsEnabled) as err:
        print(f"cta-hub {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
