# coding=utf-8
"""The CUDA path of :func:`pde_cta.pde_refine`: the Triton kernels (``kernels_*``) with autograd, as custom ops.

* Forward and backward are torch custom ops (``cta::pde_refine_fwd`` / ``_bwd``) with fake implementations and
  autograd: ``torch.compile`` traces them without graph breaks (a traced decode step is ``pde_decode``'s torch ops,
  which Inductor fuses into the next norm); on CUDA their implementations launch the C++ launcher's plans
  (``kernels_cpp``) where one serves. Eager calls take the launcher's autograd node (``PDERefinement``) or a plain
  ``torch.autograd.Function`` over the same launches (the launch alone under ``no_grad``).
* Gradients that involve the streamed state (an ``initial_state`` that requires grad, or a used final state) run the
  reference's autograd on the saved inputs: exact, slower, rare (the models detach the state they cache).
* ``steps`` 1..16 run fused, more fall back to the reference; fp32, bf16 and fp16 run fused (fp32 accumulation),
  fp64 runs the reference. No call synchronises the host with the GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernels_config import MAX_FUSED_STEPS
from .kernels_jit import INTERPRET, is_available
from .kernels_cpp import backward_planned, forward_planned, refine_planned  # noqa: F401  (refine_planned: pde_cta)
from .kernels_launch import launch_backward, launch_decode, launch_forward
from .pde_reference import pde_decode_step_reference, pde_refine_reference
from .pde_spec import PDE_IDS, check_attention_mask, check_decode_arguments, check_decode_levels, check_pde_arguments

__all__ = ["MAX_FUSED_STEPS", "is_available", "pde_decode_step_triton", "pde_decode_token_triton",
           "pde_refine_module_triton", "pde_refine_triton"]


def _pde_name(pde_id: int) -> str:
    return list(PDE_IDS)[pde_id]  # (ids are registration indices: ``pde_spec.register_scheme``)


try:  # another copy of this module (transformers' remote-code copy) may have registered the ops already
    _REGISTER = torch.ops.cta.pde_refine_fwd is None
except (AttributeError, RuntimeError):
    _REGISTER = True

# The operands both refine ops take, in their impls' order (the forward op then takes `want_final`, the backward op
# takes `gy` first; `SymInt` is what a hint `int` gives).
_REFINE_OPERANDS = ("Tensor x, Tensor alpha, Tensor? beta, Tensor? mask, Tensor? init, "
                    "SymInt pde, SymInt steps, bool causal")


def _pde_refine_fwd_impl(x, alpha, beta, mask, init, pde, steps, causal, want_final):
    if init is None and not want_final and x.is_cuda:  # (a compiled training step: the C++ launcher's plan)
        y = forward_planned((_pde_name(pde), steps, causal, None), x, alpha, beta, mask)
        if y is not None:
            return y, _no_state(x)
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
    if init is None and x.is_cuda:
        grads = backward_planned((_pde_name(pde), steps, causal, None), gy, x, alpha, beta, mask)
        if grads is not None:  # (no beta: the op's 0-d zero, as launch_backward gives)
            return grads[0], grads[1], grads[2] if grads[2] is not None else x.new_zeros((), dtype=torch.float32)
    return launch_backward(gy, x, alpha, beta, mask, init, _pde_name(pde), steps, causal)


def _pde_refine_bwd_fake(gy, x, alpha, beta, mask, init, pde, steps, causal):
    return (x.new_empty(x.shape), alpha.new_empty(alpha.shape),
            beta.new_empty(beta.shape) if beta is not None else x.new_empty((), dtype=torch.float32))


def _fwd_setup_context(ctx, inputs, output):
    x, alpha, beta, mask, init, pde, steps, causal, want_final = inputs
    ctx.save_for_backward(x, alpha, beta, mask, init)
    ctx.meta = (_pde_name(pde), steps, causal, None)  # (no bounds: see _PDERefineFunction)
    ctx.set_materialize_grads(False)  # None for an unused output: the final state's gradient decides the path
    if output[1] is not None and not (causal and want_final):
        ctx.mark_non_differentiable(output[1])


def _state_backward(ctx, gy, gfin):
    """(dx, dalpha, dbeta, dinit) through the reference's autograd on the saved inputs, for gradients that involve
    the streamed state (the kernels' backward has no initial-state gradient and no final-state input)."""
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
    """The forward op's input gradients: the backward kernels (through ``cta::pde_refine_bwd``, or launched directly
    when ``eager``), or :func:`_state_backward` when the state takes part."""
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
    # (the kernels give each coefficient's gradient in its dtype and shape)
    return dx, da, (db if beta is not None else None), None, None, None, None, None, None


class _PDERefineFunction(torch.autograd.Function):
    """Eager twin of the ``cta::pde_refine_fwd`` op and its autograd, the options ``(pde, steps, causal,
    want_final, bounds)`` as one tuple. ``bounds`` (:class:`PDERefinement`'s call): the kernels clamp the raw
    coefficients as they read them and pass the gradient through unchanged (``pde_cta.project_coefficient``'s
    straight-through projection): one autograd node per site, no clamp op."""

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


def pde_refine_triton(hidden_states: torch.Tensor, *, pde_type: str, steps: int, alpha, beta=None,
                      causal: bool = False, attention_mask: Optional[torch.Tensor] = None,
                      initial_state: Optional[torch.Tensor] = None, return_final_state: bool = False):
    """Triton implementation of :func:`pde_cta.pde_refine_reference` (same signature, semantics and gradients)."""
    if not is_available():
        raise RuntimeError("pde_refine_triton needs triton and a CUDA device (or TRITON_INTERPRET=1).")
    pde, alpha, beta = check_pde_arguments(hidden_states, pde_type, steps, alpha, beta, attention_mask,
                                           initial_state, causal)
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
    alpha = alpha if alpha.device == device else alpha.to(device)
    beta = beta if beta is None or beta.device == device else beta.to(device)
    mask = attention_mask if attention_mask is None or attention_mask.device == device else attention_mask.to(device)
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
    """:class:`PDERefinement`'s eager call without a cache on its raw coefficients, projected onto ``bounds`` inside:
    :func:`pde_refine_triton` without the argument checks the module passed when it was built (only the token mask
    is checked). Returns None where the fused kernels do not apply (the caller then takes :func:`pde_refine`)."""
    if (steps > MAX_FUSED_STEPS or hidden_states.dtype == torch.float64 or torch.compiler.is_compiling()
            or alpha.get_device() != hidden_states.get_device()):  # (device indices: no device objects made)
        return None
    if attention_mask is not None:
        check_attention_mask(attention_mask, hidden_states.shape[0], hidden_states.shape[1])
        if attention_mask.get_device() != hidden_states.get_device():
            attention_mask = attention_mask.to(hidden_states.device)
    if torch.is_grad_enabled() and (hidden_states.requires_grad or alpha.requires_grad
                                    or (beta is not None and beta.requires_grad)):
        return _PDERefineFunction.apply(hidden_states, alpha, beta, attention_mask, None,
                                        (pde_type, steps, bool(causal), False, bounds))[0]
    return launch_forward(hidden_states, alpha, beta, attention_mask, None, pde_type, steps, bool(causal), False,
                          bounds)[0]


def pde_decode_step_triton(hidden_states: torch.Tensor, state: torch.Tensor, *, pde_type: str, steps: int, alpha,
                           beta=None, token_mask: Optional[torch.Tensor] = None, coefficient_bounds=None):
    """One-token causal decode step updating ``state`` ``[batch, steps, channels]`` (fp32) in place, as
    :func:`pde_reference.pde_decode_step_reference` does (which runs traced and beyond ``MAX_FUSED_STEPS``)."""
    if not is_available():
        raise RuntimeError("pde_decode_step_triton needs triton and a CUDA device (or TRITON_INTERPRET=1).")
    pde, alpha, beta, bounds = check_decode_arguments(hidden_states, state, pde_type, steps, alpha, beta, token_mask,
                                                      coefficient_bounds)
    if steps == 0:
        return hidden_states.clone()
    if torch.compiler.is_compiling() or steps > MAX_FUSED_STEPS or state.stride(-1) != 1:
        return pde_decode_step_reference(hidden_states, state, pde_type=pde, steps=steps, alpha=alpha, beta=beta,
                                         token_mask=token_mask, coefficient_bounds=bounds)
    return launch_decode(hidden_states, state.split(1, dim=1), alpha, beta, token_mask, pde, steps, bounds)


def pde_decode_token_triton(hidden_states, levels, alpha, beta, token_mask, pde_type: str, steps: int, bounds):
    """:class:`PDERefinement`'s eager decode step on its state's ``levels`` (fp32 ``[batch, 1, channels, 1]`` conv
    states, or ``[batch, 1, channels]`` views): :func:`pde_decode_step_triton` without the checks the module passed
    when built; only the cache's state is checked (a wrong shape would be read out of bounds)."""
    batch, _, channels = hidden_states.shape
    check_decode_levels(levels, batch, steps, channels)
    return launch_decode(hidden_states, levels, alpha, beta, token_mask, pde_type, steps, bounds)
