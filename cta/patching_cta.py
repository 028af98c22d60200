# coding=utf-8
"""Adds CTA PDE refinement to pretrained transformers decoders and encoders whose layers follow transformers' own
pattern (checked architectures: ``ARCHITECTURES.md``). ``patch_model(model, ...)`` patches a model *in place*:

* Modules are found by structure (``patching_structure``, which refuses what a model does not offer, up front).
* Module tree and weight names are kept: each PDE module is a submodule ``cta_<placement>_pde`` of the module it
  refines, applied by forward hooks (``patching_hooks``), so a LoRA value projection is refined with its delta.
* Classes are swapped to subclasses (``CTAPatchedLlamaForCausalLM``, ``model_type = "cta_patched_llama"``), so
  ``isinstance`` holds; ``save_pretrained`` writes a checkpoint that loads only *patched* (``cta.load_patched`` or
  ``trust_remote_code=True``; 0.1.0 ones through ``checkpoint_conversion``); mismatched PDE weights are an error.
* Padding walls come from the 2D ``attention_mask`` (its last ``L`` columns are the current tokens; a 4D mask gives
  none). ``attention_matrix`` needs CTA's own attention (native models only).
* Cached decoding: the PDE state lives in the model's own cache (``pde_cache``), via the ``hybrid`` layer types of
  the patched config's ``get_text_config(decoder=True)`` view; the config's own ``layer_types`` are untouched.
* ``output_hidden_states``: entry ``k`` is what layer ``k`` receives, i.e. the refined output of layer ``k - 1``.
* PEFT: ``cta.CTALoraConfig`` (``peft_cta``); :func:`mark_pde_trainable` trains the PDE alone.
"""

from __future__ import annotations

import copy

import transformers

from .configuration_cta import check_choice, check_coefficient, check_layers, normalize_placements
from .patching_classes import (  # noqa: F401  (the patched classes' module: `auto_map` names them here)
    KEPT_CACHE_VIEW, PATCHED_CLASS_PREFIX, PATCHED_MODEL_TYPE_PREFIX, CTAPatchedConfigMixin, CTAPatchedModelMixin,
    auto_map_for, is_patched_config, load_patched, patched_class, patched_class_named, patched_config_class, register_auto_classes)
from .patching_sites import apply_patch, layer_indices, remove_patch_modules
from .patching_structure import (  # noqa: F401  (REFUSED, supported_placements: importable here)
    ALL_PLACEMENTS as PATCH_PLACEMENTS, REFUSED, architecture_name, config_is_decoder, config_refusal, plan_patch,
    supported_placements)
from .pde_cta import PAPER_COEFFICIENTS, PDE_BACKENDS, PDERefinement, check_steps, normalize_pde_type, uses_beta
from .transformers_compat import drop_compiled_calls, peft_adapted, register_recorded_outputs

PATCH_INITS = ("identity", "paper")
_PATCH_BEFORE_PEFT = (
    "patching it now would add PDE coefficients that its adapters do not record (saved, an adapter would load "
    "without them). Patch the plain model first, then `get_peft_model(model, cta.CTALoraConfig(...))`; to keep a "
    "trained adapter, patch the model that `peft_model.merge_and_unload()` returns.")
PATCH_FORMAT_VERSION = 1
__getattr__ = patched_class_named  # `CTAPatched<Base>`, made on first access (auto_map, architectures, pickling)


def make_patch_spec(config, pde_type="diffusion", pde_steps=1, placement="block_output", layers=None,
                    init="identity", backend="auto", per_channel=False, alpha=None, beta=None) -> dict:
    """Validates the arguments of :func:`patch_model` against ``config``; returns the dict saved as ``cta_patch``."""
    reason = config_refusal(config)
    if reason is not None:
        raise ValueError(f"patch_model does not support {architecture_name(config)}: {reason}.")
    causal = config_is_decoder(config)
    pde_type = normalize_pde_type(pde_type, "pde_type")
    check_steps(pde_steps, "pde_steps")
    if "attention_matrix" in (placement if isinstance(placement, (list, tuple)) else [placement]):
        raise ValueError("`placement='attention_matrix'` is not available for patched models (it needs CTA's own "
                         f"attention); use one of {PATCH_PLACEMENTS} or a native `cta.CTAForCausalLM`.")
    placements = normalize_placements(placement, "placement", PATCH_PLACEMENTS)
    layers = check_layers(layers, "layers", config.num_hidden_layers)
    check_choice(init, "init", PATCH_INITS)
    check_choice(backend, "backend", PDE_BACKENDS)
    if not isinstance(per_channel, bool):
        raise ValueError(f"`per_channel` must be a bool, got {per_channel!r}.")
    paper_alpha, paper_beta = PAPER_COEFFICIENTS[pde_type] if init == "paper" else (0.0, 0.0)
    alpha = check_coefficient(paper_alpha if alpha is None else alpha, "alpha", pde_type, 0, causal)
    if uses_beta(pde_type):
        beta = check_coefficient(paper_beta if beta is None else beta, "beta", pde_type, 1, causal)
    elif beta is not None:
        raise ValueError(f"`beta` is only used by reaction_diffusion / advection_diffusion, not {pde_type!r}.")
    return {"format_version": PATCH_FORMAT_VERSION, "pde_type": pde_type, "pde_steps": pde_steps,
            "placement": placements, "layers": layers, "init": init, "alpha": alpha, "beta": beta,
            "per_channel": per_channel, "backend": backend, "causal": causal}


def is_patched(model) -> bool:
    return is_patched_config(getattr(model, "config", None))


def patch_model(model, pde_type="diffusion", pde_steps=1, placement="block_output", layers=None, init="identity",
                backend="auto", per_channel=False, alpha=None, beta=None):
    """Adds CTA PDE refinement to a loaded transformers model, in place (recorded as ``model.config.cta_patch``; see
    the module docstring for saving, caches and PEFT); returns the same model.

    Args:
        model: a ``PreTrainedModel`` whose layers follow transformers' pattern, any head (decoders get the causal
            stencil, encoders the bidirectional one); raises ``ValueError``, leaving it unchanged, where it cannot be.
        pde_type: ``diffusion``, ``wave``, ``reaction_diffusion`` or ``advection_diffusion``.
        pde_steps: explicit PDE steps per site (0 records the patch but adds no PDE module).
        placement: one of ``embedding``, ``value``, ``attention_output``, ``mlp_output``, ``block_output`` or a list.
        layers: layer indices that get the per-layer placements (default: all); ``embedding`` is always once.
        init: ``identity`` (coefficients 0: the original outputs until trained) or ``paper`` (``PAPER_COEFFICIENTS``).
        backend: ``auto`` (Triton on CUDA when importable), ``torch`` or ``triton``.
        per_channel: one coefficient per channel instead of a scalar per site.
        alpha, beta: explicit initial coefficients (override ``init``); must lie in the stable interval.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        if callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
            raise ValueError(f"`model` is a PEFT model ({type(model).__name__}): {_PATCH_BEFORE_PEFT}")
        raise ValueError(f"`model` must be a transformers PreTrainedModel, got {type(model).__name__}.")
    if is_patched(model):
        raise ValueError("This model is already patched with CTA; call `unpatch_model(model)` first.")
    if peft_adapted(model):
        # Its adapter would train the PDE coefficients without recording them: saved, it loads without its PDE.
        raise ValueError(f"PEFT already adapts this {type(model).__name__}: {_PATCH_BEFORE_PEFT}")
    spec = make_patch_spec(model.config, pde_type, pde_steps, placement, layers, init, backend, per_channel, alpha,
                           beta)
    plan = plan_patch(model, spec["placement"], layer_indices(spec, model.config.num_hidden_layers))  # (or raises)
    model_class, config_class = patched_class(type(model)), patched_config_class(type(model.config))
    config = copy.deepcopy(model.config)
    config.cta_patch, config.__class__ = spec, config_class
    # transformers learns what output_hidden_states records from a class when it is built: the patched class is
    # built once, before the model changes (a class that cannot be built fails with the model untouched).
    register_recorded_outputs(model_class, config)
    _own_config(model)
    model.config.cta_patch = spec
    drop_compiled_calls(model)  # a compiled forward made before (or copied from another model) would skip the PDE
    try:
        apply_patch(model, spec, plan)
    except BaseException:
        model.config.__dict__.pop("cta_patch", None)
        raise
    model.config.__class__ = config_class
    model.__class__ = model_class
    return model


def _own_config(model):
    """Gives ``model`` and its modules sharing its config a copy of it, so other models built from it stay plain."""
    shared, own = model.config, copy.deepcopy(model.config)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = own


def unpatch_model(model):
    """Removes a CTA patch (hooks, PDE modules and what they learnt, class swap, ``cta_patch``) in place; returns it."""
    if not is_patched(model):
        raise ValueError("This model is not patched with CTA.")
    if peft_adapted(model):
        raise ValueError(f"PEFT adapts this {type(model).__name__}: its CTA adapters hold the PDE modules. "
                         "`peft_model.unload()` gives back the base model (the plain one, where an adapter patched "
                         "it); `peft_model.merge_and_unload()` a patched model without PEFT, which unpatch_model "
                         "takes.")
    remove_patch_modules(model)
    drop_compiled_calls(model)
    config = model.config
    del config.cta_patch
    config.__dict__.pop("auto_map", None)
    config.__dict__.pop(KEPT_CACHE_VIEW, None)  # (a plain config would save it)
    config.__class__ = getattr(type(config), "_cta_original_class", type(config))
    for module in model.modules():  # the model, and the patched backbone of a generic head
        original = getattr(type(module), "_cta_original_class", None)
        if original is not None and isinstance(module, CTAPatchedModelMixin):
            module.__class__ = original
    return model


def pde_modules(model):
    """``[(name, PDERefinement)]`` of a patched model (also inside a PEFT model)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PDERefinement)]


def pde_parameter_names(model):
    """Names of the PDE coefficients (``alpha``/``beta``) of a patched model (also inside a PEFT model)."""
    return [f"{name}.{p}" for name, module in pde_modules(model) for p, _ in module.named_parameters()]


def pde_modules_to_save(model):
    """PEFT ``modules_to_save`` entries that train and save the PDE modules: their ``cta_<placement>_pde`` names (by
    name: where an adapter is loaded already, PEFT's wrapper holds the module under that name)."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return sorted(name for name in names if name.startswith("cta_") and name.endswith("_pde"))


def mark_pde_trainable(model, freeze_others=False):
    """Sets ``requires_grad=True`` on every PDE coefficient (and ``False`` on everything else if
    ``freeze_others``); returns the number of trainable PDE parameters. For PDE-only training without PEFT."""
    names, count = set(pde_parameter_names(model)), 0
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(True)
            count += param.numel()
        elif freeze_others:
            param.requires_grad_(False)
    return count


__all__ = ["PATCH_PLACEMENTS", "REFUSED", "supported_placements", "patch_model", "unpatch_model", "is_patched",
           "load_patched", "pde_modules", "pde_parameter_names", "pde_modules_to_save", "mark_pde_trainable",
           "register_auto_classes"]
