# coding=utf-8
"""The module that patching puts around a pretrained model's layers: :class:`CTAPatchWrapper`, and the per-forward
context (:class:`PatchContext`: the 2D padding mask and the cache) that the wrappers of one model share.

``patching_cta.patch_model`` finds the modules and wraps them; this file holds what runs at every forward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint
from torch import nn

from .pde_cache import check_pde_states, find_cache, missing_cache_error

class PatchContext:
    """Per-forward state shared by the wrappers of one model: the 2D padding mask and the cache in use.

    The base model's forward captures it on entry and releases it on exit (:func:`capturing_forward`).
    """

    def __init__(self, mask_position: Optional[int], cache_position: Optional[int], sites, model_name: str):
        self.mask_position = mask_position
        self.cache_position = cache_position
        self.sites = sites  # (site, cache layer, conv state) of every causal PDE site
        self.model_name = model_name
        self.mask = None
        self.cache = None
        self._padded = None  # whether self.mask has a padding position: asked once per forward, when needed
        self._step_mask = None  # the [batch, 1] mask column of a one-token step, taken once per forward

    def capture(self, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and self.mask_position is not None and len(args) > self.mask_position:
            mask = args[self.mask_position]
        # A 4D custom mask: no walls can be derived from it.
        self.mask = mask if torch.is_tensor(mask) and mask.dim() == 2 else None
        self._padded = self._step_mask = None
        cache = find_cache(kwargs)
        if cache is None and self.cache_position is not None and len(args) > self.cache_position:
            cache = args[self.cache_position]
        self.cache = cache
        if cache is not None and self.sites:
            # A continuation step must find every causal PDE site's state in the cache (never refine statelessly).
            check_pde_states(cache, self.sites, self.model_name)

    def release(self):
        self.mask = self.cache = self._padded = self._step_mask = None

    def snapshot(self):
        return self.mask, self.cache, self._padded, self._step_mask

    def restore(self, state):
        self.mask, self.cache, self._padded, self._step_mask = state

    def token_mask(self, length: int):
        mask = self.mask
        if mask is None:
            return None
        if mask.shape[1] < length:
            raise ValueError(
                f"`attention_mask` has {mask.shape[1]} columns but the current input has {length} tokens; it must "
                "cover the cached and the current tokens ([batch, past + seq])."
            )
        if length == 1 and not torch.compiler.is_compiling():
            # One decoded token: its own column is the decode kernel's token mask, made once for all sites. Asking
            # whether the whole mask is ones (to drop it) would cost a device synchronisation per token.
            if self._step_mask is None:
                self._step_mask = mask[:, -1:]  # (a view: the kernel reads the mask's own dtype)
            return self._step_mask
        if self._padded is None:
            # Traced (torch.compile): no data-dependent branch; a mask of ones gives the same walls as no mask.
            self._padded = torch.compiler.is_compiling() or not bool(mask.all())
        return mask[:, -length:] if self._padded else None


def capturing_forward(module, *args, **kwargs):
    """The base model's ``forward`` while patched (an instance attribute: ``functools.partial`` of this, as
    accelerate's hooks do, so that a deep copy calls its own copy): captures the per-forward context around the
    forward it replaced. Forward hooks would do the same, but any hook sends every call of the model through
    ``nn.Module``'s general path, a per-token cost when decoding."""
    context = module._cta_context
    context.capture(args, kwargs)
    try:
        return module._cta_inner_forward(*args, **kwargs)
    finally:
        context.release()


def _first_tensor(output):
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(f"CTA patch: cannot find the hidden states in an output of type {type(output).__name__}.")


def _replace_first(output, value):
    if torch.is_tensor(output):
        return value
    return type(output)((value, *output[1:])) if isinstance(output, tuple) else [value, *output[1:]]


class CTAPatchWrapper(nn.Module):
    """Wraps one module of a pretrained model and applies PDE refinement around it.

    ``role="block"`` (a decoder/encoder layer): ``cta_embedding_pde`` refines the layer's input hidden states (first
    layer only), ``cta_block_output_pde`` its output; it also publishes the layer's cache to the nested wrappers.
    ``role="attention"``: ``cta_value_pde`` refines the value projection (``value_attr``; ``value_slice`` selects the
    value part of a fused qkv projection), ``cta_attention_output_pde`` the attention output.
    ``role="mlp"`` / ``role="output"``: ``cta_<placement>_pde`` refines the output.
    """

    def __init__(self, wrapped: nn.Module, role: str, pdes: dict, value_attr=None, value_slice=None,
                 cache_position=None):
        super().__init__()
        self.wrapped = wrapped
        self.role = role
        self.placements = tuple(pdes)
        for placement, module in pdes.items():
            setattr(self, f"cta_{placement}_pde", module)
        # Submodule names of the placements applied to the output, in order (looked up per call: PEFT may replace
        # a PDE module by its own wrapper).
        self._output_pde_names = tuple(
            f"cta_{placement}_pde" for placement in ("attention_output", "mlp_output", "block_output") if placement in pdes
        )
        self.value_attr = value_attr
        self.value_slice = value_slice
        self.cache_position = cache_position
        self._cta_context = None  # set by _apply_patch (a plain object, not a submodule)
        self.site_name = None  # a block's name in errors, and whether its sites need the cache (set by _apply_patch)
        self.placements_causal = False
        # The output placements refine in the wrapped module's first forward hook, so that every later hook on it
        # (transformers' `output_hidden_states` recording among them) sees the refined output the next layer gets.
        self.refine_hook = (wrapped.register_forward_hook(self._refine_output, prepend=True)
                            if self._output_pde_names else None)

    def extra_repr(self) -> str:
        return f"role={self.role}, placements={list(self.placements)}"

    def __getattr__(self, name):
        # Attributes the parent model reads on the wrapped module (e.g. Qwen2's `decoder_layer.attention_type`).
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "wrapped":
                raise
            return getattr(self.wrapped, name)

    def _refine(self, pde_name, hidden_states, cache):
        mask = self._cta_context.token_mask(hidden_states.shape[1]) if self._cta_context is not None else None
        return getattr(self, pde_name)(hidden_states, mask, cache)

    def forward(self, *args, **kwargs):
        # Runs once per layer and token when decoding, where host time is the cost: plain attributes and dict
        # lookups only (a submodule read through nn.Module.__getattr__ costs a failed lookup first).
        context = self._cta_context
        placements = self.placements
        if self.role == "block":
            cache = find_cache(kwargs)
            if cache is None and self.cache_position is not None and len(args) > self.cache_position:
                cache = args[self.cache_position]
            if context is not None:
                if cache is None and context.cache is not None and self.placements_causal:
                    raise missing_cache_error(f"{self.site_name} ({', '.join(self.placements) or 'nested sites'})")
                context.cache = cache
            if "embedding" in placements:
                if args:
                    args = (self._refine("cta_embedding_pde", args[0], cache), *args[1:])
                else:
                    kwargs["hidden_states"] = self._refine("cta_embedding_pde", kwargs["hidden_states"], cache)
        else:
            cache = context.cache if context is not None else None

        wrapped = self.wrapped
        if "value" in placements:
            handle = getattr(wrapped, self.value_attr).register_forward_hook(self._make_value_hook(cache))
            try:
                output = wrapped(*args, **kwargs)
            finally:
                handle.remove()
        elif self.training and context is not None and getattr(wrapped, "gradient_checkpointing", False):
            output = self._call_checkpointed(wrapped, context, args, kwargs)
        else:
            output = wrapped(*args, **kwargs)
        return output

    def _refine_output(self, module, args, output):
        """The wrapped module's first forward hook: refines its output with the output placements' PDE modules."""
        context = self._cta_context
        cache = context.cache if context is not None else None
        for pde_name in self._output_pde_names:
            plain = type(output) is torch.Tensor
            refined = self._refine(pde_name, output if plain else _first_tensor(output), cache)
            output = refined if plain else _replace_first(output, refined)
        return output

    @staticmethod
    def _call_checkpointed(wrapped, context, args, kwargs):
        """Calls a layer that has transformers' gradient checkpointing on, checkpointing it here instead (torch's
        non-reentrant checkpoint; the layer's own is off for the call). Its recomputation runs in the backward pass,
        after this forward's context was released, and the wrappers nested in the layer read the padding mask from
        that context: the checkpointed function runs with this call's context restored."""
        state = context.snapshot()

        def run(*run_args):  # the forward and, later, its recomputation
            saved = context.snapshot()
            context.restore(state)
            wrapped.gradient_checkpointing = False
            try:
                return wrapped(*run_args, **kwargs)
            finally:
                wrapped.gradient_checkpointing = True
                context.restore(saved)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)

    def _make_value_hook(self, cache):
        def hook(module, args, output):
            if self.value_slice is None:
                return self._refine("cta_value_pde", output, cache)
            low, high = self.value_slice
            refined = self._refine("cta_value_pde", output[..., low:high], cache)
            return torch.cat([output[..., :low], refined, output[..., high:]], dim=-1)

        return hook
