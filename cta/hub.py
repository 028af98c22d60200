"""Publishing CTA checkpoints on the Hugging Face Hub: self-contained export, model cards, push.

Command line (``cta-hub``, declared in setup.py)::

    cta-hub export MODEL_DIR OUT_DIR [--results results/imdb.json] [--tokenizer DIR] [--license apache-2.0]
                                     [--repo-id user/name] [--base-model org/name] [--dataset imdb] ...
    cta-hub push OUT_DIR REPO_ID [--private] [--revision BRANCH] [--commit-message MSG] [--token TOKEN]
    cta-hub card MODEL_DIR [--results ...]          # print the rendered README.md only

``export`` reads a saved checkpoint (a native CTA model or a pretrained model patched with ``cta.patch_model``), and
writes a folder that loads with ``AutoModel*.from_pretrained(folder_or_repo, trust_remote_code=True)`` where only
torch + transformers are installed: ``config.json`` with ``auto_map``, the flat code files, safetensors weights only,
the tokenizer files, and a ``README.md`` model card rendered from ``hub_cards/``. It then verifies the folder:
static checks (every ``auto_map`` module and every sibling import present, no pickle weights, card metadata valid)
and a load check in a subprocess in which ``import cta`` is blocked, comparing logits with the original model.

``push`` uploads such a folder with ``huggingface_hub`` (``create_repo`` + ``upload_folder``; the token comes from
``--token``, ``HF_TOKEN`` or ``hf auth login``). ``HF_ENDPOINT`` selects another Hub endpoint.

Python API::

    from cta.hub import (export_for_hub, push_to_hub_folder, render_model_card, load_results,
                         write_model_card, publish_trainer_model, verify_hub_folder)

Trainer hooks (what the example scripts call so that ``--push_to_hub`` produces this card, not Trainer's generic
one)::

    trainer.train()
    trainer.save_model()                                   # output_dir: weights, config, code files
    tokenizer.save_pretrained(training_args.output_dir)
    hub.write_model_card(output_dir, results=run_results, dataset="imdb")   # README.md in output_dir
    hub.publish_trainer_model(trainer, results=run_results, dataset="imdb") # export (+ push if --push_to_hub)

``publish_trainer_model`` exports ``output_dir`` to ``output_dir/hub_export`` and, when
``trainer.args.push_to_hub`` is set, pushes it to ``hub_model_id`` (default: the output folder's name) honouring
``hub_private_repo``, ``hub_revision`` and ``hub_token``. Call it *instead of* ``trainer.push_to_hub()``: Trainer's
push rewrites README.md with its generic card and uploads pickles (``training_args.bin``). ``results`` may be the
run's results dict (``run_results.json``), a table JSON of ``examples/reproduce.py`` or the schema of
:func:`load_results`.

This module is not needed at model load time (it is never copied next to the weights), so it may import
huggingface_hub freely.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Union

PathLike = Union[str, os.PathLike]

# ---------------------------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------------------------

HUB_TAGS = ("custom_code", "continuous-time-attention", "pde", "cta")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
DEFAULT_LICENSE = "apache-2.0"

# Trainer metric keys that are not model quality.
_NON_QUALITY_METRICS = re.compile(r"(runtime|per_second|^epoch$|^step$|flos|^num_|^total_|^train_)")
_BASELINE_NAMES = re.compile(r"(baseline|vanilla|no[_-]?pde|standard|plain|transformer$|steps?[_=-]?0$|^base$)", re.I)

_AUTO_BY_SUFFIX = (
    ("ForSequenceClassification", "AutoModelForSequenceClassification", "text-classification"),
    ("ForCausalLM", "AutoModelForCausalLM", "text-generation"),
    ("ForMaskedLM", "AutoModelForMaskedLM", "fill-mask"),
    ("ForTokenClassification", "AutoModelForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "AutoModelForQuestionAnswering", "question-answering"),
    ("Model", "AutoModel", "feature-extraction"),
)

_TASK_NAMES = {
    "text-classification": "Text Classification",
    "text-generation": "Causal Language Modeling",
    "fill-mask": "Masked Language Modeling",
    "feature-extraction": "Feature Extraction",
    "token-classification": "Token Classification",
    "question-answering": "Question Answering",
}


class HubExportError(RuntimeError):
    """The checkpoint cannot be exported, or the exported folder failed verification."""


class HubPushError(RuntimeError):
    """Pushing to the Hub failed (not logged in, offline, rejected token, no write access...)."""


# ---------------------------------------------------------------------------------------------------------------------
# Results JSON (the one place that knows its schema)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class VariantResult:
    name: str
    metrics: dict  # metric -> {"mean": float, "std": float | None, "n": int}
    seeds: list = field(default_factory=list)
    is_baseline: bool = False
    args: list = field(default_factory=list)


@dataclass
class ResultsSummary:
    task_type: Optional[str] = None
    task_name: Optional[str] = None
    dataset_id: Optional[str] = None
    dataset_name: Optional[str] = None
    dataset_config: Optional[str] = None
    dataset_split: Optional[str] = None
    dataset_revision: Optional[str] = None
    variants: list = field(default_factory=list)  # list[VariantResult]
    training: dict = field(default_factory=dict)
    command: Optional[str] = None
    source: Optional[str] = None
    warning: Optional[str] = None
    default_variant: Optional[str] = None

    @property
    def metric_names(self) -> list:
        names = []
        for v in self.variants:
            for m in v.metrics:
                if m not in names:
                    names.append(m)
        return names

    @property
    def metric_headers(self) -> list:
        headers = {}
        for v in self.variants:
            for m, e in v.metrics.items():
                headers.setdefault(m, f"{m} ({e['unit']})" if e.get("unit") else m)
        return [headers[m] for m in self.metric_names]

    def variant(self, name: Optional[str] = None) -> Optional[VariantResult]:
        """The variant this checkpoint belongs to: ``name`` if given, else the single non-baseline variant."""
        if name is not None:
            for v in self.variants:
                if v.name == name:
                    return v
            raise HubExportError(
                f"`results_variant`={name!r} is not in {self.source}; variants: {[v.name for v in self.variants]}."
            )
        if self.default_variant is not None:
            return self.variant(self.default_variant)
        candidates = [v for v in self.variants if not v.is_baseline]
        if len(candidates) == 1:
            return candidates[0]
        if len(self.variants) == 1:
            return self.variants[0]
        if not candidates:
            return None
        raise HubExportError(
            f"{self.source} holds several non-baseline variants {[v.name for v in candidates]}; choose the one this "
            "checkpoint belongs to with `--results-variant NAME`."
        )


def _first(d: dict, *keys, default=None):
    for k in keys:
        if isinstance(d, dict) and d.get(k) is not None:
            return d[k]
    return default


def _metric_key(key: str) -> str:
    for prefix in ("eval_", "test_", "predict_", "validation_", "val_"):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _is_quality_metric(key: str, value) -> bool:
    if isinstance(value, bool) or _NON_QUALITY_METRICS.search(key):
        return False
    if isinstance(value, dict):
        return "mean" in value
    return isinstance(value, (int, float)) and math.isfinite(float(value))


def _mean_std(values: list) -> dict:
    values = [float(v) for v in values]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    if std is not None and std <= 1e-12 * max(1.0, abs(mean)):
        std = 0.0  # identical values; no float noise in the card
    return {"mean": mean, "std": std, "n": len(values)}


def _metric_entry(value) -> dict:
    if isinstance(value, dict):
        return {"mean": float(value["mean"]), "std": value.get("std"), "n": int(value.get("n", value.get("count", 1)))}
    return {"mean": float(value), "std": None, "n": 1}


def _variant_name(record: dict, fallback: str) -> str:
    name = _first(record, "variant", "model", "name", "label", "method", "model_name", "arm")
    if isinstance(name, dict):
        name = _first(name, "name", "variant", default=fallback)
    return str(name) if name is not None else fallback


def _is_baseline(name: str, record: dict) -> bool:
    if isinstance(record, dict):
        if "is_baseline" in record or "baseline" in record and isinstance(record.get("baseline"), bool):
            return bool(record.get("is_baseline", record.get("baseline")))
        if record.get("pde_steps") == 0:
            return True
    return bool(_BASELINE_NAMES.search(name))


def _collect_metrics(record: dict) -> dict:
    source = _first(record, "metrics", "eval", "eval_metrics", "results", "test", "scores", default=None)
    if not isinstance(source, dict):
        source = {k: v for k, v in record.items() if k not in ("seed", "seeds", "n", "name", "model", "variant")}
    out = {}
    for key, value in source.items():
        if _is_quality_metric(key, value):
            out[_metric_key(key)] = value
    # flattened aggregates: {"accuracy_mean": .., "accuracy_std": ..}
    for key in list(out):
        if key.endswith("_mean"):
            base = key[: -len("_mean")]
            std = source.get(base + "_std", source.get("eval_" + base + "_std"))
            out[base] = {"mean": out.pop(key), "std": std, "n": _first(record, "n", "num_seeds", default=1)}
            out.pop(base + "_std", None)
    return {k: v for k, v in out.items() if not k.endswith("_std")}


# Example-script task keys -> (Hub dataset id or None, display name, config, evaluation split)
TASK_DATASETS = {
    "imdb": ("imdb", "IMDb", None, "test"),
    "imdb_bytes": ("imdb", "IMDb, byte level (LRA Text)", None, "test"),
    "ag_news": ("ag_news", "AG News", None, "test"),
    "sst2": ("glue", "GLUE SST-2", "sst2", "validation"),
    "listops": (None, "ListOps (LRA task, generated by examples/listops.py)", None, "test"),
    "wikitext": ("wikitext", "WikiText-2", "wikitext-2-raw-v1", "test"),
    "wikitext_lm": ("wikitext", "WikiText-2", "wikitext-2-raw-v1", "test"),
}
_PIPELINE_TAGS = set(_TASK_NAMES) | {"text-generation", "text-classification"}


def _task_key_from_text(text: str) -> Optional[str]:
    t = re.sub(r"[^a-z0-9]+", " ", str(text).lower())
    for key, words in (("imdb_bytes", ("bytes", "byte level", "lra text")), ("imdb", ("imdb",)),
                       ("ag_news", ("ag news",)), ("sst2", ("sst 2", "sst2")), ("listops", ("listops",)),
                       ("wikitext", ("wikitext", "wiki text"))):
        if any(w in t for w in words) and (key != "imdb_bytes" or "imdb" in t or "lra text" in t):
            return key
    return None


def _apply_task_key(summary: "ResultsSummary", key: Optional[str], description: str = "") -> None:
    if key not in TASK_DATASETS:
        return
    ds, name, cfg, split = TASK_DATASETS[key]
    if key.startswith("wikitext") and "103" in str(description):
        name, cfg = "WikiText-103", "wikitext-103-raw-v1"
    summary.dataset_id = ds or key
    summary.dataset_name = name
    summary.dataset_config = cfg
    summary.dataset_split = summary.dataset_split or split
    summary.task_type = summary.task_type or ("text-generation" if key.startswith("wikitext") else
                                              "text-classification")


def _split_of_metric(metric: str, default: Optional[str]) -> Optional[str]:
    if metric.startswith("test_"):
        return "test"
    return default


def _args_match_config(vargs: list, config: Optional[dict]) -> bool:
    if not config:
        return False
    pairs = {}
    i = 0
    while i < len(vargs):
        a = str(vargs[i])
        if a.startswith("--"):
            val = vargs[i + 1] if i + 1 < len(vargs) and not str(vargs[i + 1]).startswith("--") else "true"
            pairs[a[2:]] = str(val)
            i += 2 if val != "true" else 1
        else:
            i += 1
    src = dict(config)
    src.update(config.get("cta_patch") or {})
    for key, val in pairs.items():
        if key not in src:
            continue
        have = src[key]
        have = have[0] if isinstance(have, list) and len(have) == 1 else have
        if str(have).lower() != val.lower():
            return False
    return any(k in src for k in pairs)


def _load_table_results(data: dict, source: str, row: Optional[str], config: Optional[dict]) -> "ResultsSummary":
    cells = [c for c in data["cells"] if isinstance(c, dict)]
    rows = list(dict.fromkeys(c.get("row") for c in cells))
    if row is None:
        if len(rows) != 1:
            raise HubExportError(f"{source} has several rows {rows}; choose this checkpoint's with `--results-row`.")
        row = rows[0]
    elif row not in rows:
        raise HubExportError(f"`--results-row` {row!r} is not in {source}; rows: {rows}.")
    metric = str(data.get("metric") or "score")
    scale = data.get("metric_scale") or 1.0
    metric_label = _metric_key(metric)
    unit = "%" if scale == 100 else None
    summary = ResultsSummary(source=source, task_name=data.get("title"))
    _apply_task_key(summary, _task_key_from_text(f"{row} {data.get('title', '')} {data.get('table', '')}"))
    summary.dataset_split = _split_of_metric(metric, summary.dataset_split)
    baseline = data.get("baseline_variant")
    for c in cells:
        if c.get("row") != row or c.get("mean") is None:
            continue
        name = str(c.get("variant"))
        v = VariantResult(name, {metric_label: {"mean": float(c["mean"]), "std": c.get("std"), "n": int(c.get("n") or 1),
                                                "unit": unit}},
                          list(c.get("seeds") or []), name == baseline or _is_baseline(name, {}))
        v.args = list(c.get("variant_args") or [])
        summary.variants.append(v)
    matches = [v for v in summary.variants if not v.is_baseline and _args_match_config(v.args, config)]
    if len(matches) == 1:
        summary.default_variant = matches[0].name
    settings = data.get("settings") or {}
    summary.training = {"results table": data.get("table"), "row": row,
                        "higher is better": data.get("higher_is_better")}
    summary.training.update({k: v for k, v in settings.items() if v not in (None, [], {})})
    if settings.get("quick"):
        summary.warning = ("QUICK SMOKE RUN (tiny data slices, 2 optimiser steps): these numbers are meaningless and "
                           "only show that the pipeline runs.")
    runs = [r for c in cells if c.get("row") == row for r in (c.get("runs") or []) if isinstance(r, dict)]
    for key in ("epochs", "global_steps", "device", "world_size", "n_parameters", "num_train", "num_train_tokens"):
        vals = list(dict.fromkeys(str(r.get(key)) for r in runs if r.get(key) is not None))
        if vals:
            summary.training[key.replace("_", " ")] = ", ".join(vals[:4])
    if any(isinstance(r.get("leak_check"), dict) for r in runs):
        passed = all((r.get("leak_check") or {}).get("passed") for r in runs if r.get("leak_check") is not None)
        summary.training["future-token leak check"] = "passed on every run" if passed else "FAILED on some run"
    summary.command = f"python examples/reproduce.py --table {data.get('table')}" if data.get("table") else None
    return summary


def _load_run_results(data: dict, source: str) -> "ResultsSummary":
    summary = ResultsSummary(source=source)
    task = data.get("task")
    if task in _PIPELINE_TAGS:
        summary.task_type = task
    else:
        _apply_task_key(summary, task if task in TASK_DATASETS else _task_key_from_text(str(task)), str(data.get("data")))
    if data.get("eval_split") and not summary.dataset_split:
        summary.dataset_split = data["eval_split"]
    metrics = {}
    if not data.get("error"):
        for key, value in data.items():
            if str(key).startswith(("eval_", "test_")) and _is_quality_metric(_metric_key(key), value):
                name = _metric_key(key)
                if key.startswith("eval_") and ("test_" + name) in data and data["test_" + name] is not None:
                    continue  # the test number is the one reported
                metrics[name] = {"mean": float(value), "std": None, "n": 1}
    if any(str(k).startswith("test_") for k in metrics) or any(("test_" + m) in data for m in metrics):
        summary.dataset_split = "test"
    seed = data.get("seed")
    summary.variants = [VariantResult(f"this run (seed {seed})" if seed is not None else "this run", metrics,
                                      [seed] if seed is not None else [])] if metrics else []
    for key in ("tokenizer", "max_seq_length", "block_size", "train_fraction", "num_train", "num_train_tokens",
                "epochs", "max_steps", "global_steps", "per_device_train_batch_size", "world_size", "learning_rate",
                "seed", "train_loss", "train_runtime", "device", "git_commit"):
        if data.get(key) is not None:
            summary.training[key.replace("_", " ")] = data[key]
    if isinstance(data.get("leak_check"), dict):
        summary.training["future-token leak check"] = "passed" if data["leak_check"].get("passed") else "FAILED"
    if data.get("error"):
        summary.warning = f"The run reported an error, so no metric is published: {data['error']}"
    if data.get("script"):
        argv = " ".join(str(a) for a in (data.get("argv") or []))
        summary.command = f"python examples/{data['script']} {argv}".strip()
    return summary


def load_results(path_or_dict: Union[PathLike, dict], *, row: Optional[str] = None,
                 config: Optional[dict] = None) -> ResultsSummary:
    """Reads a results JSON written by ``examples/reproduce.py`` (or by hand) into a :class:`ResultsSummary`.

    Tolerant schema (every key optional, synonyms in brackets)::

        {
          "task": "text-classification",            [task_type, pipeline_tag]
          "task_name": "Sentiment classification",
          "dataset": "imdb" | {"id": "imdb", "name": "IMDb", "config": null, "split": "test", "revision": null},
                                                    [dataset_name / dataset_config / split at the top level]
          "runs": [{"variant": "cta", "seed": 0, "metrics": {"eval_accuracy": 0.87}}, ...],
                                                    [model/name/label; eval/results; per-seed records]
          "summary": {"cta": {"accuracy": {"mean": 0.87, "std": 0.01, "n": 3}}, "baseline": {...}},
                                                    [aggregate/variants/models; may also be a list of records
                                                     with "accuracy_mean"/"accuracy_std"]
          "training": {"epochs": 3, "learning_rate": 5e-4, ...},   [training_args/hyperparameters/config]
          "command": "python examples/run_classification.py ..."
        }

    Two more layouts are recognised: the table JSON of ``examples/reproduce.py`` (``cells`` of ``row`` x
    ``variant`` with ``mean``/``std``/``n``/``values``; pick the row with ``row`` when the table has several; the
    variant defaults to the one whose ``variant_args`` match ``config``), and a single run's ``run_results.json``
    (``script``, ``task``, ``seed``, ``eval_*``/``test_*`` metrics; reported as one seed).

    Per-seed ``runs`` are aggregated into mean ± sample std per variant unless a ``summary`` gives them. Metric keys
    lose Trainer's ``eval_``/``test_`` prefixes; runtimes, throughputs and epoch counters are dropped. A variant is a
    baseline when its name says so (baseline, vanilla, no_pde, steps 0...) or it records ``pde_steps: 0``.
    """
    if isinstance(path_or_dict, dict):
        data, source = path_or_dict, "<results>"
    else:
        source = str(path_or_dict)
        try:
            data = json.loads(Path(path_or_dict).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise HubExportError(f"`--results` file not found: {source}") from None
        except json.JSONDecodeError as err:
            raise HubExportError(f"`--results` file {source} is not valid JSON: {err}") from None
    if isinstance(data, list):
        data = {"runs": data}
    if not isinstance(data, dict):
        raise HubExportError(f"{source}: a results JSON must be an object or a list of runs, got {type(data).__name__}.")

    if isinstance(data.get("cells"), list):
        return _load_table_results(data, source, row, config)
    if isinstance(data.get("script"), str) or ("seed" in data and any(str(k).startswith(("eval_", "test_"))
                                                                      for k in data)):
        return _load_run_results(data, source)
    summary = ResultsSummary(source=source)
    summary.task_type = _first(data, "task", "task_type", "pipeline_tag")
    if isinstance(summary.task_type, dict):
        summary.task_name = summary.task_type.get("name")
        summary.task_type = summary.task_type.get("type") or summary.task_type.get("id")
    summary.task_name = _first(data, "task_name", default=summary.task_name)
    dataset = _first(data, "dataset", "dataset_id", "dataset_name")
    if isinstance(dataset, dict):
        summary.dataset_id = _first(dataset, "id", "type", "path", "name", "dataset_name")
        summary.dataset_name = _first(dataset, "pretty_name", "name", "display_name", default=summary.dataset_id)
        summary.dataset_config = _first(dataset, "config", "config_name", "subset")
        summary.dataset_split = _first(dataset, "split", "eval_split", "test_split")
        summary.dataset_revision = _first(dataset, "revision")
    elif dataset is not None:
        summary.dataset_id = str(dataset)
        summary.dataset_name = str(_first(data, "dataset_pretty_name", "dataset_display_name", default=dataset))
    summary.dataset_config = _first(data, "dataset_config", "dataset_config_name", default=summary.dataset_config)
    summary.dataset_split = _first(data, "split", "eval_split", "dataset_split", default=summary.dataset_split)
    training = _first(data, "training", "training_args", "hyperparameters", "train_config", "config", default={})
    summary.training = dict(training) if isinstance(training, dict) else {}
    summary.command = _first(data, "command", "cmd", "reproduce")

    variants: dict = {}
    aggregate = _first(data, "summary", "aggregate", "aggregates", "variants", "models")
    if isinstance(aggregate, dict):
        aggregate = [dict(v, variant=k) if isinstance(v, dict) else {"variant": k} for k, v in aggregate.items()]
    if isinstance(aggregate, list):
        for i, record in enumerate(aggregate):
            if not isinstance(record, dict):
                continue
            name = _variant_name(record, f"variant{i}")
            metrics = {k: _metric_entry(v) for k, v in _collect_metrics(record).items()}
            seeds = record.get("seeds") or []
            variants[name] = VariantResult(name, metrics, list(seeds) if isinstance(seeds, list) else [],
                                           _is_baseline(name, record))
    runs = _first(data, "runs", "results", "records")
    if isinstance(runs, dict):  # {"cta": [run, run], "baseline": [...]} or {"cta": {metrics}}
        flat = []
        for k, v in runs.items():
            for r in v if isinstance(v, list) else [v]:
                if isinstance(r, dict):
                    flat.append(dict(r, variant=_first(r, "variant", "model", "name", default=k)))
        runs = flat
    if isinstance(runs, list):
        grouped: dict = {}
        for i, record in enumerate(runs):
            if not isinstance(record, dict):
                continue
            name = _variant_name(record, "cta")
            grouped.setdefault(name, []).append(record)
        for name, records in grouped.items():
            if name in variants:  # an explicit summary wins
                continue
            per_metric: dict = {}
            for r in records:
                for k, v in _collect_metrics(r).items():
                    per_metric.setdefault(k, []).append(v["mean"] if isinstance(v, dict) else v)
            metrics = {k: _mean_std(v) for k, v in per_metric.items()}
            seeds = [r.get("seed") for r in records if r.get("seed") is not None]
            variants[name] = VariantResult(name, metrics, seeds, _is_baseline(name, records[0]))
    if not variants:
        flat = _collect_metrics(data)
        if flat:
            variants["cta"] = VariantResult("cta", {k: _metric_entry(v) for k, v in flat.items()})
    summary.variants = [v for v in variants.values() if v.metrics]
    return summary


def _fmt_number(x: Optional[float]) -> str:
    if x is None:
        return "—"
    ax = abs(x)
    if ax != 0 and (ax < 1e-3 or ax >= 1e5):
        return f"{x:.3e}"
    return f"{x:.4f}" if ax < 10 else f"{x:.2f}"


def _fmt_metric(entry: dict) -> str:
    mean = float(entry["mean"])
    ax = abs(mean)
    if ax != 0 and (ax < 1e-3 or ax >= 1e5):
        text, digits = f"{mean:.3e}", None
    else:
        digits = 4 if ax < 10 else 2
        text = f"{mean:.{digits}f}"
    if entry.get("std") is not None:
        std = float(entry["std"])
        text += f" ± {std:.{digits}f}" if digits is not None else f" ± {std:.2e}"
    return text


# ---------------------------------------------------------------------------------------------------------------------
# Reading a checkpoint
# ---------------------------------------------------------------------------------------------------------------------


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise HubExportError(f"{model_dir} has no config.json: not a saved transformers checkpoint.")
    return json.loads(path.read_text(encoding="utf-8"))


def _auto_class_for(architecture: str) -> tuple:
    for suffix, auto, task in _AUTO_BY_SUFFIX:
        if architecture.endswith(suffix):
            return auto, task
    return "AutoModel", "feature-extraction"


def _is_patched(config: dict) -> bool:
    return "cta_patch" in config and config.get("model_type") != "cta"


def _load_model(model_dir: Path, config: dict):
    """The checkpoint as an in-process model (the reference for verification, and what gets re-saved)."""
    import cta  # noqa: F401  (registers the Auto classes)

    architecture = (config.get("architectures") or ["CTAModel"])[0]
    if _is_patched(config):
        try:
            from cta import patching_cta
        except ImportError as err:
            raise HubExportError(
                f"{model_dir} is a patched {config.get('model_type')!r} checkpoint (`cta_patch` in config.json) but "
                f"this `cta` has no patching support: {err}"
            ) from err
        loader = getattr(patching_cta, "from_pretrained_patched", None) or getattr(patching_cta, "load_patched", None)
        if loader is not None:
            return loader(str(model_dir))
        import transformers

        auto, _ = _auto_class_for(architecture)
        return getattr(transformers, auto).from_pretrained(str(model_dir), trust_remote_code=True)
    if config.get("model_type") != "cta":
        raise HubExportError(
            f"{model_dir} holds a {config.get('model_type')!r} model without PDE refinement: export a native CTA model "
            "or a model patched with `cta.patch_model` and saved with `save_pretrained`."
        )
    import cta as cta_pkg

    cls = getattr(cta_pkg, architecture, None)
    if cls is None:
        raise HubExportError(
            f"Unknown CTA architecture {architecture!r} in {model_dir}/config.json; expected one of "
            "CTAModel, CTAForCausalLM, CTAForSequenceClassification."
        )
    return cls.from_pretrained(str(model_dir), dtype="auto")


def _pde_modules(model):
    from .pde_cta import PDERefinement

    return [(name, m) for name, m in model.named_modules() if isinstance(m, PDERefinement)]


def _coefficient_text(t) -> str:
    if t is None:
        return "—"
    t = t.detach().float().cpu()
    if t.numel() == 1:
        return _fmt_number(float(t))
    if float(t.max() - t.min()) <= 1e-7:
        return f"{_fmt_number(float(t.flatten()[0]))} (all {t.numel()} channels)"
    return f"mean {_fmt_number(float(t.mean()))} (min {_fmt_number(float(t.min()))}, max {_fmt_number(float(t.max()))})"


def pde_summary(config: dict, model=None, max_sites: int = 24) -> dict:
    """The PDE configuration of a native or patched checkpoint, for the card (config + learned coefficients)."""
    from .pde_cta import coefficient_bounds, normalize_pde_type

    patch = config.get("cta_patch") if _is_patched(config) else None
    src = patch if isinstance(patch, dict) else config

    def get(*keys, default=None):
        for k in keys:
            if k in src and src[k] is not None:
                return src[k]
        return default

    pde_type = normalize_pde_type(get("pde_type", "type", default="diffusion"))
    placement = get("pde_placement", "placement", "placements", default="block_output")
    placements = [placement] if isinstance(placement, str) else list(placement)
    causal = bool(get("is_causal", "causal", default=config.get("is_causal", False)))
    if patch is not None and "causal" not in src and "is_causal" not in src:
        causal = _auto_class_for((config.get("architectures") or [""])[0])[1] == "text-generation"
    alpha_bounds, beta_bounds = coefficient_bounds(pde_type, causal)
    layers = get("pde_layers", "layers")
    info = {
        "type": pde_type,
        "steps": get("pde_steps", "steps", default=1),
        "placements": placements,
        "layers": "all" if layers is None else ", ".join(str(i) for i in layers),
        "causal": causal,
        "stencil": (
            "causal: reads only the left neighbour (dissipative, zero-inflow at the start and after padding)"
            if causal
            else "bidirectional 3-point Laplacian, zero-flux walls at sequence ends and padding"
        ),
        "per_channel": bool(get("pde_per_channel", "per_channel", default=False)),
        "alpha_init": get("pde_alpha", "alpha", default=0.1),
        "beta_init": get("pde_beta", "beta") if beta_bounds is not None else None,
        "alpha_bounds": f"[{alpha_bounds[0]}, {alpha_bounds[1]}]",
        "beta_bounds": f"[{beta_bounds[0]}, {beta_bounds[1]}]" if beta_bounds is not None else None,
        "backend": get("pde_backend", "backend", default="auto"),
        "sites": [],
        "num_sites": 0,
        "sites_truncated": False,
    }
    if info["beta_init"] is None and beta_bounds is not None:
        from .pde_cta import PAPER_COEFFICIENTS

        info["beta_init"] = PAPER_COEFFICIENTS[pde_type][1]
    if model is not None:
        sites = _pde_modules(model)
        info["num_sites"] = len(sites)
        info["sites_truncated"] = len(sites) > max_sites
        for name, module in sites[:max_sites]:
            alpha, beta = module.coefficients()
            info["sites"].append({"name": name, "alpha": _coefficient_text(alpha), "beta": _coefficient_text(beta)})
    return info


def _num_parameters(model) -> str:
    n = sum(p.numel() for p in model.parameters())
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit} ({n:,})"
    return f"{n:,}"


# ---------------------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------------------


def templates_dir() -> Path:
    """``hub_cards/`` (``$CTA_HUB_CARDS`` overrides; next to the package in a source checkout)."""
    candidates = [os.environ.get("CTA_HUB_CARDS"), Path(__file__).resolve().parent.parent / "hub_cards",
                  Path(__file__).resolve().parent / "hub_cards"]
    for c in candidates:
        if c and (Path(c) / "cta_classifier.md").is_file():
            return Path(c)
    raise HubExportError(
        "Model-card templates not found: expected hub_cards/ next to the cta package or $CTA_HUB_CARDS pointing to it."
    )


_INCLUDE = re.compile(r"""\{%-?\s*include\s+["']([^"']+)["']\s*-?%\}""")


def _template_source(name: str, folder: Path, depth: int = 0) -> str:
    if depth > 5:
        raise HubExportError(f"Template includes nested too deep at {name}.")
    text = (folder / name).read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda m: _template_source(m.group(1), folder, depth + 1).rstrip("\n"), text)


def _template_name(config: dict) -> str:
    if _is_patched(config):
        return "patched_model.md"
    architecture = (config.get("architectures") or ["CTAModel"])[0]
    if architecture.endswith("ForSequenceClassification"):
        return "cta_classifier.md"
    if architecture.endswith("ForCausalLM"):
        return "cta_causal_lm.md"
    return "cta_base_model.md"


def _looks_like_hub_id(name: Optional[str]) -> bool:
    return bool(name) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(name)) is not None and not os.path.isabs(str(name)) \
        and not str(name).startswith((".", "~"))


def _eval_results(summary: Optional[ResultsSummary], variant: Optional[VariantResult], task: str):
    from huggingface_hub import EvalResult

    if summary is None or variant is None or not summary.dataset_id:
        return []
    results = []
    task_type = summary.task_type or task
    for metric, entry in variant.metrics.items():
        n = entry.get("n", 1)
        notes = [entry["unit"]] if entry.get("unit") else []
        if n > 1:
            notes.append(f"mean of {n} seeds")
        label = f"{metric} ({', '.join(notes)})" if notes else metric
        results.append(
            EvalResult(
                task_type=task_type,
                task_name=summary.task_name or _TASK_NAMES.get(task_type, task_type),
                dataset_type=summary.dataset_id,
                dataset_name=summary.dataset_name or summary.dataset_id,
                dataset_config=summary.dataset_config,
                dataset_split=summary.dataset_split,
                dataset_revision=summary.dataset_revision,
                metric_type=metric,
                metric_name=label,
                metric_value=round(float(entry["mean"]), 6),
            )
        )
    return results


def build_card_data(config: dict, *, repo_id: str, results: Optional[ResultsSummary] = None,
                    variant: Optional[VariantResult] = None, license: Optional[str] = None,
                    datasets: Optional[list] = None, base_model: Optional[str] = None,
                    language: Optional[list] = None, extra_tags: Iterable[str] = ()):
    """The YAML metadata of the card as a ``huggingface_hub.ModelCardData``."""
    from huggingface_hub import ModelCardData

    architecture = (config.get("architectures") or ["CTAModel"])[0]
    _, task = _auto_class_for(architecture)
    patched = _is_patched(config)
    pde_type = (config.get("cta_patch") or {}).get("pde_type") if patched else config.get("pde_type")
    tags = list(HUB_TAGS)
    if pde_type:
        tags.append(f"pde-{str(pde_type).replace('_', '-')}")
    if patched:
        tags += ["cta-patched", re.sub(r"^cta_patched_", "", str(config.get("model_type")))]
    tags += [t for t in extra_tags if t]
    ds = list(datasets or [])
    if results is not None and results.dataset_id and results.dataset_id not in ds:
        ds.append(results.dataset_id)
    metrics = sorted(variant.metrics) if variant is not None else None
    eval_results = _eval_results(results, variant, task)
    return ModelCardData(
        library_name="transformers",
        pipeline_tag=task,
        tags=tags,
        license=license or (DEFAULT_LICENSE if not patched else "other"),
        language=language or None,
        datasets=ds or None,
        metrics=metrics or None,
        base_model=base_model if patched else None,
        model_name=repo_id.split("/")[-1] if eval_results else None,
        eval_results=eval_results or None,
    )


def render_model_card(model_or_dir, *, repo_id: Optional[str] = None, results=None, results_variant=None,
                      results_row: Optional[str] = None,
                      license: Optional[str] = None, datasets: Optional[list] = None, base_model: Optional[str] = None,
                      language: Optional[list] = None, tokenizer_dir: Optional[PathLike] = None,
                      templates: Optional[PathLike] = None, config: Optional[dict] = None, model=None,
                      title: Optional[str] = None):
    """Renders the README model card (a ``huggingface_hub.ModelCard``) of a saved checkpoint.

    Args:
        model_or_dir: a checkpoint folder (or a loaded model; then its config is used).
        repo_id: the Hub repository the card's usage snippet points to (default: the folder's name).
        results: a results JSON path / dict / :class:`ResultsSummary` (see :func:`load_results`) for the
            ``model-index`` and the baseline-vs-CTA table.
        results_variant: which variant of the results JSON this checkpoint is (default: the single non-baseline).
        license, datasets, base_model, language: metadata overrides. ``base_model`` (patched models) must be a Hub id;
            by default it comes from the patch record or ``_name_or_path`` when that looks like one.
        tokenizer_dir: folder whose tokenizer is exported (changes the usage snippet).
        templates: another template folder (same file names as ``hub_cards/``).
    """
    from huggingface_hub import ModelCard

    if hasattr(model_or_dir, "config") and not isinstance(model_or_dir, (str, os.PathLike)):
        model = model_or_dir
        config = config or model.config.to_dict()
        model_dir = None
    else:
        model_dir = Path(model_or_dir)
        config = config or _read_config(model_dir)
    repo_id = repo_id or (model_dir.name if model_dir is not None else "your-username/cta-model")
    if isinstance(results, (str, os.PathLike, dict)):
        results = load_results(results, row=results_row, config=config)
    variant = results.variant(results_variant) if results is not None else None

    architecture = (config.get("architectures") or ["CTAModel"])[0]
    auto_class, task = _auto_class_for(architecture)
    patched = _is_patched(config)
    patch = config.get("cta_patch") if patched else None
    if patched and base_model is None:
        candidates = [(patch or {}).get(k) for k in ("base_model", "base_model_name_or_path", "name_or_path")]
        candidates.append(config.get("_name_or_path"))
        base_model = next((c for c in candidates if _looks_like_hub_id(c)), None)
    if base_model is not None and not _looks_like_hub_id(base_model):
        raise HubExportError(f"`base_model` must be a Hub model id like 'org/name', got {base_model!r}.")

    card_data = build_card_data(config, repo_id=repo_id, results=results, variant=variant, license=license,
                                datasets=datasets, base_model=base_model, language=language)
    pde = pde_summary(config, model)

    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    has_tokenizer = tokenizer_dir is not None and any((tokenizer_dir / f).is_file() for f in TOKENIZER_FILES)
    tokenizer_name = None
    if has_tokenizer:
        tok_cfg = tokenizer_dir / "tokenizer_config.json"
        if tok_cfg.is_file():
            tokenizer_name = json.loads(tok_cfg.read_text(encoding="utf-8")).get("tokenizer_class")

    rows = []
    if results is not None:
        for v in results.variants:
            rows.append({"name": v.name, "is_this": v is variant,
                         "cells": {m: _fmt_metric(e) for m, e in v.metrics.items()},
                         "seeds": max([e.get("n", 1) for e in v.metrics.values()] or [len(v.seeds) or 1])})
    training = {}
    if results is not None:
        for k, v in results.training.items():
            if isinstance(v, (str, int, float, bool)) or v is None:
                training[k] = v
            else:
                training[k] = json.dumps(v)[:200]
    arch = {k: config.get(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                        "intermediate_size", "position_embedding_type", "max_position_embeddings",
                                        "norm_position", "norm_type", "mlp_type", "hidden_act", "pooling",
                                        "vocab_size", "sliding_window")}
    id2label = config.get("id2label") or {}
    labels = [id2label[k] for k in sorted(id2label, key=lambda x: int(x))] if id2label else []
    num_params = _num_parameters(model) if model is not None else "see `model.safetensors`"
    short_params = num_params.split(" (")[0]
    if model is None:
        scale_note = ("A small model trained from scratch for one task: a research baseline for studying PDE "
                      "refinement, not a general-purpose model.")
    elif patched:
        scale_note = ("Only the PDE parameters (and any adapter merged into the weights) differ from the base model; "
                      "capabilities and failure modes are those of the base model.")
    else:
        scale_note = (f"This is a small model ({short_params} parameters) trained from scratch for one task; it is a "
                      "research baseline for studying PDE refinement, not a general-purpose model.")
    extra = ""
    if pde["causal"] and "attention_matrix" in pde["placements"]:
        extra += "- The `attention_matrix` placement materialises the full attention matrix: slow for long inputs.\n"
    if task == "text-generation":
        extra += "- Generated text can be wrong, repetitive or inappropriate; do not rely on it for facts.\n"
    patch_fields = []
    if isinstance(patch, dict):
        for k, v in patch.items():
            if k in ("pde_type", "type", "pde_steps", "steps", "pde_placement", "placement", "placements",
                     "pde_alpha", "alpha", "pde_beta", "beta", "pde_per_channel", "per_channel", "pde_backend",
                     "backend", "pde_layers", "layers", "causal"):
                continue
            patch_fields.append((k, v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v)))

    template_folder = Path(templates) if templates is not None else templates_dir()
    template_str = _template_source(_template_name(config), template_folder)
    card = ModelCard.from_template(
        card_data,
        template_str=template_str,
        title=title or repo_id.split("/")[-1],
        repo_id=repo_id,
        auto_class=auto_class,
        task=task,
        architecture=architecture,
        has_tokenizer=has_tokenizer,
        # transformers 5's AutoTokenizer always reads config.json first; with an auto_map it needs the flag too
        tokenizer_trust_remote_code=True,
        tokenizer_name=tokenizer_name,
        example_text="The film was a quiet, patient delight." if task == "text-classification" else "Once upon a time",
        example_ids="1, 2, 3, 4",
        pde=pde,
        patched=patched,
        patch=patch or {},
        patch_fields=patch_fields,
        base_model=base_model if patched else None,
        base_model_note="a local checkpoint (pass `--base-model org/name` to link it)",
        base_architecture=re.sub(r"^CTAPatched", "", architecture),
        base_model_type=re.sub(r"^cta_patched_", "", str(config.get("model_type"))),
        arch=arch,
        num_labels=len(labels) or config.get("num_labels", 2),
        labels=labels,
        num_parameters=num_params,
        training=training,
        datasets=list(card_data.datasets or []),
        source_command=results.command if results is not None else None,
        results_rows=rows,
        results_warning=results.warning if results is not None else None,
        results_metrics=results.metric_names if results is not None else [],
        results_headers=results.metric_headers if results is not None else [],
        results_split=results.dataset_split if results is not None else None,
        results_caption=(
            f"{results.task_name or _TASK_NAMES.get(results.task_type or task, task)} on "
            f"`{results.dataset_name or results.dataset_id}` (from `{Path(results.source).name}`)."
            if results is not None else ""
        ),
        scale_note=scale_note,
        extra_limitations=extra,
    )
    return card


# ---------------------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------------------


def _copy_tokenizer(src: Path, out_dir: Path) -> list:
    """Copies the tokenizer files (never the source folder's config.json). When ``tokenizer_config.json`` does not
    name its class, AutoTokenizer would fall back to the exported config.json (model_type ``cta`` / patched): it
    would then need ``trust_remote_code`` for the tokenizer too. The class is written into it instead."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)
            copied.append(name)
    if copied:
        cfg_path = out_dir / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        if not tok_cfg.get("tokenizer_class"):
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(src))
            except Exception as err:  # noqa: BLE001
                raise HubExportError(f"The tokenizer in {src} does not load: {err}") from err
            tok_cfg["tokenizer_class"] = type(tok).__name__
            cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            if "tokenizer_config.json" not in copied:
                copied.append("tokenizer_config.json")
    return copied


def _save_patched(model, config: dict, model_dir: Path, out_dir: Path):
    try:
        model.save_pretrained(str(out_dir), safe_serialization=True)
    except TypeError:
        model.save_pretrained(str(out_dir))


def export_for_hub(model_dir: PathLike, out_dir: PathLike, *, results=None, results_variant: Optional[str] = None,
                   results_row: Optional[str] = None,
                   tokenizer: Optional[PathLike] = None, license: Optional[str] = None,
                   datasets: Optional[list] = None, base_model: Optional[str] = None,
                   language: Optional[list] = None, repo_id: Optional[str] = None,
                   templates: Optional[PathLike] = None, overwrite: bool = False, verify: bool = True,
                   verify_load: bool = True, atol: float = 1e-4) -> Path:
    """Writes a self-contained Hub folder for the checkpoint in ``model_dir`` and verifies it.

    The model is loaded with this package (strict: missing/unexpected weights are an error) and saved again, so
    the folder always has the current flat code files, the full ``auto_map`` and safetensors weights (pickle
    checkpoints are converted). Tokenizer files come from ``tokenizer`` (default: ``model_dir`` when it has them).
    Returns ``out_dir``. See :func:`verify_hub_folder` for the checks.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not model_dir.is_dir():
        raise HubExportError(f"MODEL_DIR {model_dir} is not a folder.")
    if out_dir.resolve() == model_dir.resolve():
        raise HubExportError("OUT_DIR must differ from MODEL_DIR.")
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise HubExportError(f"OUT_DIR {out_dir} exists and is not empty (use --overwrite to replace it).")
        shutil.rmtree(out_dir)
    config = _read_config(model_dir)
    model = _load_model(model_dir, config).eval()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".cta-hub-", dir=str(out_dir.parent)))
    try:
        if _is_patched(config):
            _save_patched(model, config, model_dir, tmp)
        else:
            model.save_pretrained(str(tmp))
        for stray in tmp.iterdir():
            if stray.suffix in PICKLE_SUFFIXES:
                stray.unlink()
        tok_src = Path(tokenizer) if tokenizer is not None else model_dir
        if tokenizer is not None and not tok_src.is_dir():
            raise HubExportError(f"`--tokenizer` {tok_src} is not a folder.")
        copied = _copy_tokenizer(tok_src, tmp)
        if tokenizer is not None and not copied:
            raise HubExportError(f"`--tokenizer` {tok_src} holds none of the tokenizer files {TOKENIZER_FILES}.")
        saved_config = _read_config(tmp)
        card = render_model_card(tmp, repo_id=repo_id or out_dir.name, results=results, results_variant=results_variant,
                                 results_row=results_row,
                                 license=license, datasets=datasets, base_model=base_model, language=language,
                                 tokenizer_dir=tmp if copied else None, templates=templates, config=saved_config,
                                 model=model)
        card.save(tmp / "README.md")
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if verify:
        verify_hub_folder(out_dir, reference_model=model if verify_load else None, atol=atol)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------------------------

_SIBLING_IMPORT = re.compile(r"^\s*from\s+\.([A-Za-z_][\w]*)\s+import\s", re.M)


def check_card(readme: PathLike) -> dict:
    """Parses README.md's metadata (``ModelCard.load``) and checks it; returns ``card.data.to_dict()``."""
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results

    card = ModelCard.load(str(readme))
    data = card.data.to_dict()
    problems = []
    if data.get("library_name") != "transformers":
        problems.append("`library_name` must be 'transformers'")
    for tag in ("custom_code", "continuous-time-attention"):
        if tag not in (data.get("tags") or []):
            problems.append(f"tag {tag!r} missing")
    if not data.get("pipeline_tag"):
        problems.append("`pipeline_tag` missing")
    if not data.get("license"):
        problems.append("`license` missing")
    if "model-index" in data:
        try:
            name, results = model_index_to_eval_results(data["model-index"])
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"model-index malformed: {err}")
        else:
            for r in results:
                if not isinstance(r.metric_value, (int, float)) or not math.isfinite(r.metric_value):
                    problems.append(f"model-index value of {r.metric_type} is not a finite number")
    if "trust_remote_code=True" not in card.text:
        problems.append("usage snippet with trust_remote_code=True missing")
    if problems:
        raise HubExportError(f"{readme}: invalid model card: " + "; ".join(problems))
    return data


_VERIFY_SCRIPT = r"""
import importlib.abc, json, sys

class _BlockCTA(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cta" or name.startswith("cta."):
            raise ModuleNotFoundError("No module named %r (blocked: the export must load without the cta package)" % name)
        return None

sys.meta_path.insert(0, _BlockCTA())
spec = json.load(open(sys.argv[1]))
import torch, transformers
try:
    import cta  # noqa
    raise SystemExit("cta is importable in the verification process")
except ModuleNotFoundError:
    pass
auto = getattr(transformers, spec["auto_class"])
model = auto.from_pretrained(spec["folder"], trust_remote_code=True, dtype="auto").eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
ids = torch.tensor(spec["input_ids"])
mask = torch.tensor(spec["attention_mask"])
with torch.no_grad():
    out = model(input_ids=ids, attention_mask=mask)
tensor = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
torch.save(tensor.float(), spec["output"])
if spec["tokenizer"]:
    tok = transformers.AutoTokenizer.from_pretrained(spec["folder"], trust_remote_code=True)
    print("TOKENIZER", type(tok).__name__, len(tok))
print("CLASS", type(model).__module__, type(model).__name__)
"""


def _reference_inputs(config: dict, batch: int = 2, length: int = 12):
    import torch

    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 100
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, max(4, int(vocab)), (batch, length), generator=g)
    mask = torch.ones_like(ids)
    causal = config.get("is_causal") or _auto_class_for((config.get("architectures") or [""])[0])[1] == "text-generation"
    if batch > 1:
        if causal:
            mask[1, : length // 3] = 0  # left padding (decoders)
        else:
            mask[1, -(length // 3):] = 0  # right padding (encoders)
    return ids, mask


def verify_hub_folder(folder: PathLike, *, reference_model=None, atol: float = 1e-4, timeout: int = 600) -> dict:
    """Checks an exported folder; raises :class:`HubExportError` naming every problem.

    Static checks: ``config.json`` has an ``auto_map`` whose modules exist as flat files; every ``from .x import``
    in those files resolves to a sibling ``x.py``; weights are safetensors and no pickle file is present; the README
    metadata parses and validates (:func:`check_card`). With ``reference_model``: the folder is loaded with
    ``trust_remote_code=True`` in a subprocess where ``import cta`` is blocked, and its logits on a fixed padded
    batch must match the reference model's within ``atol`` (relative to the logits' scale).
    """
    folder = Path(folder)
    problems = []
    config = _read_config(folder)
    auto_map = config.get("auto_map") or {}
    if not auto_map:
        problems.append("config.json has no `auto_map`")
    architecture = (config.get("architectures") or [None])[0]
    auto_class = _auto_class_for(architecture or "Model")[0]
    if auto_map and auto_class not in auto_map:
        problems.append(f"`auto_map` has no entry for {auto_class} (architecture {architecture})")
    modules = set()
    for ref in auto_map.values():
        for r in ref if isinstance(ref, (list, tuple)) else [ref]:
            if r and "--" in r:
                problems.append(f"`auto_map` entry {r!r} points to another repository: not self-contained")
            elif r:
                modules.add(r.split(".")[0])
    seen = set()
    while modules:
        mod = modules.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = folder / f"{mod}.py"
        if not path.is_file():
            problems.append(f"code file {mod}.py (needed by auto_map or a sibling import) is missing")
            continue
        modules.update(_SIBLING_IMPORT.findall(path.read_text(encoding="utf-8")))
    files = sorted(p.name for p in folder.iterdir())
    if not any(n.endswith(".safetensors") for n in files):
        problems.append("no .safetensors weights")
    pickles = [n for n in files if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        problems.append(f"pickle files present (safetensors only): {pickles}")
    if not (folder / "README.md").is_file():
        problems.append("README.md missing")
    card_data = None
    if not problems:
        try:
            card_data = check_card(folder / "README.md")
        except HubExportError as err:
            problems.append(str(err))
    if problems:
        raise HubExportError(f"{folder} failed verification:\n- " + "\n- ".join(problems))
    report = {"files": files, "code_files": sorted(f"{m}.py" for m in seen), "card": card_data}
    if reference_model is not None:
        report.update(_verify_load(folder, config, auto_class, reference_model, atol, timeout))
    return report


def _verify_load(folder: Path, config: dict, auto_class: str, reference_model, atol: float, timeout: int) -> dict:
    import torch

    ids, mask = _reference_inputs(config)
    with torch.no_grad():
        out = reference_model(input_ids=ids, attention_mask=mask)
    expected = (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float()
    has_tok = any((folder / f).is_file() for f in TOKENIZER_FILES)
    with tempfile.TemporaryDirectory(prefix="cta-hub-verify-") as work:
        spec = {"folder": str(folder.resolve()), "auto_class": auto_class, "input_ids": ids.tolist(),
                "attention_mask": mask.tolist(), "output": str(Path(work) / "out.pt"), "tokenizer": has_tok}
        (Path(work) / "spec.json").write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["HF_HUB_OFFLINE"] = "1"
        proc = subprocess.run([sys.executable, "-I", "-c", _VERIFY_SCRIPT, str(Path(work) / "spec.json")], cwd=work,
                              env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise HubExportError(
                f"{folder} does not load with trust_remote_code=True without the cta package:\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            )
        got = torch.load(spec["output"])
    if got.shape != expected.shape:
        raise HubExportError(f"{folder}: reloaded output shape {tuple(got.shape)} != original {tuple(expected.shape)}")
    per_token = got.dim() >= 2 and tuple(got.shape[:2]) == tuple(mask.shape)
    delta = (got - expected)[mask.bool()] if per_token else (got - expected)
    ref = expected[mask.bool()] if per_token else expected
    diff = delta.abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    if not diff <= atol * scale:
        raise HubExportError(f"{folder}: outputs after reload differ from the original model by {diff:.3e} "
                             f"(allowed {atol * scale:.3e}).")
    return {"max_abs_diff": diff, "load_log": proc.stdout.strip().splitlines()}


# ---------------------------------------------------------------------------------------------------------------------
# Push
# ---------------------------------------------------------------------------------------------------------------------


def push_to_hub_folder(folder: PathLike, repo_id: str, *, private: bool = False, revision: Optional[str] = None,
                       commit_message: Optional[str] = None, token: Optional[str] = None,
                       endpoint: Optional[str] = None, create_pr: bool = False, check: bool = True) -> str:
    """Uploads an exported folder (``create_repo`` + ``upload_folder``); returns the commit URL.

    ``token``: explicit, else ``HF_TOKEN`` / the token saved by ``hf auth login``. ``revision``: a branch, created
    from the default branch if missing. ``endpoint``: default ``HF_ENDPOINT`` / huggingface.co. The folder is
    checked first (:func:`verify_hub_folder`, static checks) unless ``check=False``.
    """
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    folder = Path(folder)
    if not folder.is_dir():
        raise HubPushError(f"OUT_DIR {folder} is not a folder: run `cta-hub export MODEL_DIR {folder}` first.")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+|[\w.-]+", repo_id) or repo_id.count("/") > 1:
        raise HubPushError(f"REPO_ID must look like 'user/name' or 'org/name', got {repo_id!r}.")
    if check:
        try:
            verify_hub_folder(folder)
        except HubExportError as err:
            raise HubPushError(f"Refusing to push a folder that fails verification: {err}") from err
    if constants.HF_HUB_OFFLINE:
        raise HubPushError("HF_HUB_OFFLINE=1 is set: unset it to push (`unset HF_HUB_OFFLINE`).")
    token = token or get_token()
    if not token:
        raise HubPushError(
            "Not logged in to the Hugging Face Hub: run `hf auth login`, set the HF_TOKEN environment variable, or "
            "pass --token."
        )
    api = HfApi(endpoint=endpoint, token=token)
    where = api.endpoint
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload CTA model ({folder.name}) with cta-hub",
            create_pr=create_pr,
        )
    except OfflineModeIsEnabled as err:
        raise HubPushError(f"Offline mode is enabled (HF_HUB_OFFLINE): {err}") from err
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status == 401:
            raise HubPushError(f"The Hub at {where} rejected the token (401): log in again with `hf auth login` "
                               f"or pass a valid --token.\n{err}") from err
        if status == 403:
            raise HubPushError(f"No write access to {repo_id!r} at {where} (403): check the namespace and that the "
                               f"token has write permission.\n{err}") from err
        raise HubPushError(f"The Hub at {where} returned an error while pushing {repo_id!r}: {err}") from err
    except (OSError, ConnectionError) as err:
        raise HubPushError(f"Cannot reach the Hub at {where} (offline? proxy? HF_ENDPOINT?): {err}") from err
    except Exception as err:  # httpx transport errors do not derive from OSError
        if type(err).__module__.split(".")[0].startswith(("httpx", "httpcore", "requests", "urllib3")):
            raise HubPushError(f"Cannot reach the Hub at {where} (offline? proxy? HF_ENDPOINT?): {err}") from err
        raise
    return str(getattr(info, "commit_url", info))


def _datasets_for(dataset) -> Optional[list]:
    if dataset is None:
        return None
    out = []
    for d in [dataset] if isinstance(dataset, str) else list(dataset):
        hub_id = TASK_DATASETS.get(d, (d,))[0]
        if hub_id and hub_id not in out:
            out.append(hub_id)
    return out or None


def write_model_card(output_dir: PathLike, *, results=None, task: Optional[str] = None, dataset=None,
                     repo_id: Optional[str] = None, **card_kwargs) -> Optional[Path]:
    """Example-script hook: writes ``output_dir/README.md`` (the card of the checkpoint just saved there).

    ``results`` is the run's results dict (``run_results.json`` content) or a results JSON path; ``dataset`` an
    example task key (``imdb``, ``sst2``, ``wikitext``...) or Hub dataset id; ``task`` is informational (the
    pipeline tag comes from the architecture). Never raises: a card problem is logged, not fatal to training.
    """
    import logging

    try:
        card = render_model_card(output_dir, repo_id=repo_id, results=results, datasets=_datasets_for(dataset),
                                 tokenizer_dir=output_dir, **card_kwargs)
        path = Path(output_dir) / "README.md"
        card.save(path)
        return path
    except Exception as err:  # noqa: BLE001 - a card must never fail a finished training run
        logging.getLogger(__name__).warning("cta.hub: could not write the model card in %s: %s", output_dir, err)
        return None


def publish_trainer_model(trainer, *, results=None, task: Optional[str] = None, dataset=None,
                          tokenizer: Optional[PathLike] = None, export_dir: Optional[PathLike] = None,
                          **export_kwargs) -> Optional[str]:
    """Trainer hook: export ``trainer.args.output_dir`` with this card and push it when ``--push_to_hub`` is set.

    Call after ``trainer.save_model()`` (and ``tokenizer.save_pretrained(output_dir)``), *instead of*
    ``trainer.push_to_hub()`` (which would replace README.md with Trainer's generic card and upload pickles such as
    ``training_args.bin``). Exports to ``export_dir`` (default ``output_dir/hub_export``) and pushes to
    ``hub_model_id`` (default: the output folder's name) with ``hub_private_repo``, ``hub_revision`` and
    ``hub_token``. Returns the commit URL, or None when not pushing. Only the main process exports and pushes.
    """
    args = trainer.args
    if not getattr(trainer, "is_world_process_zero", lambda: True)():
        return None
    out = Path(export_dir) if export_dir is not None else Path(args.output_dir) / "hub_export"
    repo_id = args.hub_model_id or Path(args.output_dir).resolve().name
    if dataset is not None and "datasets" not in export_kwargs:
        export_kwargs["datasets"] = _datasets_for(dataset)
    export_for_hub(args.output_dir, out, results=results, tokenizer=tokenizer, repo_id=repo_id, overwrite=True,
                   **export_kwargs)
    if not args.push_to_hub:
        return None
    return push_to_hub_folder(out, repo_id, private=bool(args.hub_private_repo), token=args.hub_token,
                              revision=getattr(args, "hub_revision", None))


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cta-hub",
        description="Export CTA checkpoints (native or patched) as self-contained Hugging Face Hub folders with a "
                    "model card, verify them, and push them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  cta-hub export runs/imdb-cta hub/imdb-cta --results results/imdb.json --repo-id me/imdb-cta\n"
               "  cta-hub push hub/imdb-cta me/imdb-cta --private\n"
               "  cta-hub card runs/imdb-cta --results results/imdb.json > README.md",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{export,push,card}")

    def card_options(p):
        p.add_argument("--results", help="results JSON (e.g. results/imdb.json) for model-index and the results table")
        p.add_argument("--results-variant", help="which variant of the results JSON this checkpoint is "
                                                 "(default: the single non-baseline one)")
        p.add_argument("--results-row", help="row of an examples/reproduce.py table JSON (e.g. 'IMDb 2L') when the "
                                             "table has several")
        p.add_argument("--license", help=f"license id (default: {DEFAULT_LICENSE} for native models, 'other' for "
                                         "patched models, whose base model's license applies)")
        p.add_argument("--dataset", action="append", dest="datasets", metavar="DATASET_ID",
                       help="Hub dataset id used for training (repeatable; the results JSON's dataset is added)")
        p.add_argument("--language", action="append", help="language code (repeatable), e.g. en")
        p.add_argument("--base-model", help="Hub id of the base model of a patched checkpoint (default: from the "
                                            "patch record when it is a Hub id)")
        p.add_argument("--repo-id", help="repository id the card's usage snippet uses (default: OUT_DIR's name)")
        p.add_argument("--templates", help="folder with model-card templates (default: hub_cards/)")

    p = sub.add_parser("export", help="write a self-contained Hub folder and verify it",
                       description="Write OUT_DIR: config.json with auto_map, flat code files, safetensors weights, "
                                   "tokenizer files and README.md; then verify that it loads with "
                                   "trust_remote_code=True without the cta package and gives the same outputs.")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="saved checkpoint (save_pretrained / Trainer output_dir)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to create")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: MODEL_DIR when it has tokenizer files)")
    card_options(p)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.add_argument("--no-verify-load", action="store_true",
                   help="skip the load-and-compare check in a cta-free subprocess (static checks still run)")
    p.add_argument("--atol", type=float, default=1e-4, help="tolerance of the output comparison (default 1e-4)")

    p = sub.add_parser("push", help="upload an exported folder to the Hub",
                       description="create_repo + upload_folder. Token: --token, else HF_TOKEN, else the token saved "
                                   "by `hf auth login`. HF_ENDPOINT selects another endpoint.")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder written by `cta-hub export`")
    p.add_argument("repo_id", metavar="REPO_ID", help="user/name or org/name")
    p.add_argument("--private", action="store_true", help="create the repository as private (if it does not exist)")
    p.add_argument("--revision", help="branch to push to (created if missing)")
    p.add_argument("--commit-message", help="commit message")
    p.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")

    p = sub.add_parser("card", help="print the rendered model card of a checkpoint")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--tokenizer", metavar="DIR")
    card_options(p)
    return parser


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            out = export_for_hub(
                args.model_dir, args.out_dir, results=args.results, results_variant=args.results_variant,
                results_row=args.results_row,
                tokenizer=args.tokenizer, license=args.license, datasets=args.datasets, base_model=args.base_model,
                language=args.language, repo_id=args.repo_id, templates=args.templates, overwrite=args.overwrite,
                verify_load=not args.no_verify_load, atol=args.atol,
            )
            print(f"Exported and verified {out}:")
            for p in sorted(Path(out).iterdir()):
                print(f"  {p.name:40s} {p.stat().st_size:>12,d} bytes")
        elif args.command == "push":
            url = push_to_hub_folder(args.out_dir, args.repo_id, private=args.private, revision=args.revision,
                                     commit_message=args.commit_message, token=args.token, create_pr=args.create_pr)
            print(f"Pushed {args.out_dir} to {args.repo_id}: {url}")
        else:
            model_dir = Path(args.model_dir)
            tok = Path(args.tokenizer) if args.tokenizer else model_dir
            card = render_model_card(model_dir, repo_id=args.repo_id, results=args.results,
                                     results_variant=args.results_variant, results_row=args.results_row, license=args.license,
                                     datasets=args.datasets, base_model=args.base_model, language=args.language,
                                     tokenizer_dir=tok, templates=args.templates)
            sys.stdout.write(str(card))
    except (HubExportError, HubPushError) as err:
        print(f"cta-hub {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
