# coding=utf-8
"""Loading CTA checkpoints, those of earlier releases included, and refusing ones whose PDE weights do not fit.

0.1.0 checkpoints load as they are (``save_pretrained`` then writes the current format): their 0-d PDE coefficients
(FSDP and DeepSpeed refuse 0-d parameters) are copied into the 1-element ones (``state_dict``s and PEFT adapters: by
``PDERefinement``'s ``load_state_dict`` pre-hook), their renamed weights load through ``key_mapping``
(:data:`LEGACY_KEY_MAPPING`). Missing, unexpected or misshapen PDE weights raise, naming them: a model whose PDE sites
silently kept their initial coefficients would be another model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import safe_open
from transformers import logging

from .transformers_compat import held_back_load_report, is_scalar_mismatch, mismatch_name, mismatch_parts

logger = logging.get_logger(__name__)

# 0.1.0 wrapped every patched module (`model.layers.3.wrapped.self_attn.wrapped.q_proj.weight`). transformers renames
# the first match of each pattern, hence one pattern per wrapper level (the layer's, then the module's in it).
LEGACY_KEY_MAPPING: dict = {r"\.wrapped(?=\.)": "", r"(?<=\.)wrapped\.": ""}

# A PDE coefficient's weight name ends like this, in every release.
_PDE_COEFFICIENT = re.compile(r"_pde\.(alpha|beta)$")
# Set on a model read via LEGACY_KEY_MAPPING: it saves with save_original_format=False (else transformers reverts it).
SAVES_CURRENT_NAMES = "_cta_saves_current_names"
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
# The keywords of from_pretrained that say where a checkpoint is read from (what config and weights must share).
HUB_ARGUMENTS = ("subfolder", "revision", "token", "cache_dir", "local_files_only", "force_download")


def hub_arguments(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in HUB_ARGUMENTS if kwargs.get(k) is not None}


def check_pde_weights_loaded(loading_info: dict, model_class: str, source) -> None:
    """Raises if a checkpoint's PDE coefficients did not load exactly (``from_pretrained``'s ``loading_info``)."""
    problems = {kind: sorted(mismatch_name(k) for k in loading_info.get(kind, ()) if "_pde." in mismatch_name(k))
                for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        raise ValueError(f"Loading {model_class} from {source!r}: the checkpoint's PDE weights do not match the config "
                         "(PDE placements / layers / steps / per-channel coefficients): missing weights "
                         f"{problems['missing_keys']}, unexpected weights {problems['unexpected_keys']}, mismatched "
                         f"{problems['mismatched_keys']}.")


def from_pretrained_with_pde_check(load, cls, args, kwargs):
    """``load(*args, **kwargs)`` (the parent class's ``from_pretrained``) reading 0.1.0 checkpoints too, then
    :func:`check_pde_weights_loaded`; returns what ``from_pretrained`` returns for ``output_loading_info``."""
    output_loading_info = kwargs.pop("output_loading_info", False)
    key_mapping = dict(kwargs.pop("key_mapping", None) or {})
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    keys, scalars = _checkpoint_keys(source, kwargs) if source is not None else ([], {})
    legacy_names = any(re.search(pattern, key) for key in keys for pattern in LEGACY_KEY_MAPPING)
    key_mapping = {**LEGACY_KEY_MAPPING, **key_mapping} if legacy_names else key_mapping
    legacy = {}
    for key, tensor in scalars.items():
        for pattern, replacement in key_mapping.items():
            key = re.sub(pattern, replacement, key, count=1)  # the first match, as transformers renames
        legacy[key] = tensor
    caller_ignores_mismatch = kwargs.pop("ignore_mismatched_sizes", False)
    # transformers reports the 0-d coefficients as re-initialised size mismatches, which they are not: its report of a
    # legacy load is held back, the rest of it is logged below.
    with held_back_load_report() if legacy else contextlib.nullcontext():
        model, info = load(*args, output_loading_info=True, key_mapping=key_mapping or None,
                           ignore_mismatched_sizes=bool(legacy) or caller_ignores_mismatch, **kwargs)
    if legacy:
        converted = [k for k in info.get("mismatched_keys", ()) if mismatch_name(k) in legacy and is_scalar_mismatch(k)]
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for key in converted:
                parameters[mismatch_name(key)].copy_(legacy[mismatch_name(key)].reshape(1))
        info["mismatched_keys"] = [k for k in info["mismatched_keys"] if k not in converted]
        logger.warning(f"{cls.__name__}: {source!r} was saved by cta 0.1.0; its {len(converted)} 0-d PDE coefficients "
                       "were read as 1-element tensors (save_pretrained writes the current format).")
        others = {kind: sorted(map(mismatch_name, info.get(kind, ()))) for kind in ("missing_keys", "unexpected_keys")}
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


def _checkpoint_keys(source, kwargs) -> tuple:
    """The weight names of a safetensors checkpoint (read from its headers) and ``{name: tensor}`` of the PDE
    coefficients it saved as 0-d tensors (0.1.0); both empty for anything else (transformers reports those)."""
    try:
        files = _checkpoint_files(source, kwargs)
    except (OSError, ValueError):
        return [], {}
    keys, scalars = [], {}
    for path in files:
        with safe_open(path, framework="pt") as checkpoint:
            for key in checkpoint.keys():
                keys.append(key)
                if _PDE_COEFFICIENT.search(key) and not checkpoint.get_slice(key).get_shape():
                    scalars[key] = checkpoint.get_tensor(key)
    return keys, scalars


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
    try:
        return hf_hub_download(source, filename, **hub)
    except EntryNotFoundError:
        return None


@contextlib.contextmanager
def saved_as_own_class(model, own_module: str):
    """For the duration of a save, ``model`` is an instance of the first class of its MRO defined in ``own_module``:
    FSDP2's ``fully_shard`` swaps in a subclass of torch's, which ``save_pretrained`` would name in ``auto_map``."""
    cls = type(model)
    model.__class__ = next((c for c in cls.__mro__ if c.__module__ == own_module), cls)
    try:
        yield model
    finally:
        model.__class__ = cls
