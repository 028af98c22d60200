# coding=utf-8
"""Adds CTA PDE refinement to pretrained transformers models (Llama, Mistral, Qwen2, Qwen3, GPT-2, BERT, RoBERTa).

``patch_model(model, ...)`` patches a loaded model *in place* and returns it:

* Modules are found by structure (the decoder-layer ``ModuleList``, the attention module holding ``v_proj`` /
  ``c_attn`` / ``value``, the MLP). The model keeps its module tree and weight names
  (``model.layers.3.self_attn.q_proj.weight``): each PDE module is a submodule ``cta_<placement>_pde`` of the module it
  refines (the layer holds ``cta_embedding_pde`` / ``cta_block_output_pde``, the attention module ``cta_value_pde`` /
  ``cta_attention_output_pde``, the MLP ``cta_mlp_output_pde``; BERT's dropouts before Add & Norm hold the attention /
  MLP output sites), applied by forward hooks registered on those modules (``patching_hooks``; their handles are kept
  in the base model's ``_cta_context``). No module is put between a parent and its child and no ``forward`` is
  rebound. Checkpoints of 0.1.0 (which wrapped the modules: ``...layers.3.wrapped.self_attn...``) load through
  ``checkpoint_conversion.LEGACY_KEY_MAPPING``.
* The instance's class is swapped to a subclass (``LlamaForCausalLM`` -> ``CTAPatchedLlamaForCausalLM``), and the
  config's class likewise (``model_type = "cta_patched_llama"``), the way ``torch.nn.utils.parametrize`` swaps a
  module's class. ``isinstance(model, LlamaForCausalLM)`` still holds, and ``save_pretrained`` writes a checkpoint
  that only loads *patched*: plain transformers does not know ``cta_patched_llama`` and refuses it without
  ``trust_remote_code=True``; with it, the saved ``auto_map`` and the flat code files (this file and its siblings)
  rebuild the patched model; missing or unexpected weights are an error.
* Placements: ``embedding`` (input of the first block), ``value`` (output of ``v_proj`` / the value third of GPT-2's
  ``c_attn`` / BERT's ``value``, through a forward hook on whatever module is the value projection when the layer is
  called, so a LoRA layer put in its place is refined with its delta), ``attention_output`` (attention output
  before the residual add), ``mlp_output`` (MLP output before the residual add), ``block_output`` (after each block).
  ``attention_matrix`` is not available for patched models (it needs its own attention kernel); use the native models.
* Decoders get the causal stencil, encoders the bidirectional one. Padding walls come from the 2D ``attention_mask``
  given to the model (captured by the base model's forward pre-hook; its last ``L`` columns are the current tokens).
  A 4D custom mask gives no walls. Gradient checkpointing recomputes a layer after the model's forward returned: its
  sites then read the walls of the latest training forward (``patching_hooks.CheckpointWalls``, which raises where two
  forwards with different masks await one backward).
* Cached decoding: the causal PDE state lives in the model's own cache as conv states of transformers' hybrid cache
  layers. The patched config answers ``get_text_config(decoder=True)`` (what ``DynamicCache(config=...)`` and
  ``generate`` read) with a view whose ``layer_types`` are ``hybrid`` / ``hybrid_sliding`` and whose
  ``number_of_conv_states`` counts the PDE sites per layer; the config's own ``layer_types`` are untouched (Qwen2/3
  index their masks with them).
* ``output_hidden_states``: entry ``k`` is what layer ``k`` receives, i.e. the refined output of layer ``k - 1``
  (transformers records it with hooks on the layers; the output placements refine in each module's first forward
  hook and the embedding in the first layer's first forward pre-hook, so every later hook sees the refined states).
* PEFT: ``LoraConfig(target_modules=[...], modules_to_save=pde_modules_to_save(model))`` trains LoRA and the PDE
  coefficients together and saves both in the adapter; :func:`mark_pde_trainable` trains the PDE alone.
"""

from __future__ import annotations

import copy
import inspect

import torch
import transformers
from torch import nn
from transformers.integrations import is_deepspeed_zero3_enabled

from .checkpoint_conversion import SAVES_CURRENT_NAMES, from_pretrained_with_pde_check, saved_as_own_class
from .pde_cache import CACHE_ARGUMENTS, pde_sites
from .pde_cache import pde_state_indices as state_indices_of_layer
from .patching_hooks import LayerSite, OutputSite, PatchContext, ValueSite
from .pde_cta import (
    MAX_PDE_STEPS,
    PAPER_COEFFICIENTS,
    PDE_BACKENDS,
    PDERefinement,
    coefficient_bounds,
    normalize_pde_type,
    uses_beta,
)


PATCH_PLACEMENTS = ("embedding", "value", "attention_output", "mlp_output", "block_output")
PATCH_INITS = ("identity", "paper")
PATCH_FORMAT_VERSION = 1

# model_type -> (class-name prefix, kind). Decoders use the causal stencil, encoders the bidirectional one.
SUPPORTED_ARCHITECTURES = {
    "llama": ("Llama", "llama"),
    "mistral": ("Mistral", "llama"),
    "qwen2": ("Qwen2", "llama"),
    "qwen3": ("Qwen3", "llama"),
    "gpt2": ("GPT2", "gpt2"),
    "bert": ("Bert", "bert"),
    "roberta": ("Roberta", "bert"),
}
_CAUSAL_KINDS = ("llama", "gpt2")
# head-class suffix -> Auto class (only the suffixes that exist for a family are generated).
_HEADS = {
    "Model": "AutoModel",
    "ForCausalLM": "AutoModelForCausalLM",
    "LMHeadModel": "AutoModelForCausalLM",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
    "ForTokenClassification": "AutoModelForTokenClassification",
    "ForQuestionAnswering": "AutoModelForQuestionAnswering",
    "ForMaskedLM": "AutoModelForMaskedLM",
}
_ENCODER_ONLY_HEADS = ("ForMaskedLM",)
_DECODER_ONLY_HEADS = ("ForCausalLM", "LMHeadModel")
PATCHED_MODEL_TYPE_PREFIX = "cta_patched_"


def _supported_message() -> str:
    return ", ".join(f"{prefix} ({model_type!r})" for model_type, (prefix, _) in SUPPORTED_ARCHITECTURES.items())


def _base_model_type(config) -> str:
    model_type = getattr(config, "model_type", None) or ""
    if model_type.startswith(PATCHED_MODEL_TYPE_PREFIX):
        model_type = model_type[len(PATCHED_MODEL_TYPE_PREFIX):]
    return model_type


# ----------------------------------------------------------------------------------------------------------------
# Finding the modules of each architecture (by structure)
# ----------------------------------------------------------------------------------------------------------------


def _find_structure(model, kind):
    """``(base_model, layers ModuleList)`` of a supported model, found by attribute structure."""
    base = model.base_model if hasattr(model, "base_model") else model
    if kind == "llama":
        layers = getattr(base, "layers", None)
    elif kind == "gpt2":
        layers = getattr(base, "h", None)
    else:
        layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"Could not find the layer list of {type(model).__name__} (expected a {kind}-style model).")
    return base, layers


def _layer_sites(layer, kind, config):
    """The modules of one layer that its PDE sites refine: ``{"value": (owner, projection attribute, value slice,
    value channels), "attention_output": module, "mlp_output": module}``; each PDE module becomes a submodule of the
    module that refines it (the owner for ``value``)."""
    if kind == "llama":
        attn = layer.self_attn
        channels = getattr(attn.v_proj, "out_features", None) or attn.v_proj.weight.shape[0]
        return {"value": (attn, "v_proj", None, channels), "attention_output": attn, "mlp_output": layer.mlp}
    if kind == "gpt2":
        hidden = config.hidden_size
        return {"value": (layer.attn, "c_attn", (2 * hidden, 3 * hidden), hidden), "attention_output": layer.attn,
                "mlp_output": layer.mlp}
    self_attention = layer.attention.self
    return {
        "value": (self_attention, "value", None, self_attention.all_head_size),
        "attention_output": layer.attention.output.dropout,  # BERT: the dropout before Add & Norm
        "mlp_output": layer.output.dropout,
    }


def _cache_index(function):
    """Position of the cache among ``function``'s positional parameters, under either of its names."""
    for name in CACHE_ARGUMENTS:
        index = _signature_index(function, name)
        if index is not None:
            return index
    return None


def _signature_index(function, name):
    try:
        params = [p for p in inspect.signature(function).parameters.values()]
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names.index(name) if name in names else None


# ----------------------------------------------------------------------------------------------------------------
# The patch specification (recorded as `config.cta_patch`)
# ----------------------------------------------------------------------------------------------------------------


def _normalize_placements(placement):
    items = [placement] if isinstance(placement, str) else placement
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"`placement` must be one of {PATCH_PLACEMENTS} or a non-empty list of them, got {placement!r}.")
    for item in items:
        if item == "attention_matrix":
            raise ValueError(
                "`placement='attention_matrix'` is not available for patched models (it needs CTA's own attention); "
                f"use one of {PATCH_PLACEMENTS} or a native `cta.CTAForCausalLM`."
            )
        if item not in PATCH_PLACEMENTS:
            raise ValueError(f"`placement` must be one of {PATCH_PLACEMENTS} or a list of them, got {item!r}.")
    return [p for p in PATCH_PLACEMENTS if p in items]


def _check_coefficient(value, name, bounds, pde_type, causal):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name}` must be a float, got {value!r}.")
    if not bounds[0] <= value <= bounds[1]:
        kind = "causal" if causal else "bidirectional"
        raise ValueError(
            f"`{name}` must lie in the stable interval {bounds} of the {kind} {pde_type} scheme, got {value!r}."
        )
    return float(value)


def make_patch_spec(config, pde_type="diffusion", pde_steps=1, placement="block_output", layers=None,
                    init="identity", backend="auto", per_channel=False, alpha=None, beta=None) -> dict:
    """Validates the arguments of :func:`patch_model` against ``config``; returns the dict saved as ``cta_patch``."""
    model_type = _base_model_type(config)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"patch_model does not support model_type {getattr(config, 'model_type', None)!r}. Supported "
            f"architectures: {_supported_message()}."
        )
    kind = SUPPORTED_ARCHITECTURES[model_type][1]
    if kind == "bert" and getattr(config, "is_decoder", False):
        raise ValueError(
            f"patch_model supports {model_type} as an encoder only (config.is_decoder=False); got is_decoder=True."
        )
    causal = kind in _CAUSAL_KINDS
    pde_type = normalize_pde_type(pde_type, "pde_type")
    if isinstance(pde_steps, bool) or not isinstance(pde_steps, int) or not 0 <= pde_steps <= MAX_PDE_STEPS:
        raise ValueError(f"`pde_steps` must be an int in [0, {MAX_PDE_STEPS}], got {pde_steps!r}.")
    placements = _normalize_placements(placement)
    num_layers = config.num_hidden_layers
    if layers is not None:
        if not isinstance(layers, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers
        ):
            raise ValueError(f"`layers` must be a list of layer indices in [0, {num_layers}), got {layers!r}.")
        layers = sorted(set(layers))
    if init not in PATCH_INITS:
        raise ValueError(f"`init` must be one of {PATCH_INITS}, got {init!r}.")
    if backend not in PDE_BACKENDS:
        raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {backend!r}.")
    if not isinstance(per_channel, bool):
        raise ValueError(f"`per_channel` must be a bool, got {per_channel!r}.")
    alpha_bounds, beta_bounds = coefficient_bounds(pde_type, causal)
    paper_alpha, paper_beta = PAPER_COEFFICIENTS[pde_type]
    if alpha is None:
        alpha = 0.0 if init == "identity" else paper_alpha
    alpha = _check_coefficient(alpha, "alpha", alpha_bounds, pde_type, causal)
    if uses_beta(pde_type):
        if beta is None:
            beta = 0.0 if init == "identity" else paper_beta
        beta = _check_coefficient(beta, "beta", beta_bounds, pde_type, causal)
    elif beta is not None:
        raise ValueError(f"`beta` is only used by reaction_diffusion / advection_diffusion, not {pde_type!r}.")
    return {
        "format_version": PATCH_FORMAT_VERSION,
        "pde_type": pde_type,
        "pde_steps": pde_steps,
        "placement": placements,
        "layers": layers,
        "init": init,
        "alpha": alpha,
        "beta": beta,
        "per_channel": per_channel,
        "backend": backend,
        "causal": causal,
    }


def _layer_indices(spec, num_layers):
    return list(range(num_layers)) if spec["layers"] is None else list(spec["layers"])


def pde_state_indices(spec, layer_idx, num_layers) -> dict:
    """Cache conv-state index of every causal PDE site of layer ``layer_idx`` (placement -> index)."""
    layer_has_pde = layer_idx in _layer_indices(spec, num_layers)
    return state_indices_of_layer(spec["placement"], spec["pde_steps"], layer_has_pde, layer_idx)


def _cache_view(config):
    """A shallow copy of ``config`` whose layer types make ``DynamicCache`` build hybrid (KV + conv state) layers."""
    spec = getattr(config, "cta_patch", None)
    if not isinstance(spec, dict) or not spec.get("causal") or spec["pde_steps"] == 0:
        return None
    from transformers.cache_utils import get_layer_types_and_kwargs

    num_layers = config.num_hidden_layers
    counts = [len(pde_state_indices(spec, i, num_layers)) for i in range(num_layers)]
    if not any(counts):
        return None
    base_types, _ = get_layer_types_and_kwargs(config)
    mapping = {"full_attention": "hybrid", "sliding_attention": "hybrid_sliding"}
    unsupported = sorted(set(base_types) - set(mapping))
    if unsupported:
        raise ValueError(f"CTA patch: cache layer types {unsupported} cannot hold the PDE state (supported: {list(mapping)}).")
    view = copy.copy(config)
    view.__dict__["layer_types"] = [mapping[t] for t in base_types]
    view.__dict__["number_of_conv_states"] = max(counts)
    view.__dict__["_cta_cache_view"] = True
    return view


# ----------------------------------------------------------------------------------------------------------------
# Applying / removing the patch
# ----------------------------------------------------------------------------------------------------------------


def _make_pde(spec, channels, layer_idx, state_idx, like: nn.Module):
    module = PDERefinement(
        channels=channels,
        pde_type=spec["pde_type"],
        steps=spec["pde_steps"],
        causal=spec["causal"],
        alpha=spec["alpha"],
        beta=spec["beta"],
        per_channel=spec["per_channel"],
        backend=spec["backend"],
        layer_idx=layer_idx,
        state_idx=state_idx,
    )
    param = next(iter(like.parameters()), None)
    if param is not None and param.device.type != "meta":
        module.to(device=param.device)
    if param is not None and param.is_floating_point() and is_deepspeed_zero3_enabled():
        # Loaded under ZeRO-3, the model's parameters were cast to the engine's dtype: DeepSpeed partitions every
        # parameter of one dtype together and refuses an fp32 coefficient among bf16 weights.
        module.to(dtype=param.dtype)
    return module


def _add_pde(module, placement, pde):
    name = f"cta_{placement}_pde"
    if hasattr(module, name):
        raise ValueError(f"{type(module).__name__} already has a `{name}`: call unpatch_model first.")
    module.add_module(name, pde)


def _apply_patch(model, spec):
    """Adds the PDE modules of ``spec`` to the modules they refine and registers the hooks that apply them (the
    structure part of :func:`patch_model`)."""
    config = model.config
    kind = SUPPORTED_ARCHITECTURES[_base_model_type(config)][1]
    base, layers = _find_structure(model, kind)
    num_layers = len(layers)
    mask_position = _signature_index(base.forward, "attention_mask")
    sites = pde_sites(num_layers, lambda i: pde_state_indices(spec, i, num_layers)) if spec["causal"] else []
    context = PatchContext(mask_position, _cache_index(base.forward), sites, type(model).__name__)
    base._cta_context = context
    context.handles = [base.register_forward_pre_hook(context.enter, with_kwargs=True),
                       base.register_forward_hook(context.exit, with_kwargs=True, always_call=True)]
    if spec["pde_steps"] == 0:
        return model
    hidden = config.hidden_size
    selected = _layer_indices(spec, num_layers)
    placements = spec["placement"]
    for idx in range(num_layers):
        states = pde_state_indices(spec, idx, num_layers)
        if not states:
            continue
        layer = layers[idx]
        targets = _layer_sites(layer, kind, config)
        per_layer = placements if idx in selected else []
        nested, value_sites = [], []
        if "value" in per_layer:
            owner, value_attr, value_slice, channels = targets["value"]
            _add_pde(owner, "value", _make_pde(spec, channels, idx, states["value"], layer))
            value_sites.append(ValueSite(context, layer, owner, value_attr, value_slice))
        for placement in ("attention_output", "mlp_output"):
            if placement in per_layer:
                module = targets[placement]
                _add_pde(module, placement, _make_pde(spec, hidden, idx, states[placement], layer))
                nested.append(OutputSite(context, layer, module, f"cta_{placement}_pde"))
        if "embedding" in states:
            _add_pde(layer, "embedding", _make_pde(spec, hidden, 0, states["embedding"], layer))
        if "block_output" in per_layer:
            _add_pde(layer, "block_output", _make_pde(spec, hidden, idx, states["block_output"], layer))
        cache_position = _cache_index(type(layer).forward)
        layer_site = LayerSite(context, layer, f"layer {idx}", spec["causal"],
                               None if cache_position is None else cache_position - 1,
                               embedding="embedding" in states, block_output="block_output" in per_layer,
                               nested=bool(nested or value_sites), value_sites=value_sites)
        context.site_hooks += [*value_sites, *nested, layer_site]
    return model


def _remove_patch_modules(model):
    """Removes the hooks (through their handles) and the PDE submodules that :func:`_apply_patch` added."""
    for _, module in list(model.named_modules()):
        context = module.__dict__.pop("_cta_context", None)
        if context is not None:
            context.remove_hooks()
    for _, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if name.startswith("cta_") and name.endswith("_pde"):
                delattr(module, name)


def is_patched(model) -> bool:
    return isinstance(getattr(getattr(model, "config", None), "cta_patch", None), dict)


def patch_model(model, pde_type="diffusion", pde_steps=1, placement="block_output", layers=None, init="identity",
                backend="auto", per_channel=False, alpha=None, beta=None):
    """Adds CTA PDE refinement to a loaded transformers model, in place; returns the same model.

    Args:
        model: a ``PreTrainedModel`` of a supported architecture (any head): Llama, Mistral, Qwen2, Qwen3, GPT-2
            (decoders: causal stencil) or BERT, RoBERTa (encoders: bidirectional stencil).
        pde_type: ``diffusion``, ``wave``, ``reaction_diffusion`` or ``advection_diffusion``.
        pde_steps: explicit PDE steps per site (0 records the patch but adds no PDE module).
        placement: one of ``embedding``, ``value``, ``attention_output``, ``mlp_output``, ``block_output`` or a list.
        layers: layer indices that get the per-layer placements (default: all); ``embedding`` is always once.
        init: ``identity`` (coefficients 0: outputs equal the original model's until trained) or ``paper``
            (``pde_cta.PAPER_COEFFICIENTS``).
        backend: ``auto`` (Triton on CUDA when importable), ``torch`` or ``triton``.
        per_channel: one coefficient per channel instead of a scalar per site.
        alpha, beta: explicit initial coefficients (override ``init``); must lie in the stable interval.

    The patch is recorded as ``model.config.cta_patch``; see the module docstring for saving, caches and PEFT.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise ValueError(f"`model` must be a transformers PreTrainedModel, got {type(model).__name__}.")
    if is_patched(model):
        raise ValueError("This model is already patched with CTA; call `unpatch_model(model)` first.")
    spec = make_patch_spec(model.config, pde_type, pde_steps, placement, layers, init, backend, per_channel, alpha,
                           beta)
    model_class = patched_class(type(model))
    config_class = patched_config_class(type(model.config))
    model.config.cta_patch = spec
    _apply_patch(model, spec)
    model.config.__class__ = config_class
    model.__class__ = model_class
    _register_recorded_outputs(model)
    return model


_RECORDING_CLASSES = set()


def _register_recorded_outputs(model):
    """transformers learns which layer outputs ``output_hidden_states`` / ``output_attentions`` record from the model's
    class, which it registers when a model of that class is built (``PreTrainedModel.__init__``; there is no public
    call for it). A model patched in place has a class that was never built: it is built here once per process, on
    the meta device (no memory, no weights), from a copy of the config."""
    cls = type(model)
    if cls in _RECORDING_CLASSES or getattr(model, "_can_record_outputs", None) is None:
        return
    with torch.device("meta"):
        cls(copy.deepcopy(model.config))
    _RECORDING_CLASSES.add(cls)


def unpatch_model(model):
    """Removes a CTA patch (hooks, PDE submodules, class swap, ``config.cta_patch``); returns the plain model, in
    place.

    The PDE modules (and what they learnt) are dropped.
    """
    if not is_patched(model):
        raise ValueError("This model is not patched with CTA.")
    _remove_patch_modules(model)
    config = model.config
    del config.cta_patch
    config.__dict__.pop("auto_map", None)
    original_config = getattr(type(config), "_cta_original_class", None)
    if original_config is not None:
        config.__class__ = original_config
    original = getattr(type(model), "_cta_original_class", None)
    if original is not None:
        model.__class__ = original
    return model


# ----------------------------------------------------------------------------------------------------------------
# PEFT helpers
# ----------------------------------------------------------------------------------------------------------------


def pde_modules(model):
    """``[(name, PDERefinement)]`` of a patched model (also inside a PEFT model)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PDERefinement)]


def pde_parameter_names(model):
    """Names of the PDE coefficients (``alpha``/``beta``) of a patched model (also inside a PEFT model)."""
    return [f"{name}.{p}" for name, module in pde_modules(model) for p, _ in module.named_parameters()]


def pde_modules_to_save(model):
    """The ``modules_to_save`` entries for PEFT that make the PDE modules trainable and saved with the adapter.

    ``LoraConfig(target_modules=[...], modules_to_save=pde_modules_to_save(model))``: the names are the distinct
    ``cta_<placement>_pde`` suffixes, which match only PDE modules.
    """
    return sorted({name.rsplit(".", 1)[-1] for name, _ in pde_modules(model) if "cta_" in name.rsplit(".", 1)[-1]})


def mark_pde_trainable(model, freeze_others=False):
    """Sets ``requires_grad=True`` on every PDE coefficient (and ``False`` on everything else if
    ``freeze_others``); returns the number of trainable PDE parameters. For PDE-only training without PEFT."""
    names = set(pde_parameter_names(model))
    count = 0
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(True)
            count += param.numel()
        elif freeze_others:
            param.requires_grad_(False)
    return count


# ----------------------------------------------------------------------------------------------------------------
# Patched classes (what a saved patched checkpoint loads as)
# ----------------------------------------------------------------------------------------------------------------


class CTAPatchedConfigMixin:
    """Mixed into the config class of a patched model: distinct ``model_type`` and the cache view."""

    def get_text_config(self, decoder=None, encoder=None):
        config = super().get_text_config(decoder=decoder, encoder=encoder)
        if decoder and config is self and not self.__dict__.get("_cta_cache_view", False):
            view = _cache_view(self)
            if view is not None:
                return view
        return config


class CTAPatchedModelMixin:
    """Mixed into the model classes of patched models: builds the plain model, then applies ``config.cta_patch``."""

    def __init__(self, config, *args, **kwargs):
        spec = getattr(config, "cta_patch", None)
        if not isinstance(spec, dict):
            raise ValueError(
                f"{type(self).__name__} needs `config.cta_patch` (the patch recorded by cta.patch_model); got {spec!r}."
            )
        super().__init__(config, *args, **kwargs)
        _apply_patch(self, spec)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Saves weights (safetensors), the config (``model_type = cta_patched_*``, ``cta_patch``, ``auto_map``) and
        the flat code files (``patching_cta.py`` and the siblings it imports) so that the folder reloads patched."""
        self.config.auto_map = auto_map_for(self.config)
        if getattr(self, SAVES_CURRENT_NAMES, False):
            # Read from an earlier release's names: saved in the current ones (checkpoint_conversion).
            kwargs.setdefault("save_original_format", False)
        with saved_as_own_class(self, __name__):  # (a model sharded by FSDP2 has a class of torch's)
            return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loading, reading checkpoints of earlier releases too (``checkpoint_conversion``), plus an
        error where the checkpoint's PDE weights do not match ``config.cta_patch`` (a patched model without its
        coefficients would silently be another model)."""
        return from_pretrained_with_pde_check(super().from_pretrained, cls, args, kwargs)


_CONFIG_CLASSES = {}
_MODEL_CLASSES = {}


def patched_config_class(base_class):
    """The ``CTAPatched<Base>Config`` subclass of a supported config class."""
    if issubclass(base_class, CTAPatchedConfigMixin):
        return base_class
    model_type = getattr(base_class, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"patch_model does not support model_type {model_type!r}. Supported: {_supported_message()}.")
    return _derived_class(_CONFIG_CLASSES, CTAPatchedConfigMixin, base_class,
                          f"{base_class.__name__} of a CTA-patched model (see `patching_cta.py`).",
                          model_type=PATCHED_MODEL_TYPE_PREFIX + model_type, _auto_class="AutoConfig")


def patched_class(base_class):
    """The ``CTAPatched<Base>`` subclass of a supported model class (created on first use)."""
    if issubclass(base_class, CTAPatchedModelMixin):
        return base_class
    config_class = getattr(base_class, "config_class", None)
    model_type = getattr(config_class, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"patch_model does not support {base_class.__name__} (model_type {model_type!r}). Supported "
            f"architectures: {_supported_message()}."
        )
    prefix = SUPPORTED_ARCHITECTURES[model_type][0]
    suffix = base_class.__name__[len(prefix):] if base_class.__name__.startswith(prefix) else None
    return _derived_class(_MODEL_CLASSES, CTAPatchedModelMixin, base_class,
                          f"{base_class.__name__} with CTA PDE refinement (built from `config.cta_patch`).",
                          config_class=patched_config_class(config_class), _auto_class=_HEADS.get(suffix))


def _derived_class(registry, mixin, base_class, doc, **attributes):
    """``CTAPatched<Base>``: ``mixin`` over ``base_class``, made once, kept in ``registry`` and in this module (where
    pickling and transformers' ``auto_map`` find it by name)."""
    if base_class not in registry:
        name = f"CTAPatched{base_class.__name__}"
        registry[base_class] = cls = type(name, (mixin, base_class), {
            "_cta_original_class": base_class, "__module__": __name__, "__doc__": doc, **attributes})
        globals().setdefault(name, cls)
    return registry[base_class]


def _family_heads(model_type):
    prefix, kind = SUPPORTED_ARCHITECTURES[model_type]
    heads = {}
    for suffix, auto in _HEADS.items():
        if kind in _CAUSAL_KINDS and suffix in _ENCODER_ONLY_HEADS:
            continue
        if kind not in _CAUSAL_KINDS and suffix in _DECODER_ONLY_HEADS:
            continue
        base_class = getattr(transformers, prefix + suffix, None)
        if base_class is not None and auto not in heads:
            heads[auto] = base_class
    return heads


def auto_map_for(config) -> dict:
    """The ``auto_map`` of a patched checkpoint: every Auto class of the family -> a class of this file."""
    model_type = _base_model_type(config)
    module = __name__.rsplit(".", 1)[-1]
    auto_map = {"AutoConfig": f"{module}.{patched_config_class(type(config)).__name__}"}
    for auto, base_class in _family_heads(model_type).items():
        auto_map[auto] = f"{module}.{patched_class(base_class).__name__}"
    return auto_map


def _build_classes():
    for model_type, (prefix, _) in SUPPORTED_ARCHITECTURES.items():
        config_class = getattr(transformers, prefix + "Config", None)
        if config_class is None:
            continue
        patched_config_class(config_class)
        for base_class in _family_heads(model_type).values():
            patched_class(base_class)


def register_auto_classes():
    """Registers every patched config/model class with transformers' Auto classes (done by ``import cta``)."""
    for base_config, config_class in _CONFIG_CLASSES.items():
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for base_class, cls in _MODEL_CLASSES.items():
        if cls._auto_class is not None:
            getattr(transformers, cls._auto_class).register(cls.config_class, cls, exist_ok=True)


def load_patched(path, **kwargs):
    """Loads a checkpoint saved from a patched model (a folder or Hub id), as the class it was saved from."""
    config = transformers.AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k in ("revision", "token", "cache_dir", "local_files_only")})
    if not _is_patched_config(config):
        raise ValueError(f"{path!r} is not a CTA-patched checkpoint (its config has no `cta_patch`).")
    architectures = getattr(config, "architectures", None) or []
    classes = {cls.__name__: cls for cls in _MODEL_CLASSES.values()}
    for name in architectures:
        if name in classes:
            return classes[name].from_pretrained(path, config=config, **kwargs)
    raise ValueError(f"{path!r}: cannot find a patched class for architectures {architectures}.")


def _is_patched_config(config):
    return isinstance(getattr(config, "cta_patch", None), dict)


_build_classes()
if __name__ == "cta.patching_cta":
    register_auto_classes()


__all__ = [
    "PATCH_PLACEMENTS",
    "SUPPORTED_ARCHITECTURES",
    "patch_model",
    "unpatch_model",
    "is_patched",
    "load_patched",
    "pde_modules",
    "pde_parameter_names",
    "pde_modules_to_save",
    "mark_pde_trainable",
    "register_auto_classes",
]
