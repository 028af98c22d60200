# coding=utf-8
"""``generate()`` for models with causal PDE sites (native and patched decoders): every cache and decoding strategy
is exact or refused, naming why, before a token is generated (``docs/generation.md``); several-token steps keep their
2D padding mask (the PDE walls) for a static cache, and a compiled forward copied from another model is dropped."""

from __future__ import annotations

import torch
import transformers

from .pde_cache import CACHE_ARGUMENTS, find_cache
from .transformers_compat import (ASSISTANT_ROLLBACK_SINCE, GENERATING, REFUSED_CACHES, STATIC_CACHE_2D_MASK,  # noqa
                                  STATIC_CACHES, GenerationHooks, compiled_calls, drop_compiled_calls,
                                  holds_conv_states, transformers_before)  # (importable here)


# The attention implementation vLLM's generic Transformers backend (`model_impl="transformers"`, or any custom-code
# checkpoint without a registered vLLM class) sets on the config it builds a model from: it then runs the model on its
# flattened batch, where a PDE site would read several sequences as one row and keep no state.
VLLM_TRANSFORMERS_BACKEND = "vllm"


def refuse_vllm_transformers_backend(config, model_name: str) -> None:
    """Raises when vLLM's Transformers backend builds this model (it would decode every PDE sequence wrong)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if VLLM_TRANSFORMERS_BACKEND in (getattr(config, "_attn_implementation", None),
                                     getattr(text_config, "_attn_implementation", None)):
        raise ValueError(f"{model_name} cannot run on vLLM's generic Transformers backend: it runs the model on a "
                         "flattened batch where the PDE sites would mix sequences and keep no decode state. Install "
                         "the CTA plugin (`pip install \"cta[vllm]\"`), which serves CTA checkpoints with vLLM's own "
                         "layers, and do not pass `model_impl=\"transformers\"`.")


def check_cache_holds_pde_states(cache, sites, model_name: str):
    """Raises unless each cache layer a causal PDE site of ``sites`` (``pde_cache_sites()``) uses holds conv states."""
    if cache is None or not sites:
        return
    layers = getattr(cache, "layers", None)
    for site, layer_idx, _ in sites:
        layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
        if layer is None or not holds_conv_states(layer):
            raise ValueError(f"{model_name}: generate() was given a {type(cache).__name__} whose layer {layer_idx} "
                             f"({type(layer).__name__}) cannot hold the PDE state of {site!r}; a quantized cache "
                             "(cache_implementation='quantized') and caches built without the model's config cannot. "
                             "Use cache_implementation='dynamic', 'static' or 'offloaded', or build the cache with "
                             "`DynamicCache(config=model.config)` / `StaticCache(config=model.config, ...)`.")


class PDEGenerationMixin(GenerationHooks):
    """Mixed into causal LM classes with PDE sites (before ``GenerationMixin``); they define ``pde_cache_sites()``."""

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        tokens = inputs.get("input_ids")
        tokens = inputs.get("inputs_embeds") if tokens is None else tokens
        if tokens is None or tokens.shape[1] == 1:
            return inputs  # a decode step: as transformers prepared it
        # A step of several tokens: the prefill (whose cache is checked here, before the first token) or a chunk.
        cache, sites = find_cache(inputs, CACHE_ARGUMENTS), self.pde_cache_sites()
        check_cache_holds_pde_states(cache, sites, type(self).__name__)
        mask, given = kwargs.get("attention_mask"), inputs.get("attention_mask")
        if (sites and getattr(cache, "is_compileable", False) and hasattr(self, "create_masks_for_generate")
                and torch.is_tensor(given) and given.dim() == 2):  # (as STATIC_CACHE_2D_MASK, found by structure)
            raise ValueError(f"{type(self).__name__}: this architecture builds its own 2D attention mask for a static "
                             "cache (create_masks_for_generate), which cannot be sized for a cache whose layers hold "
                             "the PDE state; use cache_implementation='dynamic' (the default).")
        if torch.is_tensor(mask) and mask.dim() == 2 and not (torch.is_tensor(given) and given.dim() == 2):
            inputs["attention_mask"] = mask  # the padding walls (see the module docstring)
        return inputs

    def generate(self, *args, **kwargs):
        if self.pde_cache_sites():
            self._refuse_unservable_generation(kwargs)
        token = GENERATING.set(True)  # (see GenerationHooks.is_remote_code)
        try:
            return super().generate(*args, **kwargs)
        finally:
            GENERATING.reset(token)

    def _refuse_unservable_generation(self, kwargs):
        """Raises, before anything runs, where ``generate(**kwargs)`` would need what the PDE state cannot have."""
        config = kwargs.get("generation_config") or getattr(self, "generation_config", None)
        implementation = kwargs.get("cache_implementation") or getattr(config, "cache_implementation", None)
        if implementation in REFUSED_CACHES:
            raise ValueError(f"{type(self).__name__}: cache_implementation={implementation!r} is refused: "
                             f"{REFUSED_CACHES[implementation]} Use 'dynamic', 'static' or 'offloaded'.")
        cache = find_cache(kwargs, CACHE_ARGUMENTS)
        static = implementation in STATIC_CACHES or getattr(cache, "is_compileable", False)
        base_type = getattr(type(self.config), "_cta_base_model_type", None)  # (a patched model's)
        if static and base_type in STATIC_CACHE_2D_MASK:
            raise ValueError(f"{type(self).__name__}: a static cache is refused: {base_type} builds its own 2D "
                             "attention mask for a static cache, sized by the cache's length, which a cache whose "
                             "layers hold the PDE state does not report. Use cache_implementation='dynamic' (the "
                             "default).")
        if getattr(config, "is_assistant", False) and transformers_before(ASSISTANT_ROLLBACK_SINCE):
            raise ValueError(f"{type(self).__name__} as the assistant (draft) model of assisted decoding needs "
                             f"transformers >= {ASSISTANT_ROLLBACK_SINCE}: transformers {transformers.__version__} "
                             "does not let an assistant's cache roll its conv states back after rejected drafts. "
                             "Upgrade transformers, or use this model as the main model (prompt lookup and a plain "
                             "assistant work).")


__all__ = ["PDEGenerationMixin", "check_cache_holds_pde_states", "compiled_calls", "drop_compiled_calls"]
