# coding=utf-8
"""The causal PDE state in transformers' Cache, and the cache keyword of the installed transformers.

A causal PDE site keeps one fp32 ``[batch, 1, channels, 1]`` conv state per step in hybrid cache layers, laid out by
``site_spec`` (site ``k`` of a layer owns ``k * steps .. (k + 1) * steps - 1``; while recording its past, one column
per position, ``crop`` rolls it back: ``docs/decoding.md``). A decode step missing its state raises. transformers renamed ``past_key_values`` to
``cache`` in 5.24 (deprecated until 5.40): models read either, pass on :data:`CACHE_ARGUMENT` (the installed name).
"""

from __future__ import annotations

import weakref

import torch
import transformers

# (the state API: here too)
from .transformers_compat import (CACHE_ARGUMENT, PAST_KEY_VALUES_REMOVAL, conv_state, conv_state_block,  # noqa
                                  conv_state_written, deprecate_kwarg, fill_unused_pde_states, holds_conv_states,
                                  layer_records_past, records_past, store_pde_state)


CACHE_ARGUMENTS = ("cache", "past_key_values")
_CACHE_LOOKUP_ORDER = tuple(dict.fromkeys((CACHE_ARGUMENT, *CACHE_ARGUMENTS)))


def deprecate_past_key_values(forward):
    """transformers' ``deprecate_kwarg`` for the old cache keyword where renamed; ``forward`` unchanged before."""
    if CACHE_ARGUMENT != "cache":
        return forward
    return deprecate_kwarg("past_key_values", PAST_KEY_VALUES_REMOVAL, new_name="cache")(forward)


def pop_cache(kwargs: dict, cache=None):
    """The cache given under either name (popped from ``kwargs``; ``cache``: an explicit parameter's value)."""
    given = [c for c in (cache, kwargs.pop("cache", None), kwargs.pop("past_key_values", None)) if c is not None]
    if len(given) > 1 and any(c is not given[0] for c in given[1:]):
        raise ValueError("Pass the cache once: as `cache` or as `past_key_values`, not both.")
    return given[0] if given else None


def cache_lookup_order(names=CACHE_ARGUMENTS) -> tuple:
    """The keywords :func:`find_cache` tries: the installed release's name, then ``names`` (e.g. ``layer_past``)."""
    return tuple(dict.fromkeys((*_CACHE_LOOKUP_ORDER, *names)))


def find_cache(kwargs: dict, order=_CACHE_LOOKUP_ORDER):
    """The cache in a forward's keyword arguments under the first keyword of ``order`` that holds one (older releases
    pass an unknown ``cache=`` on untouched beside the ``past_key_values`` in use)."""
    for name in order:  # (a constant tuple: this runs once per PDE-bearing layer and decoded token)
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def _no_conv_states(cache, layer_idx: int) -> ValueError:
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    return ValueError(
        "A causal PDE refinement needs a cache whose layers hold conv states (transformers' hybrid layers); "
        "build it with `transformers.DynamicCache(config=model.config)` or let `generate()` create it. "
        f"Got {type(cache).__name__} with layer {layer_idx} of type {type(layer).__name__}.")


def _state_layer(cache, layer_idx: int):
    """The cache layer that holds the PDE states of layer ``layer_idx``; raises unless it can hold conv states."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if layer is None or not holds_conv_states(layer):
        raise _no_conv_states(cache, layer_idx)
    return layer


def cached_pde_state(cache, layer_idx: int, state_idx: int, steps: int) -> tuple:
    """``(levels, records_past)``: the site's ``steps`` conv states ``[batch, 1, channels, positions]`` (not views), or
    None before prefill, and whether its cache layer keeps each position's state (:func:`records_past`). One lookup of
    the layer, no check on the way (a decoded token asks at every site): a cache whose layer cannot hold conv states
    fails the lookup, which raises naming it."""
    try:
        layer = cache.layers[layer_idx]
        written = conv_state_written(layer, state_idx)
    except (AttributeError, IndexError, TypeError):
        raise _no_conv_states(cache, layer_idx) from None
    history = layer_records_past(layer)
    if not written:
        return None, history
    return [conv_state(layer, index) for index in range(state_idx, state_idx + steps)], history


_torch_is_exporting = getattr(torch.compiler, "is_exporting", None)  # (public from torch 2.5)


@torch.compiler.assume_constant_result
def is_exporting() -> bool:
    """Whether ``torch.export`` traces this call; False under ``torch.compile`` (Dynamo runs it instead of tracing
    it, while it folds ``torch.compiler.is_exporting()`` itself to True under ``torch.compile`` in some releases)."""
    return bool(_torch_is_exporting is not None and _torch_is_exporting())


def refuse_export_with_cache(model_name: str):
    """Raises: ``torch.export`` traces a forward of a model with causal PDE sites that is given a cache."""
    message = (
        f"{model_name}: cannot export a forward with a cache. Its causal PDE sites keep their state in the cache's "
        "conv states, which the exported program's cache does not carry as mutable state (transformers' export "
        "recipes, ExecuTorch's included, register only key/value buffers, and a hybrid cache layer creates its "
        "states inside the traced forward): every decode step of the exported program would refine its token as if "
        "it started the sequence, giving wrong logits without an error. What works: export the forward without a cache "
        "(`use_cache=False`, no cache argument), or decode with `generate()`, eager or under `torch.compile`. "
        f"(transformers {transformers.__version__}, torch {torch.__version__})")
    # Not `raise`: under Dynamo (strict export) it surfaces as an "Observed exception" graph break, the message buried;
    # Dynamo folds `torch._assert` on a constant and the AssertionError comes out as it is (non-strict: the same).
    torch._assert(False, message)


class CacheSites(list):
    """``[(site name, cache layer, conv state)]`` of a model's causal PDE sites (``site_spec.cache_sites``), with the
    last cache :func:`check_pde_states` found holding every site's state (weakly held)."""

    checked = None  # a weak reference to that cache, or None

    def __reduce__(self):  # (copied or pickled with its model: without the checked cache)
        return CacheSites, (list(self),)


def check_pde_states(cache, sites, model_name: str):
    """Raises unless each of ``sites`` (``[(site name, layer_idx, state_idx)]``) finds its state in a ``cache`` holding
    past tokens, or while ``torch.export`` traces a forward given a cache. Once a cache holds every state, later calls
    with it (the decoded tokens) are not checked again: an identity check (``sites`` a :class:`CacheSites`)."""
    if cache is None or not sites:
        return
    if torch.compiler.is_compiling():
        if is_exporting():
            refuse_export_with_cache(model_name)
        return  # traced: the eager calls before (prefill) checked the same cache
    checked = getattr(sites, "checked", None)
    if checked is not None and checked() is cache:
        return
    missing = [site for site in sites if not conv_state_written(_state_layer(cache, site[1]), site[2])]
    if not missing:
        if isinstance(sites, CacheSites):
            try:
                sites.checked = weakref.ref(cache)
            except TypeError:  # (a cache that takes no weak reference: checked at every call)
                pass
        return  # host-side lookups only: no device synchronisation on a decode step
    past_length = int(cache.get_seq_length())  # a first chunk has no state yet; asked only then (a static cache syncs)
    if past_length > 0:
        site, layer_idx, state_idx = missing[0]
        raise ValueError(
            f"{model_name}: the cache holds {past_length} past tokens but no PDE state for the site {site!r} "
            f"(cache layer {layer_idx}, conv state {state_idx}); continuing without it would refine the new "
            "tokens as if they started the sequence. Prefill this cache with this model (`use_cache=True`) outside "
            "training (a training forward keeps no PDE state in a cache it starts), or let `generate()` build it. "
            f"(transformers {transformers.__version__})")


def missing_cache_error(site: str) -> ValueError:
    """The error of a PDE site that received no cache although its model was called with one."""
    return ValueError(
        f"CTA patch: the PDE site {site!r} received no cache although the model was called with one: transformers "
        f"{transformers.__version__} passes the cache to its decoder layers under a name this version of cta does not "
        f"read (it reads {CACHE_ARGUMENTS}). Refining without the cache would decode wrong tokens; please report this "
        "with your transformers version.")


__all__ = ["CACHE_ARGUMENT", "CACHE_ARGUMENTS", "deprecate_past_key_values", "pop_cache", "cache_lookup_order",
           "find_cache", "cached_pde_state", "conv_state_block", "records_past", "store_pde_state", "fill_unused_pde_states",
           "is_exporting", "refuse_export_with_cache", "CacheSites", "check_pde_states", "missing_cache_error"]
