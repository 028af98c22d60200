"""Publishing CTA adapters (``cta.CTALoraConfig``, PEFT type ``CTA_LORA``) on the Hub: ``cta-hub export --adapter``.

:func:`export_adapter_for_hub` writes an adapter's weights, config and card and, given the plain base's local folder,
checks in ``python -I`` subprocesses that the adapter loads onto it after ``import cta`` with the original logits and
that PEFT refuses it without ``cta``. ``cta.hub`` imports this module, not the other way round.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import jinja2
import torch
import transformers
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open

from .pde_spec import coefficient_bounds

CTA_PEFT_TYPE = "CTA_LORA"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_TAGS = ["cta", "pde", "continuous-time-attention"]
DEFAULT_PIP_SPEC = "cta[peft]"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# PEFT task_type -> (transformers Auto class of the base, PEFT Auto class, Hub pipeline tag).
TASKS = {
    "CAUSAL_LM": ("AutoModelForCausalLM", "AutoPeftModelForCausalLM", "text-generation"),
    "SEQ_CLS": ("AutoModelForSequenceClassification", "AutoPeftModelForSequenceClassification", "text-classification"),
    "TOKEN_CLS": ("AutoModelForTokenClassification", "AutoPeftModelForTokenClassification", "token-classification"),
    "QUESTION_ANS": ("AutoModelForQuestionAnswering", "AutoPeftModelForQuestionAnswering", "question-answering"),
    "SEQ_2_SEQ_LM": ("AutoModelForSeq2SeqLM", "AutoPeftModelForSeq2SeqLM", "text2text-generation"),
    "FEATURE_EXTRACTION": ("AutoModel", "AutoPeftModelForFeatureExtraction", "feature-extraction"),
}
_NO_TASK = ("AutoModel", "AutoPeftModel", None)
# A PDE coefficient in the adapter's safetensors: `<prefix>.<module path>.cta_<placement>_pde.<alpha|beta>`.
_PDE_KEY = re.compile(r"^(?P<site>(?:.*\.)?cta_\w+_pde)\.(?P<name>alpha|beta)$")
_PEFT_PREFIX = "base_model.model."


class AdapterExportError(RuntimeError):
    """The folder is not a CTA adapter, cannot be exported, or an exported adapter folder failed verification."""


def is_adapter_folder(folder) -> bool:
    """Whether ``folder`` is a PEFT adapter folder (``adapter_config.json``) rather than a full checkpoint."""
    return (Path(folder) / ADAPTER_CONFIG).is_file() and not (Path(folder) / "config.json").is_file()


def read_adapter(adapter_dir, argument: str = "ADAPTER_DIR") -> dict:
    """Reads a CTA adapter folder into ``{"config", "coefficients": {site: {"alpha", "beta"}}, "lora_tensors",
    "pde_parameters", "lora_parameters", "other_parameters"}`` (sites without PEFT's ``base_model.model.``); raises
    :class:`AdapterExportError` naming ``argument`` and what the folder is instead (plain LoRA, pickles...)."""
    folder = Path(adapter_dir)
    if not folder.is_dir():
        raise AdapterExportError(f"{argument} {folder} is not a folder.")
    if not (folder / ADAPTER_CONFIG).is_file():
        nested = sorted(p.parent.name for p in folder.glob(f"*/{ADAPTER_CONFIG}"))
        raise AdapterExportError(
            f"{argument} {folder} holds a full checkpoint (config.json), not a PEFT adapter: export it with "
            "`cta-hub export` without --adapter." if (folder / "config.json").is_file() else
            f"{argument} {folder} holds adapters in subfolders {nested}: pass one of those folders." if nested else
            f"{argument} {folder} has no {ADAPTER_CONFIG}: not a folder written by `PeftModel.save_pretrained`.")
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise AdapterExportError(f"Cannot read {folder / ADAPTER_CONFIG}: {err}") from None
    peft_type = config.get("peft_type")
    if peft_type != CTA_PEFT_TYPE:
        kind = "a plain LoRA adapter" if peft_type == "LORA" else f"a {peft_type} adapter"
        raise AdapterExportError(
            f"{argument} {folder} is {kind} (peft_type {peft_type!r}), not a CTA adapter ({CTA_PEFT_TYPE!r}): it "
            "records no CTA patch, so loaded onto the plain base model it would lose the PDE. Train the adapter with "
            "`cta.CTALoraConfig` (LoraConfig's arguments) on the patched model.")
    if not isinstance(config.get("cta_patch"), dict):
        raise AdapterExportError(f"{folder / ADAPTER_CONFIG} has peft_type {CTA_PEFT_TYPE!r} but no `cta_patch` dict.")
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        hint = f" (only pickle weights {pickles}: save the adapter with `safe_serialization=True`)" if pickles else "."
        raise AdapterExportError(f"{argument} {folder} has no {ADAPTER_WEIGHTS}{hint}")
    coefficients, counts = {}, dict(lora_tensors=0, pde_parameters=0, lora_parameters=0, other_parameters=0)
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            match = _PDE_KEY.match(key)
            if match:
                tensor = f.get_tensor(key)
                coefficients.setdefault(match["site"].removeprefix(_PEFT_PREFIX), {})[match["name"]] = tensor
                counts["pde_parameters"] += tensor.numel()
                continue
            lora = "lora_" in key
            counts["lora_tensors"] += lora
            counts["lora_parameters" if lora else "other_parameters"] += math.prod(f.get_slice(key).get_shape())
    if not coefficients:
        raise AdapterExportError(f"{weights} holds no PDE coefficients (keys `...cta_<placement>_pde.alpha`): the PDE "
                                 "modules were not among the adapter's modules_to_save.")
    return dict(config=config, coefficients={s: coefficients[s] for s in sorted(coefficients, key=_natural)}, **counts)


def _natural(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def hub_id_or_none(name) -> Optional[str]:
    """``name`` if it is a valid Hub repo id and not a local path (``_name_or_path`` often is one)."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return None if name is None or os.path.exists(name) else name


def base_model_id(config: dict, base_model: Optional[str] = None) -> str:
    """The Hub id of the adapter's base model: ``base_model`` if given, else ``base_model_name_or_path`` when that
    is a Hub id; a local path is refused, naming ``--base-model``."""
    if base_model:
        validate_repo_id(base_model)
        return base_model
    recorded = config.get("base_model_name_or_path")
    if hub_id_or_none(recorded) is None:
        where = f"the local path {recorded!r}" if recorded else "no base model"
        raise AdapterExportError(
            f"adapter_config.json's base_model_name_or_path is {where}, not a Hub id: pass --base-model ORG/NAME (in "
            "Python `base_model=`), the Hub id of the model the adapter was trained on; the card and "
            "AutoPeftModel load the base from it.")
    return recorded


def templates_dir() -> Path:
    """``hub_cards/``: next to the package in a source checkout, else the installed package data ``cta.hub_cards``."""
    checkout = Path(__file__).resolve().parent.parent / "hub_cards"
    if (checkout / "adapter.md").is_file():
        return checkout
    return Path(str(importlib.resources.files(__package__) / "hub_cards"))


def coefficient_text(t) -> Optional[str]:
    """A coefficient tensor for a card: its value (all channels alike) or mean, min and max; None for None."""
    if t is None:
        return None
    t = t.detach().float().flatten()
    if float(t.max() - t.min()) <= 1e-7:
        return f"{t[0].item():.4g}" + (f" (all {t.numel()} channels)" if t.numel() > 1 else "")
    return f"mean {t.mean().item():.4g} (min {t.min().item():.4g}, max {t.max().item():.4g})"


def card_pde_fields(src: dict) -> dict:
    """The card's PDE fields of a ``cta_patch`` or a native config's ``pde_*`` values (keys without ``pde_``)."""
    alpha_bounds, beta_bounds = coefficient_bounds(src["type"], bool(src.get("causal")))
    placement = src.get("placement", "block_output")
    return dict(type=src["type"], steps=src.get("steps", 1), causal=bool(src.get("causal")),
                placements=[placement] if isinstance(placement, str) else list(placement),
                layers="all" if src.get("layers") is None else ", ".join(map(str, src["layers"])),
                per_channel=bool(src.get("per_channel")), backend=src.get("backend", "auto"),
                alpha_init=src.get("alpha"), beta_init=src.get("beta") if beta_bounds else None,
                alpha_bounds=list(alpha_bounds), beta_bounds=list(beta_bounds) if beta_bounds else None)


def adapter_pde_summary(config: dict, coefficients: dict, max_sites: int = 24) -> dict:
    """The patch (``config["cta_patch"]``) and the coefficients per site as saved (``values``) and as the scheme
    uses them (``effective``: projected onto the stable interval), in the keys of ``cta.hub.pde_summary``."""
    patch = config["cta_patch"]
    pde = card_pde_fields({key.removeprefix("pde_"): value for key, value in patch.items()})
    sites = []
    for name, coeffs in coefficients.items():
        site = dict(name=name)
        for key in ("alpha", "beta"):
            raw, bounds = coeffs.get(key), pde[f"{key}_bounds"]
            effective = raw.float().clamp(*bounds) if raw is not None and bounds else raw
            site.update({key: raw.float().flatten().tolist() if raw is not None else None,
                         f"{key}_effective": effective.flatten().tolist() if effective is not None else None,
                         f"{key}_text": coefficient_text(effective)})
        sites.append(site)
    return dict(pde, init=patch.get("init"), num_sites=len(sites), sites=sites, shown_sites=sites[:max_sites])


def _lora_summary(config: dict, info: dict) -> dict:
    targets = config.get("target_modules")
    return dict(
        {key: config.get(key) for key in ("r", "lora_alpha", "cta_version", "peft_version")},
        has_lora=info["lora_tensors"] > 0, dropout=config.get("lora_dropout"), use_dora=bool(config.get("use_dora")),
        use_rslora=bool(config.get("use_rslora")), modules_to_save=sorted(config.get("modules_to_save") or []),
        targets=", ".join(f"`{t}`" for t in (sorted(targets) if isinstance(targets, list) else [targets])),
        lora_parameters=f"{info['lora_parameters']:,}", pde_parameters=f"{info['pde_parameters']:,}",
        other_parameters=f"{info['other_parameters']:,}" if info["other_parameters"] else None)


def load_adapter_results(path_or_dict, adapter_dir=None) -> dict:
    """The ``card_results`` block of a result file (``examples/finetune_patched_llama.py --study`` writes one) for the
    card's evaluation section: ``description``, ``columns``, ``rows``, ``model_index`` and ``adapter_sha256``, the
    hash of the adapter the numbers belong to; with ``adapter_dir``, refuses the block when its weights differ."""
    source = "<results>" if isinstance(path_or_dict, dict) else str(path_or_dict)
    data = path_or_dict
    if not isinstance(data, dict):
        try:
            data = json.loads(Path(source).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise AdapterExportError(f"Cannot read the results JSON {source}: {err}") from None
    block = data.get("card_results", data) if isinstance(data, dict) else None
    missing = [key for key in ("columns", "rows", "adapter_sha256") if not isinstance(block, dict) or key not in block]
    if missing:
        raise AdapterExportError(f"{source} has no adapter results (a `card_results` block with {missing}): with "
                                 "--adapter, --results takes a result file that names the adapter it measured, such "
                                 "as results/pretrained_finetune.json.")
    if adapter_dir is not None:
        digest = hashlib.sha256((Path(adapter_dir) / ADAPTER_WEIGHTS).read_bytes()).hexdigest()
        if digest != block["adapter_sha256"]:
            raise AdapterExportError(f"{source} reports on another adapter (sha256 {block['adapter_sha256'][:12]}... "
                                     f"of its weights), not {adapter_dir} ({digest[:12]}...): its numbers would be "
                                     "wrong on this card.")
    return dict(block, source=block.get("source") or Path(source).name)


def _eval_results(results: dict):
    """``huggingface_hub.EvalResult``s of the ``model_index`` entries of adapter results (None without)."""
    return [EvalResult(**entry) for entry in results.get("model_index") or []] or None


def render_adapter_card(adapter_dir, *, base_model: Optional[str] = None, repo_id: Optional[str] = None,
                        license: Optional[str] = None, datasets=None, language=None, templates=None,
                        title: Optional[str] = None, pip_spec: str = DEFAULT_PIP_SPEC, results=None) -> ModelCard:
    """The README card (``huggingface_hub.ModelCard``) of the CTA adapter in ``adapter_dir``: PEFT metadata
    (``base_model``: see :func:`base_model_id`), the patch, learned coefficients, usage (``pip install pip_spec``);
    with ``results`` (a result file or dict, :func:`load_adapter_results`), an evaluation section and model-index."""
    info = read_adapter(adapter_dir)
    results = load_adapter_results(results, adapter_dir) if results is not None else None
    config = info["config"]
    validate_repo_id(repo_id)  # None passes
    base_model = base_model_id(config, base_model)
    repo_id = repo_id or Path(adapter_dir).resolve().name
    auto_class, peft_auto_class, task = TASKS.get(config.get("task_type"), _NO_TASK)
    pde = adapter_pde_summary(config, info["coefficients"])
    lora = _lora_summary(config, info)
    datasets = [datasets] if isinstance(datasets, str) else list(datasets or [])
    tags = ADAPTER_TAGS + [f"pde-{pde['type'].replace('_', '-')}"] + (["lora"] if lora["has_lora"] else [])
    eval_results = _eval_results(results) if results else None
    card_data = ModelCardData(library_name="peft", base_model=base_model, pipeline_tag=task, license=license or "other",
                              tags=tags + [f"base_model:adapter:{base_model}"], language=language or None,
                              datasets=datasets or None, eval_results=eval_results,
                              model_name=repo_id.split("/")[-1] if eval_results else None)
    return render_card("adapter.md", templates, card_data, task, title=title or repo_id.split("/")[-1],
                       repo_id=repo_id, base_model=base_model, auto_class=auto_class, peft_auto_class=peft_auto_class,
                       task_type=config.get("task_type"), patch=config["cta_patch"], pde=pde, lora=lora,
                       pip_spec=pip_spec, datasets=datasets, results=results)


def render_card(template: str, templates, card_data: ModelCardData, task, **fields) -> ModelCard:
    """The card ``template`` of ``templates`` (default :func:`templates_dir`) rendered with ``fields``."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates or templates_dir())))
    example = "The film was a quiet, patient delight." if task == "text-classification" else "Once upon a time"
    return ModelCard(env.get_template(template).render(card_data=card_data.to_yaml(), task=task, example_text=example,
                                                       **fields))


def check_export_arguments(source: Path, source_name: str, out_dir: Path, overwrite: bool, repo_id, error) -> None:
    """What every export checks first: a valid ``repo_id`` (None passes), an OUT_DIR that is not the source and is
    empty unless ``overwrite``; raises ``error`` naming the argument."""
    validate_repo_id(repo_id)
    if out_dir.resolve() == source.resolve():
        raise error(f"OUT_DIR must differ from {source_name}.")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise error(f"OUT_DIR {out_dir} exists and is not empty (use --overwrite to replace it).")


def export_adapter_for_hub(adapter_dir, out_dir, *, base_model: Optional[str] = None, base_model_dir=None,
                           reference_model=None, repo_id: Optional[str] = None, license: Optional[str] = None,
                           datasets=None, language=None, templates=None, title: Optional[str] = None,
                           pip_spec: str = DEFAULT_PIP_SPEC, overwrite: bool = False, verify: bool = True,
                           verify_load: bool = True, atol: float = 1e-4, timeout: int = 600, results=None) -> dict:
    """Writes the Hub folder of the CTA adapter in ``adapter_dir`` (``results``: see :func:`render_adapter_card`), then
    :func:`verify_adapter_folder` (load checks with ``verify_load`` and ``base_model_dir``); returns its report with
    ``folder``, ``base_model``, ``load_check``."""
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    check_export_arguments(adapter_dir, "ADAPTER_DIR", out_dir, overwrite, repo_id, AdapterExportError)
    info = read_adapter(adapter_dir)
    if results is not None:
        results = load_adapter_results(results, adapter_dir)  # (before writing anything)
    base_model = base_model_id(info["config"], base_model)
    if verify and verify_load and base_model_dir is not None:
        _check_base_dir(base_model_dir)  # before writing anything
    if out_dir.exists():
        shutil.rmtree(out_dir)  # --overwrite
    out_dir.mkdir(parents=True)
    shutil.copyfile(adapter_dir / ADAPTER_WEIGHTS, out_dir / ADAPTER_WEIGHTS)
    # AutoPeftModelFor*.from_pretrained(repo) loads the base from here: a Hub id, not the training machine's path.
    config = dict(info["config"], base_model_name_or_path=base_model)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    render_adapter_card(out_dir, base_model=base_model, repo_id=repo_id or out_dir.resolve().name, license=license,
                        datasets=datasets, language=language, templates=templates, title=title,
                        pip_spec=pip_spec, results=results).save(out_dir / "README.md")
    report = dict(folder=out_dir, base_model=base_model)
    if not verify:
        return dict(report, load_check="skipped (verify=False)")
    report.update(verify_adapter_folder(out_dir, base_model_dir=base_model_dir if verify_load else None,
                                        reference_adapter=adapter_dir, reference_model=reference_model, atol=atol,
                                        timeout=timeout))
    report.setdefault("load_check", "skipped (--no-verify-load)" if not verify_load else "skipped: pass "
                      "--base-model-dir DIR (the plain base model's local folder) to load the adapter onto it with and "
                      "without cta")
    return report


def verify_adapter_folder(folder, *, base_model_dir=None, reference_adapter=None, reference_model=None,
                          atol: float = 1e-4, timeout: int = 600) -> dict:
    """Checks an exported adapter folder (a CTA adapter, safetensors only, a card with ``library_name: peft`` and
    ``base_model``); with ``base_model_dir``, the load checks of the module docstring against ``reference_model``
    (default: ``reference_adapter`` or ``folder`` loaded here). Raises :class:`AdapterExportError`; returns a report."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterExportError(f"{folder} is not a folder.")
    problems, info = [], None
    try:
        info = read_adapter(folder, argument="OUT_DIR")
    except AdapterExportError as err:
        problems.append(str(err))
    files = sorted(p.name for p in folder.iterdir())
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    problems += [f"pickle files present (safetensors only): {pickles}"] if pickles else []
    if "README.md" not in files:
        problems.append("README.md missing")
    else:
        data = ModelCard.load(str(folder / "README.md")).data
        if data.library_name != "peft":
            problems.append(f"README.md's metadata has library_name {data.library_name!r}, not 'peft'")
        if not data.base_model:
            problems.append("README.md's metadata has no base_model (the Hub lists adapters under their base model)")
    if problems:
        raise AdapterExportError(f"{folder} failed verification:\n- " + "\n- ".join(problems))
    report = dict(files=files, sites=list(info["coefficients"]), peft_type=CTA_PEFT_TYPE,
                  lora_tensors=info["lora_tensors"])
    if base_model_dir is not None:
        report.update(_verify_adapter_load(folder, info, Path(base_model_dir), reference_adapter, reference_model,
                                           atol, timeout))
    return report


def _check_base_dir(base_model_dir) -> dict:
    base_model_dir = Path(base_model_dir)
    if not (base_model_dir / "config.json").is_file():
        raise AdapterExportError(f"--base-model-dir {base_model_dir} has no config.json: pass the local folder of the "
                                 "plain base model (save_pretrained) the adapter was trained on.")
    config = json.loads((base_model_dir / "config.json").read_text(encoding="utf-8"))
    if "cta_patch" in config:
        raise AdapterExportError(f"--base-model-dir {base_model_dir} holds a patched checkpoint: pass the plain base "
                                 "model, which the adapter patches (what the Hub's users load).")
    return config


_WITH_CTA_SCRIPT = r"""
import json, re, sys
import cta  # registers the CTA_LORA adapter type with PEFT: what the card tells users to do
import torch, transformers
from peft import PeftModel
from safetensors.torch import load_file
spec = json.load(open(sys.argv[1]))
base = getattr(transformers, spec["auto"]).from_pretrained(spec["base"], dtype="auto")
model = PeftModel.from_pretrained(base, spec["folder"]).eval()
sites = {name.split(".modules_to_save.")[0].removesuffix(".original_module").removeprefix("base_model.model.")
         for name, module in model.named_modules() if isinstance(module, cta.PDERefinement)}
state = model.state_dict()
unequal = [key for key, saved in load_file(spec["weights"]).items() if key in spec["pde_keys"]
           and not torch.equal(state[re.sub(r"\.(\w+)$", r".modules_to_save.default.\1", key)], saved)]
with torch.no_grad():
    out = model(input_ids=torch.tensor(spec["ids"]), attention_mask=torch.tensor(spec["mask"]))
torch.save((out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float(), spec["out"])
json.dump(dict(cta=cta.__file__, cls=type(model.get_base_model()).__name__, sites=sorted(sites), unequal=unequal),
          open(spec["report"], "w"))
"""

# The start of a check script that must run where `cta` cannot be imported (as where it is not installed).
BLOCK_CTA = r"""
import importlib.abc, json, sys
class BlockCTA(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cta" or name.startswith("cta."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: this check runs without cta)")
sys.meta_path.insert(0, BlockCTA())
"""

_WITHOUT_CTA_SCRIPT = BLOCK_CTA + r"""
import transformers
from peft import PeftModel
spec = json.load(open(sys.argv[1]))
base = getattr(transformers, spec["auto"]).from_pretrained(spec["base"], dtype="auto")
try:
    model = PeftModel.from_pretrained(base, spec["folder"])
except Exception as err:
    print("REFUSED " + json.dumps(f"{type(err).__name__}: {err}"))
    sys.exit(0)
print("LOADED " + type(model.get_base_model()).__name__)
sys.exit(3)
"""


def padded_batch(vocab: int, causal: bool):
    """Two rows of 12 tokens, the second padded: left padding for decoders, right padding for encoders."""
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    (mask[1, :4] if causal else mask[1, -4:]).zero_()
    return ids, mask


def model_output(model, ids, mask):
    """The logits (or last hidden states) of ``model`` on the batch, in float32."""
    with torch.no_grad():
        out = model.eval()(input_ids=ids, attention_mask=mask)
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float()


def compare_outputs(got, expected, mask, atol: float):
    """``(max abs difference on the unpadded positions, the problem or None)``; ``atol`` is relative to their scale."""
    if got.shape != expected.shape:
        return float("nan"), f"output shape {tuple(got.shape)} != the reference's {tuple(expected.shape)}"
    per_token = got.dim() >= 2 and tuple(got.shape[:2]) == tuple(mask.shape)
    valid = mask.bool() if per_token else torch.ones((), dtype=torch.bool)
    diff = (got - expected)[valid].abs().max().item()
    if not diff <= atol * max(1.0, expected[valid].abs().max().item()):
        return diff, f"logits differ from the reference's by {diff:.3e} (atol {atol:g})"
    return diff, None


def isolated_python(script: str, spec_path: Path) -> dict:
    """``subprocess`` arguments: ``python -I`` runs ``script`` on ``spec_path`` offline, without ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return dict(args=[sys.executable, "-I", "-c", script, str(spec_path)], cwd=spec_path.parent,
                env=dict(env, HF_HUB_OFFLINE="1"), text=True)


def _verify_adapter_load(folder: Path, info: dict, base_dir: Path, reference_adapter, reference_model,
                         atol: float, timeout: int) -> dict:
    config, task_type = info["config"], info["config"].get("task_type")
    auto = TASKS.get(task_type, _NO_TASK)[0]
    base_config = _check_base_dir(base_dir)
    vocab = base_config.get("vocab_size") or (base_config.get("text_config") or {}).get("vocab_size") or 100
    ids, mask = padded_batch(min(int(vocab), 1000), bool(config["cta_patch"].get("causal")))
    if task_type == "SEQ_CLS" and base_config.get("pad_token_id") is None:
        ids, mask = ids[:1], mask[:1]  # decoders' classification heads refuse a padded batch without a pad token
    with tempfile.TemporaryDirectory(prefix="cta-hub-adapter-verify-") as work:
        spec = dict(folder=str(folder.resolve()), base=str(base_dir.resolve()), auto=auto, ids=ids.tolist(),
                    mask=mask.tolist(), out=str(Path(work) / "out.pt"), report=str(Path(work) / "report.json"),
                    weights=str((folder / ADAPTER_WEIGHTS).resolve()),
                    pde_keys=[f"{_PEFT_PREFIX}{site}.{name}" for site, coeffs in info["coefficients"].items()
                              for name in coeffs])
        (Path(work) / "spec.json").write_text(json.dumps(spec))
        # Both subprocesses run while the reference is computed here (each spends seconds importing torch & co).
        procs = {name: subprocess.Popen(**isolated_python(script, Path(work) / "spec.json"), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
                 for name, script in (("with", _WITH_CTA_SCRIPT), ("without", _WITHOUT_CTA_SCRIPT))}
        try:
            if reference_model is None:
                from peft import PeftModel

                base = getattr(transformers, auto).from_pretrained(str(base_dir), dtype="auto")
                reference_model = PeftModel.from_pretrained(base, str(reference_adapter or folder))
            expected = model_output(reference_model, ids, mask)
            outputs = {name: (*proc.communicate(timeout=timeout), proc.returncode) for name, proc in procs.items()}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        stdout, stderr, code = outputs["with"]
        if code != 0:
            raise AdapterExportError(f"{folder}: the plain base {base_dir} + the adapter does not load after "
                                     f"`import cta` (python -I):\n{stdout[-3000:]}\n{stderr[-6000:]}")
        got, loaded = torch.load(spec["out"]), json.loads(Path(spec["report"]).read_text())
    stdout, stderr, code = outputs["without"]
    refused = next((line[len("REFUSED "):] for line in stdout.splitlines() if line.startswith("REFUSED ")), None)
    if code == 3:
        raise AdapterExportError(f"{folder}: without cta, PEFT loaded the adapter onto the plain base "
                                 f"({stdout.strip().split()[-1]}) instead of refusing it: the PDE would be dropped.")
    if code != 0 or refused is None:
        raise AdapterExportError(f"{folder}: the load check without cta failed before loading the adapter:\n"
                                 f"{stdout[-3000:]}\n{stderr[-6000:]}")
    problems = []
    if sorted(loaded["sites"]) != sorted(info["coefficients"]):
        problems.append(f"the loaded model's PDE sites {loaded['sites']} are not the adapter's "
                        f"{list(info['coefficients'])}")
    if loaded["unequal"]:
        problems.append(f"coefficients not loaded as saved: {loaded['unequal']}")
    diff, problem = compare_outputs(got, expected, mask, atol)
    problems += [problem] if problem else []
    if problems:
        raise AdapterExportError(f"{folder} failed the load check with cta:\n- " + "\n- ".join(problems))
    return dict(max_abs_diff=diff, with_cta=dict(cls=loaded["cls"], cta=loaded["cta"], sites=len(loaded["sites"])),
                without_cta=json.loads(refused))


def report_lines(report: dict) -> list:
    """What ``cta-hub export --adapter`` prints about an export report (:func:`export_adapter_for_hub`)."""
    folder = Path(report["folder"])
    lines = [f"Exported the CTA adapter of {report['base_model']} to {folder}:"]
    lines += [f"  {p.name:40s} {p.stat().st_size:>12,d} bytes" for p in sorted(folder.iterdir())]
    if "sites" in report:
        lines.append(f"Static checks passed: {CTA_PEFT_TYPE} adapter, {len(report['sites'])} PDE sites, "
                     f"{report['lora_tensors']} LoRA tensors, safetensors only, card with library_name peft.")
    if "max_abs_diff" in report:
        loaded = report["with_cta"]
        lines += [f"Load with cta (python -I, plain base + adapter): {loaded['cls']} with {loaded['sites']} PDE sites "
                  f"as saved; logits match the original adapter's (max abs diff {report['max_abs_diff']:.2e}).",
                  f"Load without cta: refused, as it must be ({report['without_cta']})."]
    else:
        lines.append(f"Load checks {report['load_check']}.")
    return lines


__all__ = ["AdapterExportError", "BLOCK_CTA", "PICKLE_SUFFIXES", "adapter_pde_summary", "base_model_id",
           "check_export_arguments", "coefficient_text", "export_adapter_for_hub", "is_adapter_folder",
           "load_adapter_results", "read_adapter",
           "render_adapter_card", "report_lines", "templates_dir", "verify_adapter_folder"]
