# coding=utf-8
"""The CUDA path of :func:`pde_cta.pde_refine`: the Triton kernels as torch custom ops with autograd.

The kernels live in flat sibling files (transformers' remote-code loader copies ``from .x import`` siblings):
``kernels_jit`` (the Triton import and the fixed kernels), ``kernels_source`` (the generated streaming kernels),
``kernels_config`` (launch configurations), ``kernels_launch`` (the launches). This module adds autograd and the
custom ops, and the public entry points :func:`pde_refine_triton` and :func:`pde_decode_step_triton`.

* Forward and backward are registered as torch custom ops (``cta::pde_refine_fwd``, ``cta::pde_refine_bwd``) with
  fake implementations and autograd, so ``torch.compile`` traces through them without graph breaks. A traced
  one-token decode step is the recurrence as torch ops instead (``pde_decode``): Inductor fuses it, state writes
  included, into the kernel of the norm that follows, where an opaque op would be a kernel of its own and leave the
  residual add before it one too. Eager calls use a plain ``torch.autograd.Function`` over the same launches (or the
  launch alone under ``no_grad``), which costs less host time per call than the custom-op dispatcher.
* Gradients flow to ``hidden_states``, ``alpha`` and ``beta`` through the kernels. When the gradient also involves
  the streamed state (an ``initial_state`` that requires grad, or a returned final state that the loss uses), the
  backward runs the PyTorch reference's autograd on the saved inputs: exact, and slower (rare in training: the
  models detach the state they cache).
* ``steps`` 1..16 run fused; 17..64 fall back to the reference; 0 is the identity. fp32, bf16 and fp16 run fused
  (fp32 accumulation); fp64 falls back to the reference.
* No call synchronises the host with the GPU: a Python-float coefficient becomes a device tensor by a fill.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernels_config import MAX_FUSED_STEPS
from .kernels_jit import INTERPRET, is_available
from .kernels_launch import coef_grad_shape, launch_backward, launch_decode, launch_forward
from .pde_reference import pde_decode_step_reference, pde_refine_reference
from .pde_spec import (
    PDE_IDS,
    check_attention_mask,
    check_decode_arguments,
    check_decode_levels,
    check_pde_arguments,
)

__all__ = ["MAX_FUSED_STEPS", "is_available", "pde_decode_step_triton", "pde_decode_token_triton",
           "pde_refine_module_triton", "pde_refine_triton"]



def _pde_name(pde_id: int) -> str:
    return list(PDE_IDS)[pde_id]  # (ids are registration indices: ``pde_spec.register_scheme``)


def _op_registered(name: str) -> bool:
    """True when another copy of this module (e.g. transformers' remote-code copy) already registered ``cta::name``."""
    try:
        getattr(torch.ops.cta, name)
        return True
    except (AttributeError, RuntimeError):
        return False


_REGISTER = not _op_registered("pde_refine_fwd")

# The operands both refine ops take, in their impls' order (the forward op then takes `want_final`, the backward op
# takes the output gradient `gy` first): one schema text for the two ops instead of the same type hints on both impls
# (`SymInt` is what a hint `int` gives).
_REFINE_OPERANDS = ("Tensor x, Tensor alpha, Tensor? beta, Tensor? mask, Tensor? init, "
                    "SymInt pde, SymInt steps, bool causal")


def _pde_refine_fwd_impl(x, alpha, beta, mask, init, pde, steps, causal, want_final):
    y, fin = launch_forward(x, alpha, beta, mask, init, _pde_name(pde), steps, causal, want_final)
    return y, (fin if fin is not None else _no_state(x))


def _no_state(x: torch.Tensor) -> torch.Tensor:
    """The empty final state ``[batch, 0, channels]`` of a call that keeps none."""
    return x.new_empty((x.shape[0], 0, x.shape[2]), dtype=torch.float32)


def _pde_refine_fwd_fake(x, alpha, beta, mask, init, pde, steps, causal, want_final):
    batch, seq, channels = x.shape
    y = x.new_empty((batch, seq, channels))
    fin = x.new_empty((batch, steps if (causal and want_final) else 0, channels), dtype=torch.float32)
    return y, fin


def _pde_refine_bwd_impl(gy, x, alpha, beta, mask, init, pde, steps, causal):
    return launch_backward(gy, x, alpha, beta, mask, init, _pde_name(pde), steps, causal)


def _pde_refine_bwd_fake(gy, x, alpha, beta, mask, init, pde, steps, causal):
    channels = x.shape[-1]
    return (
        x.new_empty(x.shape),
        x.new_empty(coef_grad_shape(alpha, channels), dtype=torch.float32),
        x.new_empty(coef_grad_shape(beta, channels), dtype=torch.float32),
    )


def _fwd_setup_context(ctx, inputs, output):
    x, alpha, beta, mask, init, pde, steps, causal, want_final = inputs
    ctx.save_for_backward(x, alpha, beta, mask, init)
    ctx.meta = (_pde_name(pde), steps, causal, None)  # (no bounds: see _PDERefineFunction)
    ctx.set_materialize_grads(False)  # None for an unused output: the final state's gradient decides the path
    if output[1] is not None and not (causal and want_final):
        ctx.mark_non_differentiable(output[1])


def _coef_grad(c: Optional[torch.Tensor], g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A coefficient's fp32 gradient (in ``coef_grad_shape``) in its dtype and shape (a one-element parameter's
    comes back 0-d)."""
    if c is None or g is None:
        return None
    g = g if g.dtype == c.dtype else g.to(c.dtype)
    return g if g.shape == c.shape else g.reshape(c.shape)


def _state_backward(ctx, gy, gfin):
    """(dx, dalpha, dbeta, dinit) through the reference's autograd on the saved inputs, for gradients that involve
    the streamed state: the kernels' backward has no initial-state gradient and no final-state input."""
    x, alpha, beta, mask, init = ctx.saved_tensors
    pde, steps, causal, _ = ctx.meta
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[4])
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip((x, alpha, beta, init), needs)]
        y, fin = pde_refine_reference(
            leaves[0], pde_type=pde, steps=steps, alpha=leaves[1], beta=leaves[2], causal=causal,
            attention_mask=mask, initial_state=leaves[3], return_final_state=True,
        )
        outputs, grads = [y], [gy if gy is not None else torch.zeros_like(y)]
        if gfin is not None:
            outputs.append(fin)
            grads.append(gfin)
        wanted = [leaf for leaf, need in zip(leaves, needs) if need and leaf is not None]
        found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
    return tuple(next(found) if need and leaf is not None else None for leaf, need in zip(leaves, needs))


def _kernel_backward(ctx, gy, gfin, eager=False):
    """The input gradients of the forward op: the backward kernels (through the ``cta::pde_refine_bwd`` op, which
    ``torch.compile`` can trace, or launched directly when ``eager``), or :func:`_state_backward` when the state takes
    part."""
    if gfin is not None or ctx.needs_input_grad[4]:
        dx, dalpha, dbeta, dinit = _state_backward(ctx, gy, gfin)
        return dx, dalpha, dbeta, None, dinit, None, None, None, None
    x, alpha, beta, mask, init = ctx.saved_tensors
    pde, steps, causal, bounds = ctx.meta
    if gy is None:
        gy = torch.zeros_like(x)
    if eager:
        dx, da, db = launch_backward(gy, x, alpha, beta, mask, init, pde, steps, causal, need_db=beta is not None,
                                     bounds=bounds)
    else:
        dx, da, db = _pde_refine_bwd(gy, x, alpha, beta, mask, init, PDE_IDS[pde], steps, causal)
    return dx, _coef_grad(alpha, da), _coef_grad(beta, db), None, None, None, None, None, None


class _PDERefineFunction(torch.autograd.Function):
    """Eager-mode twin of the ``cta::pde_refine_fwd`` custom op and its registered autograd (same kernels), with
    fewer arguments: the options ``(pde, steps, causal, want_final, bounds)`` travel as one tuple, and no final state
    is made when none is asked for. ``bounds`` (:class:`PDERefinement`'s stateless call): the kernels clamp the raw
    coefficients onto them as they read them and return the projected coefficients' gradient for the raw ones
    unchanged (the straight-through projection of ``pde_cta.project_coefficient``): one Python autograd node per
    site, no clamp op."""

    @staticmethod
    def forward(ctx, x, alpha, beta, mask, init, options):
        pde, steps, causal, want_final, bounds = options
        y, fin = launch_forward(x, alpha, beta, mask, init, pde, steps, causal, want_final, bounds)
        ctx.save_for_backward(x, alpha, beta, mask, init)
        ctx.meta = (pde, steps, causal, bounds)
        ctx.set_materialize_grads(False)  # None for an unused output: the final state's gradient decides the path
        return y, fin

    @staticmethod
    def backward(ctx, gy, gfin):
        return _kernel_backward(ctx, gy, gfin, eager=True)[:6]


if _REGISTER:
    _pde_refine_fwd = torch.library.custom_op("cta::pde_refine_fwd", _pde_refine_fwd_impl, mutates_args=(),
                                              schema=f"({_REFINE_OPERANDS}, bool want_final) -> (Tensor, Tensor)")
    _pde_refine_fwd.register_fake(_pde_refine_fwd_fake)
    _pde_refine_bwd = torch.library.custom_op("cta::pde_refine_bwd", _pde_refine_bwd_impl, mutates_args=(),
                                              schema=f"(Tensor gy, {_REFINE_OPERANDS}) -> (Tensor, Tensor, Tensor)")
    _pde_refine_bwd.register_fake(_pde_refine_bwd_fake)
    torch.library.register_autograd("cta::pde_refine_fwd", _kernel_backward, setup_context=_fwd_setup_context)
else:  # pragma: no cover - a second copy of this module shares the first copy's ops
    _pde_refine_fwd = torch.ops.cta.pde_refine_fwd
    _pde_refine_bwd = torch.ops.cta.pde_refine_bwd


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def pde_refine_triton(
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
):
    """Triton implementation of :func:`pde_cta.pde_refine_reference` (same signature and semantics).

    Differentiable w.r.t. ``hidden_states``, ``alpha``, ``beta`` and ``initial_state``, and through the returned final
    state, as the reference is (gradients that involve the state are computed by the reference's autograd, see the
    module notes). ``steps > 16`` falls back to the reference.
    """
    if not is_available():
        raise RuntimeError("pde_refine_triton needs triton and a CUDA device (or TRITON_INTERPRET=1).")
    pde, alpha, beta = check_pde_arguments(
        hidden_states, pde_type, steps, alpha, beta, attention_mask, initial_state, causal
    )
    if steps > MAX_FUSED_STEPS or hidden_states.dtype == torch.float64:  # fp64: the reference computes in fp64
        return pde_refine_reference(
            hidden_states, pde_type=pde, steps=steps, alpha=alpha, beta=beta, causal=causal,
            attention_mask=attention_mask, initial_state=initial_state, return_final_state=return_final_state,
        )
    causal = bool(causal)
    if steps == 0:
        return (hidden_states, _no_state(hidden_states)) if return_final_state else hidden_states
    device = hidden_states.device
    if device.type != "cuda" and not INTERPRET:
        raise ValueError("pde_refine_triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors).")
    if alpha.device != device:
        alpha = alpha.to(device)
    if beta is not None and beta.device != device:
        beta = beta.to(device)
    mask = attention_mask
    if mask is not None and mask.device != device:
        mask = mask.to(device)
    init = initial_state
    want_final = bool(return_final_state)
    if torch.compiler.is_compiling():  # the registered custom op: no graph break
        y, fin = _pde_refine_fwd(hidden_states, alpha, beta, mask, init, PDE_IDS[pde], steps, causal, want_final)
    elif torch.is_grad_enabled() and (
        hidden_states.requires_grad or alpha.requires_grad or (beta is not None and beta.requires_grad)
        or (init is not None and init.requires_grad)
    ):  # eager training: the same kernels through a plain autograd.Function (less dispatch overhead per call)
        y, fin = _PDERefineFunction.apply(hidden_states, alpha, beta, mask, init,
                                          (pde, steps, causal, want_final, None))
    else:  # eager inference: launch directly
        y, fin = launch_forward(hidden_states, alpha, beta, mask, init, pde, steps, causal, want_final)
    if want_final:
        return y, (fin if fin is not None else _no_state(hidden_states))
    return y


def pde_refine_module_triton(hidden_states, alpha, beta, attention_mask, pde_type: str, steps: int, causal: bool,
                             bounds):
    """:class:`PDERefinement`'s eager call without a cache (training, and inference without one) on its raw
    coefficients ``alpha`` / ``beta``, projected onto ``bounds`` inside: :func:`pde_refine_triton` without its
    argument checks, which the module's type, steps and coefficients passed when it was built (a host-bound sharded
    training step pays them per site and step); the token mask, which a model hands over, is checked. Returns None
    where the fused kernels do not apply (fp64, more than ``MAX_FUSED_STEPS`` steps, another device, a traced call):
    the caller then takes :func:`pde_refine`."""
    if (steps > MAX_FUSED_STEPS or hidden_states.dtype == torch.float64 or torch.compiler.is_compiling()
            or alpha.device != hidden_states.device):
        return None
    if attention_mask is not None:
        check_attention_mask(attention_mask, hidden_states.shape[0], hidden_states.shape[1])
        if attention_mask.device != hidden_states.device:
            attention_mask = attention_mask.to(hidden_states.device)
    if torch.is_grad_enabled() and (hidden_states.requires_grad or alpha.requires_grad
                                    or (beta is not None and beta.requires_grad)):
        return _PDERefineFunction.apply(hidden_states, alpha, beta, attention_mask, None,
                                        (pde_type, steps, bool(causal), False, bounds))[0]
    return launch_forward(hidden_states, alpha, beta, attention_mask, None, pde_type, steps, bool(causal), False,
                          bounds)[0]


def pde_decode_step_triton(
    hidden_states: torch.Tensor,
    state: torch.Tensor,
    *,
    pde_type: str,
    steps: int,
    alpha,
    beta=None,
    token_mask: Optional[torch.Tensor] = None,
    coefficient_bounds=None,
):
    """One-token causal decode step; updates ``state`` ``[batch, steps, channels]`` (fp32) in place. Same signature
    and semantics as :func:`pde_reference.pde_decode_step_reference`; ``coefficient_bounds`` are applied in the
    kernel. Under ``torch.compile`` (and beyond ``MAX_FUSED_STEPS`` steps): the reference, traced as torch ops."""
    if not is_available():
        raise RuntimeError("pde_decode_step_triton needs triton and a CUDA device (or TRITON_INTERPRET=1).")
    pde, alpha, beta, bounds = check_decode_arguments(
        hidden_states, state, pde_type, steps, alpha, beta, token_mask, coefficient_bounds
    )
    if steps == 0:
        return hidden_states.clone()
    if torch.compiler.is_compiling() or steps > MAX_FUSED_STEPS or state.stride(-1) != 1:
        return pde_decode_step_reference(hidden_states, state, pde_type=pde, steps=steps, alpha=alpha, beta=beta,
                                         token_mask=token_mask, coefficient_bounds=bounds)
    return launch_decode(hidden_states, state.split(1, dim=1), alpha, beta, token_mask, pde, steps, bounds)


def pde_decode_token_triton(hidden_states, levels, alpha, beta, token_mask, pde_type: str, steps: int, bounds):
    """:class:`PDERefinement`'s eager decode step on ``hidden_states`` ``[batch, 1, channels]`` and its state's
    ``levels`` (``steps <= MAX_FUSED_STEPS`` fp32 ``[batch, 1, channels, 1]`` conv states of a cache, or views
    ``[batch, 1, channels]`` of them): the launch of :func:`pde_decode_step_triton` without its argument checks, which
    the module's own type, steps and coefficients passed when it was built; only the state a cache hands over is
    checked (a wrong shape would be read out of bounds)."""
    batch, _, channels = hidden_states.shape
    check_decode_levels(levels, batch, steps, channels)
    return launch_decode(hidden_states, levels, alpha, beta, token_mask, pde_type, steps, bounds)
