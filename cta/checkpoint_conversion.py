# coding=utf-8
"""Loading CTA checkpoints, those of earlier releases included, and refusing ones whose PDE weights do not fit.

What changed since 0.1.0, and how a checkpoint of that release is read (no file is rewritten; ``save_pretrained``
afterwards writes the current format):

* A scalar PDE coefficient was a 0-d tensor; it is a 1-element tensor now (FSDP and DeepSpeed refuse 0-d parameters).
  :func:`from_pretrained_with_pde_check` reads the safetensors headers first; where it finds 0-d coefficients it loads
  with ``ignore_mismatched_sizes=True``, copies exactly those in their new shape and raises for every other mismatch
  as transformers does (unless the caller ignores them). ``state_dict``s and PEFT adapters go through
  ``load_state_dict``, where ``PDERefinement``'s pre-hook reshapes them.
* Renamed weights load through ``from_pretrained``'s public ``key_mapping`` (:data:`LEGACY_KEY_MAPPING`), passed only
  for a checkpoint that has old names; such a model saves in the current names (:data:`SAVES_CURRENT_NAMES`:
  ``save_original_format=False``, since transformers would otherwise revert the mapping).

Missing, unexpected or misshapen PDE weights raise, naming them: a model whose PDE sites silently kept their initial
coefficients would be another model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch
from safetensors import safe_open
from transformers import logging

from .transformers_compat import HOLD_BACK_LOAD_REPORT, is_scalar_mismatch, mismatch_name, mismatch_parts

logger = logging.get_logger(__name__)

# regex on a checkpoint's weight name -> replacement (re.sub), applied in order; names of earlier releases only.
# 0.1.0 wrapped every patched module (`model.layers.3.wrapped.self_attn.wrapped.q_proj.weight`, the PDE modules
# beside `wrapped`); patched models now keep the base model's names and hold each PDE module inside the module it
# refines, so deleting `.wrapped` maps every 0.1.0 name to the current one. transformers renames the first match of
# each pattern: one pattern per wrapper level (a layer's, then the attention / MLP / output module's inside it).
LEGACY_KEY_MAPPING: dict = {r"\.wrapped(?=\.)": "", r"(?<=\.)wrapped\.": ""}

# A PDE coefficient's weight name ends like this, in every release.
_PDE_COEFFICIENT = re.compile(r"_pde\.(alpha|beta)$")
# Set on a model whose checkpoint was read through LEGACY_KEY_MAPPING (see the module docstring).
SAVES_CURRENT_NAMES = "_cta_saves_current_names"
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
# The keywords of from_pretrained that say where a checkpoint is read from (what config and weights must share).
HUB_ARGUMENTS = ("subfolder", "revision", "token", "cache_dir", "local_files_only", "force_download")


def hub_arguments(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in HUB_ARGUMENTS if kwargs.get(k) is not None}


def check_pde_weights_loaded(loading_info: dict, model_class: str, source) -> None:
    """Raises if a checkpoint's PDE coefficients did not load exactly (``from_pretrained``'s ``loading_info``)."""
    problems = {
        kind: sorted(mismatch_name(k) for k in loading_info.get(kind, ()) if "_pde." in mismatch_name(k))
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    if any(problems.values()):
        raise ValueError(
            f"Loading {model_class} from {source!r}: the checkpoint's PDE weights do not match the config "
            f"(PDE placements / layers / steps / per-channel coefficients): missing weights {problems['missing_keys']}, "
            f"unexpected weights {problems['unexpected_keys']}, mismatched {problems['mismatched_keys']}."
        )


def from_pretrained_with_pde_check(load, cls, args, kwargs):
    """``load(*args, **kwargs)`` (the parent class's ``from_pretrained``) reading 0.1.0 checkpoints too, then
    :func:`check_pde_weights_loaded`. Returns what ``from_pretrained`` returns for the caller's
    ``output_loading_info``."""
    output_loading_info = kwargs.pop("output_loading_info", False)
    key_mapping = dict(kwargs.pop("key_mapping", None) or {})
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    keys = _checkpoint_keys(source, kwargs) if source is not None else {}
    legacy_names = any(re.search(pattern, key) for key in keys for pattern in LEGACY_KEY_MAPPING)
    if legacy_names:
        key_mapping = {**LEGACY_KEY_MAPPING, **key_mapping}
    legacy = _legacy_scalars(keys, key_mapping)
    if not legacy:
        model, info = load(*args, output_loading_info=True, key_mapping=key_mapping or None, **kwargs)
    else:
        caller_ignores_mismatch = kwargs.pop("ignore_mismatched_sizes", False)
        # transformers reports the 0-d coefficients as re-initialised size mismatches, which they are not: its report
        # of this load (only) is held back, the rest of it is logged below.
        token = HOLD_BACK_LOAD_REPORT.set(True)
        try:
            model, info = load(*args, output_loading_info=True, ignore_mismatched_sizes=True,
                               key_mapping=key_mapping or None, **kwargs)
        finally:
            HOLD_BACK_LOAD_REPORT.reset(token)
        converted = [k for k in info.get("mismatched_keys", ()) if mismatch_name(k) in legacy and is_scalar_mismatch(k)]
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for key in converted:
                parameters[mismatch_name(key)].copy_(legacy[mismatch_name(key)].reshape(1))
        info["mismatched_keys"] = [k for k in info["mismatched_keys"] if k not in converted]
        logger.warning(f"{cls.__name__}: {source!r} was saved by cta 0.1.0; its {len(converted)} 0-d PDE coefficients "
                       "were read as 1-element tensors (save_pretrained writes the current format).")
        others = {kind: sorted(mismatch_name(k) for k in info.get(kind, ())) for kind in ("missing_keys", "unexpected_keys")}
        if any(others.values()):
            logger.warning(f"{cls.__name__} from {source!r}: missing weights {others['missing_keys']}, unexpected "
                           f"weights {others['unexpected_keys']}.")
        if info["mismatched_keys"] and not caller_ignores_mismatch:
            details = "\n\t".join(f"size mismatch for {name}: copying a param with shape {tuple(ckpt)} from "
                                   f"checkpoint, the shape in current model is {tuple(ours)}."
                                   for name, ckpt, ours in map(mismatch_parts, info["mismatched_keys"]))
            raise RuntimeError(f"Error(s) in loading state_dict for {cls.__name__}:\n\t{details}\n\tYou may consider "
                               "adding `ignore_mismatched_sizes=True` to `from_pretrained(...)` if appropriate.")
    check_pde_weights_loaded(info, cls.__name__, source)
    if legacy_names:
        setattr(model, SAVES_CURRENT_NAMES, True)
    return (model, info) if output_loading_info else model


def _checkpoint_keys(source, kwargs) -> dict:
    """``{weight name: (safetensors file, shape)}`` of a safetensors checkpoint, read from its headers; empty for
    anything else (transformers reports those)."""
    try:
        files = _checkpoint_files(source, kwargs)
    except (OSError, ValueError):
        return {}
    keys = {}
    for path in files:
        with safe_open(path, framework="pt") as checkpoint:
            for key in checkpoint.keys():
                keys[key] = (path, tuple(checkpoint.get_slice(key).get_shape()))
    return keys


def _legacy_scalars(keys: dict, key_mapping: dict) -> dict:
    """``{model's weight name: 0-d tensor}`` of the PDE coefficients that the checkpoint saved as 0-d tensors
    (0.1.0); empty for current checkpoints."""
    found = {}
    for key, (path, shape) in keys.items():
        if _PDE_COEFFICIENT.search(key) and not shape:
            with safe_open(path, framework="pt") as checkpoint:
                found[_renamed(key, key_mapping)] = checkpoint.get_tensor(key)
    return found


def _renamed(key: str, key_mapping: dict) -> str:
    for pattern, replacement in key_mapping.items():
        key = re.sub(pattern, replacement, key, count=1)  # the first match, as transformers renames
    return key


def _checkpoint_files(source, kwargs):
    """The safetensors files of a checkpoint folder or Hub repository (one file or an index's shards)."""
    hub = hub_arguments(kwargs)
    single = _resolve(source, _SAFE_WEIGHTS, hub)
    if single is not None:
        return [single]
    index = _resolve(source, _SAFE_WEIGHTS_INDEX, hub)
    if index is None:
        return []
    with open(index, encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [_resolve(source, shard, hub) for shard in shards]


def _resolve(source, filename, hub):
    source = str(source)
    if os.path.isdir(source):
        path = os.path.join(source, hub.get("subfolder") or "", filename)
        return path if os.path.isfile(path) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(source, filename, **hub)
    except EntryNotFoundError:
        return None


@contextlib.contextmanager
def saved_as_own_class(model, own_module: str):
    """For the duration of a save, ``model`` is an instance of the first class of its MRO defined in ``own_module``.

    FSDP2's ``fully_shard`` swaps a module's class for a subclass it builds (``FSDPCTAForCausalLM``, defined in
    torch); transformers' ``save_pretrained`` names the instance's class in ``auto_map`` and copies the file that
    defines it, so a checkpoint saved from a sharded model would point ``trust_remote_code`` at torch's files."""
    cls = type(model)
    own = next((c for c in cls.__mro__ if c.__module__ == own_module), cls)
    if own is cls:
        yield model
        return
    model.__class__ = own
    try:
        yield model
    finally:
        model.__class__ = cls
