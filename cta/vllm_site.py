# coding=utf-8
"""A PDE site inside vLLM: a stateful layer that keeps each sequence's causal PDE state in vLLM's own state cache, as
vLLM's short convolution (``model_executor/layers/mamba/short_conv.py``) keeps its conv state.

The state of one sequence is ``[steps, channels]`` fp32, the operator's ``initial_state`` / final state of one row
(entry ``s``: the step-``s`` iterate at the last position seen). vLLM's batch is flat, decode tokens first, then
prefill chunks; vLLM's metadata says which state slot each sequence has and whether a chunk continues its sequence
(``has_initial_states_p``: chunked prefill, a prefix-cache hit). :func:`pde_serving.refine_flat_batch` refines it
through the operator's two entry points, ``pde_decode_update`` and ``pde_refine``.

The site runs as one registered custom op (``torch.ops.cta_vllm.pde_site``), opaque to ``torch.compile`` and a
break point of CUDA-graph capture, as vLLM's stateful layers are. This module imports vLLM: only the plugin loads it.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from .pde_cta import PAPER_COEFFICIENTS, coefficient_bounds, pde_decode_update
from .pde_serving import FlatBatch, refine_flat_batch
from .site_spec import PDESiteSpec

OP_LIBRARY = "cta_vllm"
SITE_OP = f"{OP_LIBRARY}::pde_site"  # (named in vLLM's splitting ops: piecewise CUDA graphs break around it)


class VllmPDESite(MambaBase, nn.Module):
    """A causal PDE site whose per-sequence state lives in vLLM's state cache (``self.kv_cache[0]``: ``[slots, steps,
    channels]`` fp32). Parameters ``alpha`` / ``beta`` carry the checkpoint's names (``...cta_<placement>_pde.alpha``),
    projected onto the causal scheme's stable bounds when loaded (:meth:`project_coefficients`), as
    :class:`pde_cta.PDERefinement` projects them."""

    def __init__(self, spec: PDESiteSpec, channels: int, prefix: str):
        """``spec``: the site (``vllm_models.served_sites``); the checkpoint's coefficients replace the initial values
        it names when the weights load."""
        super().__init__()
        self.pde_type, self.steps, self.channels, self.prefix = spec.pde_type, spec.steps, channels, prefix
        self.bounds = coefficient_bounds(self.pde_type, causal=True)
        shape = (channels,) if spec.per_channel else (1,)
        self.alpha = nn.Parameter(torch.full(shape, float(spec.alpha), dtype=torch.float32), requires_grad=False)
        if self.bounds[1] is not None:
            beta = PAPER_COEFFICIENTS[self.pde_type][1] if spec.beta is None else spec.beta
            self.beta = nn.Parameter(torch.full(shape, float(beta), dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("beta", None)
        self._bind_operator()
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def extra_repr(self) -> str:
        return f"{self.pde_type}, steps={self.steps}, causal, channels={self.channels}"

    def get_state_shape(self):
        return ((self.steps, self.channels),)

    def get_state_dtype(self):
        return (torch.float32,)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV  # (its metadata: state indices and prefill starts, all we read)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # (into a buffer the graph allocates, as vLLM's stateful ops write: a piecewise CUDA graph reads it after)
        output = torch.empty_like(hidden_states)
        torch.ops.cta_vllm.pde_site(hidden_states, output, self.prefix)
        return output

    @torch.no_grad()
    def project_coefficients(self) -> None:
        """Projects the loaded coefficients onto the causal scheme's bounds, in place, as ``PDERefinement`` projects
        them per call: the values the scheme uses, so that a served token pays no clamp (each op costs a decoded
        token microseconds on the CPU). Called after every weight load."""
        self.alpha.clamp_(*self.bounds[0])
        if self.beta is not None:
            self.beta.clamp_(*self.bounds[1])
        self._bind_operator()

    def _bind_operator(self) -> None:
        """The operator's keyword arguments, kept for every call (bound again after a load: a loader may replace the
        parameters)."""
        self.operator = dict(pde_type=self.pde_type, steps=self.steps, alpha=self.alpha, beta=self.beta)

    @torch.no_grad()
    def warm_up(self) -> None:
        """One decode step on a scratch state, before the engine serves: on the CPU it builds the operator's C++
        decode kernel (``kernels_cpu``; about 30 s, once per machine) while the engine starts, not on a request."""
        state = torch.zeros(1, self.steps, self.channels, device=self.alpha.device)
        pde_decode_update(torch.zeros(1, self.channels, device=self.alpha.device), state, **self.operator)

    def refine(self, hidden_states: torch.Tensor, attn_metadata, output: torch.Tensor) -> None:
        """Writes the refined ``hidden_states`` ``[tokens, channels]`` into ``output``; the states of the batch's
        sequences read and written (:func:`pde_serving.refine_flat_batch`). ``attn_metadata``: the step's (vLLM's
        forward context)."""
        metadata = attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None
        if metadata is None:  # the memory-profiling run: no sequences, no states
            output.copy_(hidden_states)
        else:
            refine_flat_batch(hidden_states, self.kv_cache[0], flat_batch(metadata), out=output, **self.operator)


def flat_batch(metadata) -> FlatBatch:
    """The :class:`pde_serving.FlatBatch` of vLLM's state metadata (``ShortConvAttentionMetadata``, one object per
    step shared by the sites): made by the first site of a step and kept on the metadata for the others."""
    batch = metadata.__dict__.get("_cta_flat_batch") if hasattr(metadata, "__dict__") else None
    if batch is None:
        decodes, prefills = metadata.num_decode_tokens, bool(metadata.num_prefills)
        batch = FlatBatch.of(
            metadata.state_indices_tensor_d.reshape(-1)[:decodes] if decodes else None,
            prefill_starts=(metadata.query_start_loc_p + decodes).tolist() if prefills else (),
            prefill_slots=metadata.state_indices_tensor_p.reshape(-1).tolist() if prefills else (),
            prefill_continues=metadata.has_initial_states_p.tolist() if prefills else ())
        if hasattr(metadata, "__dict__"):  # (a slotted metadata class: each site reads it)
            metadata.__dict__["_cta_flat_batch"] = batch
    return batch


@eager_break_during_capture
def _pde_site(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    context = get_forward_context()
    context.no_compile_layers[layer_name].refine(hidden_states, context.attn_metadata, output)


def _pde_site_fake(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


_LIBRARY = torch.library.Library(OP_LIBRARY, "FRAGMENT")  # (the op lives as long as this handle)
# (the states it writes live in the engine's cache, outside the graph, as vLLM's short convolution's do; the refined
# tokens go to `output`, as vLLM's short convolution and attention write theirs)
direct_register_custom_op(op_name="pde_site", op_func=_pde_site, mutates_args=["output"], fake_impl=_pde_site_fake,
                          target_lib=_LIBRARY)
