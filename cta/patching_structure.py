# coding=utf-8
"""Where the PDE sites of a patched transformers model go, found by structure, and what is refused (with why):
:func:`plan_patch` raises, before ``patch_model`` changes anything, a ``ValueError`` naming the placement, the
architecture and what it supports.

* **Layer stack**: the base model's one ``nn.ModuleList`` of ``GradientCheckpointingLayer`` s (or ``_no_split_modules``
  classes); ``block_output`` refines each item's output, ``embedding`` the first item's input.
* **Decoder or encoder**: the config's ``is_decoder`` / ``is_causal``, else its heads (masked-LM: encoder; causal-LM
  only: decoder); attention modules' ``is_causal`` must agree.
* **value**: the value projection (:data:`VALUE_NAMES`) or the value columns of a fused QKV (:data:`FUSED_VALUE`).
  **attention_output** / **mlp_output**: the attention / MLP / MoE module's output before the residual add (its last
  ``Linear`` where it adds the residual itself; OPT-style ``fc2``; BERT-style post-LN: the dropout before Add & Norm).
* **Refused up front**: recurrent / convolution cache state, composite and encoder-decoder configs, :data:`REFUSED`,
  :data:`REFUSED_BEFORE` and, per placement, :data:`PLACEMENT_EXCEPTIONS`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import transformers
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .transformers_compat import get_layer_types_and_kwargs, has_head, transformers_before

# Placements refined in a submodule of each layer (found by :func:`layer_targets`).
MODULE_PLACEMENTS = ("value", "attention_output", "mlp_output")
ALL_PLACEMENTS = ("embedding", "value", "attention_output", "mlp_output", "block_output")

VALUE_NAMES = ("v_proj", "value", "value_proj", "v_lin", "v")
FUSED_QKV_NAMES = ("c_attn", "qkv_proj", "Wqkv", "query_key_value", "qkv", "W_pack", "qkv_linear")
MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "mlp_block")
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
# The cache layer types whose layers hold only keys and values: a PDE state can be added beside them.
ATTENTION_CACHE_TYPES = ("full_attention", "sliding_attention")


def _head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# model_type -> (fused QKV attribute, width of its trailing value columns; None: not a contiguous block here).
FUSED_VALUE = {
    "gpt2": ("c_attn", lambda c: c.hidden_size),
    "mpt": ("Wqkv", lambda c: c.hidden_size),
    "modernbert": ("Wqkv", lambda c: c.hidden_size),
    "phi3": ("qkv_proj", lambda c: c.num_key_value_heads * _head_dim(c)),
    "gpt_bigcode": ("c_attn", lambda c: _head_dim(c) if c.multi_query else None),
    "falcon": ("query_key_value", lambda c: _head_dim(c) if c.multi_query and not c.new_decoder_architecture else None),
    # per head [q, k, v]: the value columns are interleaved with the others
    **dict.fromkeys(("gpt_neox", "persimmon", "bloom"), ("query_key_value", lambda c: None)),
    "codegen": ("qkv_proj", lambda c: None),
}

# model_type -> {placement: why the structure's module is not the one to refine}.
PLACEMENT_EXCEPTIONS = {
    "opt": {"mlp_output": "OPT flattens batch and sequence before its feed-forward (fc2's output is "
                          "[batch * seq, hidden], no sequence axis)"}}

# model_type -> why patch_model refuses it (what the structure alone would not tell).
REFUSED = {
    **{t: f"keeps its own recurrent ({kind}) state in its cache" for t, kind in [
        *[(name, "selective state-space") for name in ("mamba", "mamba2", "falcon_mamba")],
        ("rwkv", "RWKV time-mixing"), ("recurrent_gemma", "RG-LRU"), ("xlstm", "xLSTM")]},
    **dict.fromkeys(("lfm2", "lfm2_moe"), "keeps its own short-convolution state in its cache"),
    "hrm_text": "has two layer stacks (its hierarchical H and L modules), run several times per token",
    "bert-generation": "its layers are BERT encoder layers (bidirectional attention) whatever the config says",
    "longformer": "pads the input to a multiple of its attention window inside the model, so the padding walls "
                  "would not line up with the given attention mask",
    "funnel": "pools the sequence between its blocks (later layers see fewer positions than the input has)",
    "reformer": "uses reversible layers with chunked LSH / local attention and no standard layer stack",
    "xlnet": "uses two-stream relative attention with memories instead of a standard layer stack",
    "blt": "has several layer stacks (byte-level local encoder, global transformer, local decoder)",
    **{t: "its layers are not a transformers layer stack (an nn.ModuleList of GradientCheckpointingLayer)" for t in (
        "albert", "cpmant", "ctrl", "flaubert", "ibert", "mpnet", "openai-gpt", "perceiver", "xlm")}}

# model_type -> (first transformers release whose model code works, why patch_model refuses earlier ones): refusals
# caused by the installed release, not the architecture.
REFUSED_BEFORE = {
    "doge": ("5.18.0", "its attention in this transformers release attends to future tokens under SDPA, the default "
                       "(Doge's dynamic mask replaces the causal mask that transformers leaves out for unpadded input; "
                       "huggingface/transformers#48748, fixed in 5.18), so the causal PDE stencil and cached decoding "
                       "cannot match the model; upgrade transformers to 5.18 or later")}


@dataclasses.dataclass
class ValueTarget:
    owner: nn.Module  # the module whose attribute is the projection (the PDE module becomes its submodule)
    attr: str
    value_slice: Optional[tuple]  # (low, high) columns of a fused projection; None: the whole output
    channels: int


@dataclasses.dataclass
class LayerTargets:
    """The modules of one layer that each placement refines, or why a placement is not available there."""
    value: Optional[ValueTarget] = None
    attention_output: Optional[nn.Module] = None
    mlp_output: Optional[nn.Module] = None
    reasons: dict = dataclasses.field(default_factory=dict)  # placement -> why not


@dataclasses.dataclass
class PatchPlan:
    base: nn.Module  # the module whose forward receives the model's inputs and calls the layers (holds the context)
    layers: nn.ModuleList
    layers_name: str
    causal: bool
    targets: list  # LayerTargets per layer (None where the layer gets no per-layer site)


def architecture_name(model_or_config) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    return f"{type(model_or_config).__name__} (model_type {base_model_type(config)!r})"


def base_model_type(config) -> str:
    """The model type of the config's class (a patched config's class reports its base model's type)."""
    model_type = getattr(type(config), "_cta_base_model_type", None) or getattr(type(config), "model_type", None)
    return model_type or getattr(config, "model_type", "") or ""


def _out_features(module) -> Optional[int]:
    values = (getattr(module, attr, None) for attr in ("out_features", "nf"))  # nn.Linear (+ PEFT, quantized), Conv1D
    return next((value for value in values if isinstance(value, int)), None)


def release_refusal(model_type) -> Optional[str]:
    """Why patch_model refuses ``model_type`` on the installed transformers release only (:data:`REFUSED_BEFORE`)."""
    since, reason = REFUSED_BEFORE.get(model_type, (None, None))
    if since is not None and transformers_before(since):
        return f"{reason} (installed: transformers {transformers.__version__})"
    return None


def _type_refusal(model_type) -> Optional[str]:
    reason = REFUSED.get(model_type) or release_refusal(model_type)
    if reason is None and not any(has_head(model_type, h) for h in ("AutoModelForCausalLM", "AutoModelForMaskedLM")):
        reason = ("not a text decoder or encoder (transformers lists no causal-LM or masked-LM head for it: vision, "
                  "audio, multimodal, sequence-to-sequence or task-specific)")
    return reason


def model_type_refusal(model_type) -> Optional[str]:
    """Why patch_model refuses every model of ``model_type`` (judged on its default config), or ``None``."""
    reason = _type_refusal(model_type)
    if reason is not None:
        return reason
    try:
        config = transformers.CONFIG_MAPPING[model_type]()
    except Exception as error:  # (a config that needs arguments)
        return f"its config cannot be built without arguments ({type(error).__name__}), so it was not checked"
    return config_refusal(config)


def config_refusal(config) -> Optional[str]:
    """Why no model of ``config`` can be patched (``None``: the structure decides)."""
    reason = _type_refusal(base_model_type(config))
    if reason is not None:
        return reason
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder (sequence-to-sequence) model: patch_model refines one layer stack"
    composite = [name for name in getattr(type(config), "sub_configs", None) or {}
                 if name in ("encoder", "decoder") or any(k in name for k in ("text", "vision", "audio", "speech"))]
    if composite:
        return (f"a composite config (sub-configs {', '.join(sorted(composite))}): patch the text model of its own "
                "model type, not the multimodal wrapper")
    try:
        layer_types, _ = get_layer_types_and_kwargs(config)
    except Exception:  # a config without the fields transformers reads: the structure decides
        return None
    others = sorted(set(layer_types) - set(ATTENTION_CACHE_TYPES))
    if [t for t in others if t != "dummy"]:
        return (f"its cache layers of type {others} keep their own recurrent / convolution / compressed state, "
                "which the PDE state cannot share (only full and sliding-window attention layers can hold it)")
    # Layers with no cache layer of their own: transformers gives them a 'dummy' one, or (older releases, e.g. 5.14)
    # leaves them out of the cache, which then has fewer layers than the model (Gemma 3n's KV-shared layers).
    num_layers = getattr(config, "num_hidden_layers", None)
    if others or (isinstance(num_layers, int) and len(layer_types) < num_layers):
        return ("some of its layers have no cache layer of their own (they reuse another layer's keys and values, "
                "e.g. num_kv_shared_layers, or have no attention), so the PDE state of those layers has no cache "
                "layer to live in")
    return None


def config_is_decoder(config) -> bool:
    """Decoder (causal stencil) or encoder (bidirectional), from the config and the model's heads."""
    if getattr(config, "is_decoder", False):
        return True
    is_causal = getattr(config, "is_causal", None)
    if isinstance(is_causal, bool):
        return is_causal
    model_type = base_model_type(config)
    return not has_head(model_type, "AutoModelForMaskedLM") and has_head(model_type, "AutoModelForCausalLM")


def find_layer_stack(model):
    """``(base model, its layer ModuleList, the list's name)``; raises ``ValueError`` where there is not exactly one."""
    base = getattr(model, "base_model", model)
    split = set(getattr(model, "_no_split_modules", None) or ()) | set(getattr(base, "_no_split_modules", None) or ())
    found = [(name, module) for name, module in base.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) > 0
             and all(isinstance(item, GradientCheckpointingLayer) or type(item).__name__ in split for item in module)]
    # a stack nested inside the layers of another one (e.g. sub-blocks) is part of that one
    found = [(n, m) for n, m in found if not any(n.startswith(other + ".") for other, _ in found if other != n)]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(n for n, _ in found)})"
        raise ValueError(f"patch_model cannot patch {architecture_name(model)}: it needs one layer stack (an "
                         "nn.ModuleList of GradientCheckpointingLayer / `_no_split_modules` layers) in its base model "
                         f"and found {what}.")
    name, layers = found[0]
    return _input_owner(base, name), layers, name


def parameters_of(function) -> dict:
    """``inspect.signature(function).parameters``, empty where it has no signature."""
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}


def _input_owner(base, layers_name):
    """Where walls and cache are read: the innermost module above the layers taking the inputs (e.g. OPT's decoder)."""
    owner, module = base, base
    for part in layers_name.split(".")[:-1]:
        module = getattr(module, part)
        parameters = parameters_of(module.forward)
        if "attention_mask" in parameters and ("input_ids" in parameters or "inputs_embeds" in parameters):
            owner = module
    return owner


def _children_named(module, names):
    return [(n, getattr(module, n)) for n in names if isinstance(getattr(module, n, None), nn.Module)]


def _post_ln_dropout(module):
    """BERT-style ``output`` block (dense, dropout, LayerNorm of the sum with the residual): its dropout."""
    output = getattr(module, "output", None)
    if isinstance(output, nn.Module) and isinstance(getattr(output, "dropout", None), nn.Dropout) and any(
            isinstance(m, nn.LayerNorm) for m in output.children()):
        return output.dropout
    return None


def _output_module(module):
    """What an attention / MLP module's ``*_output`` site refines: itself, or its output projection if it adds the
    residual itself (BERT-style: the dropout before Add & Norm)."""
    dropout = _post_ln_dropout(module)
    if dropout is not None:
        return dropout
    if "residual" in parameters_of(module.forward):
        linears = [m for m in module.children() if _out_features(m) is not None]
        return linears[-1] if linears else None
    return module


def _projections(layer, names):
    """``[(path, owner, attribute)]`` of the layer's self-attention (not cross) projections named one of ``names``."""
    return [(path, module, name) for path, module in layer.named_modules()
            if "cross" not in path and "encoder_attn" not in path
            for name, child in _children_named(module, names) if _out_features(child) is not None]


def _value_target(layer, config):
    """``(ValueTarget, or why there is none; the layer's child holding the value projection, or None)``."""
    separate, fused = _projections(layer, VALUE_NAMES), _projections(layer, FUSED_QKV_NAMES)
    if len(separate) > 1:
        return f"several value projections ({', '.join(p + '.' + a for p, _, a in separate)})", None
    if not separate and len(fused) != 1:
        return ("no value projection found (a Linear named " + ", ".join(VALUE_NAMES) +
                " or a known fused QKV projection)"), None
    path, owner, attr = (separate or fused)[0]
    attention = getattr(layer, path.split(".")[0]) if path else None  # (the layer's child holding the projection)
    total = _out_features(getattr(owner, attr))
    if separate:
        return ValueTarget(owner, attr, None, total), attention
    known = FUSED_VALUE.get(base_model_type(config))
    if known is None or known[0] != attr:
        return (f"its value projection is fused into `{attr}` with a layout cta does not know (an architecture with a "
                "contiguous value block is one line in patching_structure.FUSED_VALUE)"), attention
    width = known[1](config)
    if width is not None and 0 < width < total:
        return ValueTarget(owner, attr, (total - width, total), width), attention
    return (f"the value columns of its fused `{attr}` are interleaved with the query and key columns (per head or per "
            "group) for this config"), attention


def _attention_output(layer, attention):
    """What ``attention_output`` refines (or why not): ``attention``'s output, else the one ATTENTION_NAMES child's."""
    if attention is None or attention is layer:
        named = _children_named(layer, ATTENTION_NAMES)
        attention = named[0][1] if len(named) == 1 else None
    if attention is None:
        return "no attention module found (" + ", ".join(ATTENTION_NAMES) + ")"
    module = _output_module(attention)
    if module is None:
        return f"its attention module {type(attention).__name__} adds the residual itself and has no output projection"
    return module


def _mlp_output(layer):
    """What ``mlp_output`` refines in ``layer`` (or why nothing)."""
    layer_dropout = _post_ln_dropout(layer) if hasattr(layer, "intermediate") else None
    mlps = _children_named(layer, MLP_NAMES)
    if layer_dropout is not None:
        return layer_dropout
    if len(mlps) > 1:
        return f"several MLP blocks ({', '.join(n for n, _ in mlps)})"
    if mlps:
        module = _output_module(mlps[0][1])
        return f"its MLP {type(mlps[0][1]).__name__} adds the residual itself" if module is None else module
    if _out_features(getattr(layer, "fc2", None)) is not None:
        return layer.fc2  # OPT-style layers: fc1 / fc2 directly on the layer
    return "no MLP / mixture-of-experts block found (" + ", ".join(MLP_NAMES) + ", fc2)"


def layer_targets(layer, config) -> LayerTargets:
    """What ``value`` / ``attention_output`` / ``mlp_output`` refine in ``layer`` (or why they cannot)."""
    value, attention = _value_target(layer, config)
    found = {"value": value, "attention_output": _attention_output(layer, attention), "mlp_output": _mlp_output(layer)}
    found.update(PLACEMENT_EXCEPTIONS.get(base_model_type(config), {}))  # (a reason replaces the module)
    reasons = {placement: target for placement, target in found.items() if isinstance(target, str)}
    return LayerTargets(**{p: target for p, target in found.items() if p not in reasons}, reasons=reasons)


def plan_patch(model, placements, layer_indices=None) -> PatchPlan:
    """The modules that ``placements`` refine in ``model`` (``layer_indices``: the layers with per-layer sites,
    default all); raises ``ValueError`` before anything is changed where the model or a placement is not supported."""
    config = model.config
    reason = config_refusal(config)
    if reason is not None:
        raise ValueError(f"patch_model does not support {architecture_name(model)}: {reason}.")
    base, layers, name = find_layer_stack(model)
    causal = config_is_decoder(config)
    flags = {flag for layer in layers for module in layer.modules()
             for flag in [module.__dict__.get("is_causal", getattr(type(module), "is_causal", None))]
             if isinstance(flag, bool) and any(_out_features(c) is not None for c in module.children())}
    if flags and flags != {causal}:
        raise ValueError(f"patch_model cannot patch {architecture_name(model)}: its config makes it "
                         f"{'a decoder' if causal else 'an encoder'} but its attention modules say "
                         f"is_causal={sorted(flags)}.")
    if causal and has_head(base_model_type(config), "AutoModelForMaskedLM"):
        raise ValueError(f"patch_model supports {architecture_name(model)} as an encoder only "
                         "(config.is_decoder=False); got is_decoder=True.")
    wanted = [p for p in MODULE_PLACEMENTS if p in placements]
    targets = [None] * len(layers)
    for idx in range(len(layers)) if layer_indices is None else layer_indices:
        found = layer_targets(layers[idx], config)
        for placement in wanted:
            if getattr(found, placement) is None:
                supported = [p for p in ALL_PLACEMENTS if p not in MODULE_PLACEMENTS or getattr(found, p) is not None]
                raise ValueError(
                    f"patch_model cannot place `{placement}` in {architecture_name(model)}: {found.reasons[placement]} "
                    f"(layer {idx}, {type(layers[idx]).__name__}). Placements it supports there: "
                    f"{', '.join(supported) if supported else 'none'}.")
        targets[idx] = found
    return PatchPlan(base, layers, name, causal, targets)


def supported_placements(model) -> list:
    """The placements ``patch_model`` accepts for ``model`` (every layer must offer a per-layer one)."""
    layers = plan_patch(model, ()).layers
    return [placement for placement in ALL_PLACEMENTS if placement not in MODULE_PLACEMENTS or all(
        getattr(layer_targets(layer, model.config), placement) is not None for layer in layers)]


__all__ = ["FUSED_VALUE", "REFUSED", "REFUSED_BEFORE", "PLACEMENT_EXCEPTIONS", "plan_patch", "model_type_refusal",
           "release_refusal", "supported_placements", "config_refusal", "find_layer_stack"]
