# coding=utf-8
"""The CTA PDE operator's dispatch (PyTorch reference or Triton kernels) and its learnable module.

``pde_refine`` / ``pde_decode_step`` choose the backend; :class:`PDERefinement` holds the coefficients, keeps them
inside their stable bounds (``project_coefficient``) and keeps the causal decode state in transformers' Cache API.
The schemes and their stability are documented in ``pde_reference``; the bounds in ``pde_spec``.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional

import torch
from torch import nn

from .pde_cache import cached_pde_state
from .pde_reference import pde_decode_step_reference, pde_refine_reference
from .pde_spec import (  # noqa: F401  (re-exported: the operator's public names live here too)
    COEFFICIENT_BOUNDS,
    MAX_PDE_STEPS,
    PAPER_COEFFICIENTS,
    PDE_BACKENDS,
    PDE_TYPE_ALIASES,
    PDE_TYPES,
    WAVE_DAMPING,
    check_pde_arguments,
    coefficient_bounds,
    normalize_pde_type,
    uses_beta,
)


# ----------------------------------------------------------------------------------------------------------------
# Backend dispatch
# ----------------------------------------------------------------------------------------------------------------


_TRITON = []  # [(cta.triton_cta or None, why it cannot run here)] once looked up (cached: decode asks per token)
# Dtypes the Triton backend takes: fp32 / bf16 / fp16 run fused, fp64 runs the reference inside it.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _triton_lookup():
    """``(cta.triton_cta, None)`` when Triton can run here (CUDA, or its interpreter), else ``(module or None, the
    missing requirement)``; looked up once."""
    if not _TRITON:
        module, missing = None, None
        try:  # a `from .x import` line: transformers' remote-code loader copies the files such lines name
            from .triton_cta import pde_refine_triton

            module = sys.modules[pde_refine_triton.__module__]
        except ImportError as error:
            missing = f"cta.triton_cta does not import ({error})"
        if importlib.util.find_spec("triton") is None:  # kernels_jit imports without triton; tell that case apart
            module, missing = None, "Triton is not installed (`pip install triton`)"
        elif module is not None and not module.is_available():
            missing = ("there is no CUDA device (torch.cuda.is_available() is False) and Triton's interpreter is off "
                       "(TRITON_INTERPRET=1, set before triton is imported, runs the kernels on CPU)")
        _TRITON.append((module if missing is None else None, missing))
    return _TRITON[0]


def _triton_module():
    """``cta.triton_cta`` when Triton can run here (CUDA, or the interpreter), else None."""
    return _triton_lookup()[0]


def triton_available() -> bool:
    """True when the Triton kernels can run here (triton importable, and CUDA or ``TRITON_INTERPRET=1``)."""
    return _triton_module() is not None


def triton_missing_requirement(tensor: torch.Tensor) -> Optional[str]:
    """Why ``backend="triton"`` cannot refine ``tensor`` here (no Triton, no CUDA device, a tensor off CUDA, an
    unsupported dtype), or None when it can. Host-side attribute checks only: no import, no synchronisation."""
    module, missing = _triton_lookup()
    if missing is not None:
        return missing
    if not (tensor.is_cuda or module.INTERPRET):
        return (f"`hidden_states` is on {tensor.device}: the kernels run on CUDA tensors (on CPU only through Triton's "
                "interpreter, TRITON_INTERPRET=1, which is off)")
    if tensor.dtype not in TRITON_DTYPES:
        return f"`hidden_states` has dtype {tensor.dtype}; the Triton backend takes {[str(d) for d in TRITON_DTYPES]}"
    return None


def _use_triton(backend: str, tensor: torch.Tensor) -> bool:
    if backend not in PDE_BACKENDS:
        raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {backend!r}.")
    if backend == "torch" or not torch.is_tensor(tensor):
        return False  # (not a tensor: the reference's argument check names it)
    if backend == "triton":
        missing = triton_missing_requirement(tensor)
        if missing is not None:
            raise ValueError(f"`backend='triton'` cannot run here: {missing}. Use backend='auto' or 'torch'.")
        return True
    return tensor.is_cuda and tensor.dtype in TRITON_DTYPES and triton_available()


def pde_refine(
    hidden_states: torch.Tensor,
    *,
    pde_type: str,
    steps: int,
    alpha,
    beta=None,
    causal: bool = False,
    attention_mask: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    return_final_state: bool = False,
    backend: str = "auto",
):
    """Refines ``hidden_states`` ``[batch, seq, channels]`` with ``steps`` explicit steps of the PDE ``pde_type``.

    Args:
        pde_type: ``diffusion``, ``wave``, ``reaction_diffusion`` or ``advection_diffusion`` (hyphens accepted).
        steps: number of explicit pseudo-time steps (0 = identity).
        alpha: effective diffusion coefficient (``c**2`` for the wave): float, 0-d or ``[channels]`` tensor.
        beta: effective reaction / advection coefficient (``reaction_diffusion`` / ``advection_diffusion`` only).
        causal: one-sided stencil: position ``i`` depends only on positions ``<= i``.
        attention_mask: ``[batch, seq]``, 1 for tokens, 0 for padding (a wall that is returned unchanged).
        initial_state / return_final_state: causal streaming state ``[batch, steps, channels]`` (see the reference).
        backend: ``auto`` (Triton on CUDA when importable), ``torch`` (the reference) or ``triton`` (raises, naming
            the missing requirement, where it cannot run: no Triton, no CUDA device, an unsupported dtype).

    A Python-number ``alpha`` / ``beta`` outside its scheme's stable interval (``coefficient_bounds(pde_type,
    causal)``, :data:`COEFFICIENT_BOUNDS`) raises a ValueError. Tensor coefficients are checked for shape and dtype
    only: their values are not range-checked (reading them would synchronise the host with the device), and values
    outside the interval lose the stability guarantee. :class:`PDERefinement` projects its own coefficients onto the
    interval.
    """
    if _use_triton(backend, hidden_states):
        return _triton_module().pde_refine_triton(
            hidden_states,
            pde_type=pde_type,
            steps=steps,
            alpha=alpha,
            beta=beta,
            causal=causal,
            attention_mask=attention_mask,
            initial_state=initial_state,
            return_final_state=return_final_state,
        )
    return pde_refine_reference(
        hidden_states,
        pde_type=pde_type,
        steps=steps,
        alpha=alpha,
        beta=beta,
        causal=causal,
        attention_mask=attention_mask,
        initial_state=initial_state,
        return_final_state=return_final_state,
    )


# Under torch.compile a one-token decode step is traced as the reference's plain tensor operations, not as the Triton
# decode kernel's custom op: inductor then fuses it (coefficient clamp, the S levels, the state write) with the
# residual add before it and the norm after it, where the opaque op cost about three extra launches per site in a
# CUDA-graph step (docs/decoding.md).
def pde_decode_step(hidden_states, state, *, pde_type, steps, alpha, beta=None, token_mask=None, backend="auto",
                    coefficient_bounds=None):
    """Dispatching wrapper of :func:`pde_decode_step_reference` (updates ``state`` in place)."""
    kwargs = dict(pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, token_mask=token_mask,
                  coefficient_bounds=coefficient_bounds)
    if _use_triton(backend, hidden_states) and not torch.compiler.is_compiling():
        return _triton_module().pde_decode_step_triton(hidden_states, state, **kwargs)
    return pde_decode_step_reference(hidden_states, state, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Learnable module
# ----------------------------------------------------------------------------------------------------------------


def check_pde_weights_loaded(loading_info: dict, model_class: str, source) -> None:
    """Raises if a checkpoint's PDE coefficients did not load exactly (``from_pretrained``'s ``loading_info``).

    A model whose PDE sites silently kept their initial coefficients (or dropped the checkpoint's) is a different
    model with no error; every other missing / unexpected weight follows transformers' own reporting (its warnings,
    ``output_loading_info``), e.g. a new task head.
    """
    problems = {
        kind: sorted(str(k) for k in loading_info.get(kind, ()) if "_pde." in str(k))
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    if any(problems.values()):
        raise ValueError(
            f"Loading {model_class} from {source!r}: the checkpoint's PDE weights do not match the config "
            f"(PDE placements / layers / steps / per-channel coefficients): missing weights {problems['missing_keys']}, "
            f"unexpected weights {problems['unexpected_keys']}, mismatched {problems['mismatched_keys']}."
        )


class _StraightThroughClamp(torch.autograd.Function):
    """Clamps in the forward pass, passes the gradient unchanged (so a coefficient at a bound can come back)."""

    @staticmethod
    def forward(ctx, raw, low, high):
        return raw.clamp(low, high)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def project_coefficient(raw: torch.Tensor, bounds) -> torch.Tensor:
    """The coefficient the scheme uses: ``raw`` projected onto ``bounds`` (straight-through gradient).

    The parameter *is* the coefficient while inside its bounds, so ``init="identity"`` (0) is exact, and no value
    the optimiser can reach leaves the stable region. (A sigmoid cannot reach 0 and saturates near its bounds.)
    """
    if not (torch.is_grad_enabled() and raw.requires_grad):
        return raw.clamp(bounds[0], bounds[1])  # inference: skip the autograd.Function (decode is latency-bound)
    return _StraightThroughClamp.apply(raw, bounds[0], bounds[1])


class PDERefinement(nn.Module):
    """Learnable PDE refinement of ``[batch, seq, channels]`` hidden states.

    Parameters ``alpha`` (and ``beta`` for reaction/advection) are scalars or per-channel vectors; the scheme always
    uses them projected onto the stable interval of :data:`COEFFICIENT_BOUNDS` (see :func:`project_coefficient`).
    For causal refinement with a transformers ``Cache`` the streaming state of this site is stored as the conv
    state ``state_idx`` of cache layer ``layer_idx`` (a contiguous fp32 ``[batch, steps, channels]`` buffer), so
    that decoding one token at a time (in place, one kernel) or prefilling in chunks gives exactly the
    full-sequence result.
    """

    def __init__(
        self,
        channels: int,
        pde_type: str = "diffusion",
        steps: int = 1,
        causal: bool = False,
        alpha: float = 0.1,
        beta: Optional[float] = None,
        per_channel: bool = False,
        backend: str = "auto",
        layer_idx: Optional[int] = None,
        state_idx: int = 0,
    ):
        super().__init__()
        self.pde_type = normalize_pde_type(pde_type)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_PDE_STEPS:
            raise ValueError(f"`steps` must be an int in [0, {MAX_PDE_STEPS}], got {steps!r}.")
        if backend not in PDE_BACKENDS:
            raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {backend!r}.")
        self.channels = channels
        self.steps = steps
        self.causal = bool(causal)
        self.backend = backend
        self.layer_idx = layer_idx
        self.state_idx = state_idx
        alpha_bounds, beta_bounds = coefficient_bounds(self.pde_type, self.causal)
        self.alpha_bounds, self.beta_bounds = alpha_bounds, beta_bounds
        shape = (channels,) if per_channel else ()
        self.alpha_init = float(alpha)
        self.alpha = nn.Parameter(torch.full(shape, self.alpha_init))
        if beta_bounds is not None:
            self.beta_init = float(PAPER_COEFFICIENTS[self.pde_type][1] if beta is None else beta)
            self.beta = nn.Parameter(torch.full(shape, self.beta_init))
        else:
            self.beta_init = None
            self.register_parameter("beta", None)

    @property
    def bounds(self):
        """``(alpha_bounds, beta_bounds)``, as ``coefficient_bounds`` arguments take them."""
        return self.alpha_bounds, self.beta_bounds

    def extra_repr(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        return f"{self.pde_type}, steps={self.steps}, {kind}, channels={self.channels}, per_channel={self.alpha.dim() == 1}"

    def coefficients(self):
        """The effective (projected) ``(alpha, beta)`` used by the scheme."""
        alpha = project_coefficient(self.alpha, self.alpha_bounds)
        beta = project_coefficient(self.beta, self.beta_bounds) if self.beta is not None else None
        return alpha, beta

    def _decode_step(self, hidden_states, state, attention_mask):
        """One token ``[batch, 1, channels]``: the decode step on the raw parameters, projected onto their bounds in
        the step itself (decode is host-bound: one launch per site and token, no clamp launches)."""
        if _use_triton(self.backend, hidden_states) and not torch.compiler.is_compiling():
            return _triton_module().pde_decode_token_triton(
                hidden_states, state, self.alpha, self.beta, attention_mask, self.pde_type, self.steps, self.bounds
            )
        out = pde_decode_step(
            hidden_states.select(1, 0), state, pde_type=self.pde_type, steps=self.steps, alpha=self.alpha,
            beta=self.beta, token_mask=attention_mask, backend=self.backend, coefficient_bounds=self.bounds,
        )
        return out.unsqueeze(1)

    def forward(self, hidden_states, attention_mask=None, cache=None):
        if self.steps == 0:
            return hidden_states
        state, differentiable = None, False
        if cache is not None and self.causal:
            if self.layer_idx is None:
                raise ValueError("PDERefinement needs `layer_idx` to read/write its state in a Cache.")
            state = cached_pde_state(cache, self.layer_idx, self.state_idx)
            differentiable = torch.is_grad_enabled() and (
                hidden_states.requires_grad or self.alpha.requires_grad
                or (self.beta is not None and self.beta.requires_grad)
            )
            if state is not None and hidden_states.shape[1] == 1 and not differentiable:
                # one decoded token (the decode kernel has no backward: under autograd the chunked path below)
                return self._decode_step(hidden_states, state, attention_mask)
        alpha, beta = self.coefficients()
        kwargs = dict(pde_type=self.pde_type, steps=self.steps, alpha=alpha, beta=beta)
        if cache is None or not self.causal:
            return pde_refine(
                hidden_states, attention_mask=attention_mask, causal=self.causal, backend=self.backend, **kwargs
            )
        if differentiable and state is not None:
            state = state.clone()  # autograd may save it, and the cache's buffer is overwritten below
        out, final_state = pde_refine(
            hidden_states,
            attention_mask=attention_mask,
            initial_state=state,
            return_final_state=True,
            causal=True,
            backend=self.backend,
            **kwargs,
        )
        # Stored as the layer's conv state with the channels as its last ("kernel") axis, so the buffer is the
        # contiguous [batch, steps, channels] tensor the decode kernel updates in place.
        cache.update_conv_state(final_state.detach().float(), self.layer_idx, state_idx=self.state_idx)
        return out
