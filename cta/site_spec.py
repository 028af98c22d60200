# coding=utf-8
"""One description of a PDE site, read by native models, patched models, the cache layout and the vLLM plugin.

A model's sites come from either description of its refinement: a native :class:`~configuration_cta.CTAConfig`
(``pde_*`` fields) or a patch dict (``config.cta_patch``). :func:`site_specs` lists them as :class:`PDESiteSpec`;
:func:`build_site` makes the module of one; :func:`cache_layout` says which cache layers hold their states.

A causal site keeps one fp32 conv state per step in the cache layer of its block: the sites of a layer in
:data:`STATE_PLACEMENTS` order, then, in layer 0, the ``embedding`` site (site ``k`` of a layer owns
``k * steps .. (k + 1) * steps - 1``). ``attention_matrix`` evolves each attention row alone and keeps no state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import lru_cache
from typing import Optional

from transformers.integrations import is_deepspeed_zero3_enabled

from .pde_cache import CacheSites
from .pde_cta import PDERefinement

# Per-layer placements that keep a causal state, in the order of their conv-state indices.
STATE_PLACEMENTS = ("value", "attention_output", "mlp_output", "block_output")
# Every placement, in the order a layer's specs are listed (the embedding site belongs to layer 0).
_SPEC_ORDER = (*STATE_PLACEMENTS, "embedding", "attention_matrix")
# The cache layer type that holds conv states beside the keys and values of each attention layer type.
HYBRID_LAYER_TYPES = {"full_attention": "hybrid", "sliding_attention": "hybrid_sliding"}


@dataclasses.dataclass(frozen=True)
class PDESiteSpec:
    """One PDE site: its operator (``pde_type``, ``steps``, ``causal``, initial ``alpha`` / ``beta``, ``per_channel``,
    ``backend``), where it sits (``placement`` in block ``layer_idx``; ``embedding``: before block 0, numbered 0) and,
    for a site that keeps a state, ``state_idx``: its first cache conv-state index (one conv state per step), else
    None."""

    pde_type: str
    steps: int
    causal: bool
    placement: str
    alpha: float
    beta: Optional[float]
    per_channel: bool
    backend: str
    layer_idx: int
    state_idx: Optional[int]

    @property
    def name(self) -> str:
        """How errors name the site: ``"<placement> of layer <i>"``."""
        return f"{self.placement} of layer {self.layer_idx}"

    @property
    def keeps_state(self) -> bool:
        """Whether the site keeps its state in a cache (causal, with a conv-state index)."""
        return self.causal and self.state_idx is not None


def _placements(placement) -> tuple:
    return (placement,) if isinstance(placement, str) else tuple(placement)


def _fields(source) -> tuple:
    """``(pde_type, steps, causal, placements, layers, alpha, beta, per_channel, backend)`` of a native config, a
    patched config (its ``cta_patch``) or a patch dict."""
    patch = source if isinstance(source, Mapping) else getattr(source, "cta_patch", None)
    if isinstance(patch, Mapping):
        layers = patch["layers"]
        return (patch["pde_type"], patch["pde_steps"], bool(patch["causal"]), _placements(patch["placement"]),
                None if layers is None else tuple(layers), patch["alpha"], patch["beta"], patch["per_channel"],
                patch["backend"])
    layers = source.pde_layers
    return (source.pde_type, source.pde_steps, bool(source.is_causal), _placements(source.pde_placement),
            None if layers is None else tuple(layers), source.pde_alpha, source.pde_beta, source.pde_per_channel,
            source.pde_backend)


def site_specs(source, num_layers: Optional[int] = None) -> tuple:
    """The :class:`PDESiteSpec` of every PDE site of a model, by layer (a layer's in conv-state order), from a native
    ``CTAConfig``, a patched config or a patch dict (``num_layers``: the model's layers; a config's by default)."""
    if num_layers is None:
        num_layers = source.num_hidden_layers
    return _specs(_fields(source), num_layers)


@lru_cache(maxsize=64)  # (a pure function of the description: models built from one config share its specs)
def _specs(fields: tuple, num_layers: int) -> tuple:
    pde_type, steps, causal, placements, layers, alpha, beta, per_channel, backend = fields
    if steps == 0:
        return ()
    selected = set(range(num_layers) if layers is None else layers)
    specs = []
    for layer_idx in range(num_layers):
        here = [p for p in _SPEC_ORDER if p in placements and (layer_idx in selected if p != "embedding"
                                                                 else layer_idx == 0)]
        stateful = [p for p in here if p != "attention_matrix"]
        for placement in here:
            state_idx = stateful.index(placement) * steps if placement in stateful else None
            specs.append(PDESiteSpec(pde_type, steps, causal, placement, alpha, beta, per_channel, backend, layer_idx,
                                     state_idx))
    return tuple(specs)


def layer_specs(specs, layer_idx: int) -> dict:
    """``placement -> spec`` of the sites of block ``layer_idx`` (the embedding site is layer 0's)."""
    return {spec.placement: spec for spec in specs if spec.layer_idx == layer_idx}


def cache_sites(specs) -> CacheSites:
    """``[(site name, cache layer, conv state)]`` of the sites that keep a state (what ``check_pde_states`` and
    ``generate()`` check)."""
    return CacheSites((spec.name, spec.layer_idx, spec.state_idx) for spec in specs if spec.keeps_state)


@lru_cache(maxsize=64)
def cache_layout(attention_types: tuple, specs: tuple):
    """``(layer_types, number_of_conv_states)`` that make ``DynamicCache(config=...)`` hold the states of ``specs``
    (each attention layer type made hybrid; a tuple: give a config a list of it), or None where no site keeps a
    state."""
    counts = [0] * len(attention_types)
    for spec in specs:
        if spec.keeps_state and spec.layer_idx < len(counts):
            counts[spec.layer_idx] += spec.steps
    if not any(counts):
        return None
    unsupported = sorted(set(attention_types) - set(HYBRID_LAYER_TYPES))
    if unsupported:
        raise ValueError(f"CTA patch: cache layer types {unsupported} cannot hold the PDE state (supported: "
                         f"{list(HYBRID_LAYER_TYPES)}).")
    return tuple(HYBRID_LAYER_TYPES[t] for t in attention_types), max(counts)


def build_site(spec: PDESiteSpec, channels: int, like=None) -> PDERefinement:
    """The ``PDERefinement`` of ``spec`` over ``channels``; ``like``: a module whose first parameter gives the device
    (unless either is on the meta device) and, under DeepSpeed ZeRO-3, the floating dtype."""
    module = PDERefinement(channels=channels, pde_type=spec.pde_type, steps=spec.steps, causal=spec.causal,
                           alpha=spec.alpha, beta=spec.beta, per_channel=spec.per_channel, backend=spec.backend,
                           layer_idx=spec.layer_idx, state_idx=0 if spec.state_idx is None else spec.state_idx)
    param = next(iter(like.parameters()), None) if like is not None else None
    own = next(iter(module.parameters()), None)
    built_on_meta = own is not None and own.device.type == "meta"  # (under a meta-device construction: stays there)
    if param is not None and param.device.type != "meta" and not built_on_meta:
        module.to(device=param.device)
    if param is not None and param.is_floating_point() and is_deepspeed_zero3_enabled():
        # Loaded under ZeRO-3, the model's parameters were cast to the engine's dtype: DeepSpeed partitions every
        # parameter of one dtype together and refuses an fp32 coefficient among bf16 weights.
        module.to(dtype=param.dtype)
    return module


__all__ = ["PDESiteSpec", "STATE_PLACEMENTS", "HYBRID_LAYER_TYPES", "site_specs", "layer_specs", "cache_sites",
           "cache_layout", "build_site"]
