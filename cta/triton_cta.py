# coding=utf-8
"""The CUDA path of :func:`pde_cta.pde_refine`: the Triton kernels (``kernels_*``) with autograd, as custom ops.

* Forward and backward are torch custom ops (``cta::pde_refine_fwd`` / ``_bwd``) with fake implementations and
  autograd: ``torch.compile`` traces them without graph breaks (a traced decode step is ``pde_decode``'s torch ops,
  which Inductor fuses into the next norm); on CUDA their implementations launch the C++ launcher's plans
  (``kernels_cpp``) where one serves. Eager calls take the launcher's autograd node or a plain
  ``torch.autograd.Function`` over the same launches (the launch alone under ``no_grad``): :func:`refine` chooses.
* Gradients that involve the streamed state (an ``initial_state`` that requires grad, or a used final state) run the
  reference's autograd on the saved inputs: exact, slower, rare (the models detach the state they cache).
* ``steps`` 1..16 run fused in fp32, bf16 and fp16 (fp32 accumulation); ``pde_cta`` sends other calls to the
  reference. No call synchronises the host with the GPU.
"""

from __future__ import annotations


import torch

from .kernels_config import MAX_FUSED_STEPS
from .kernels_jit import INTERPRET, is_available  # noqa: F401  (pde_cta's lookup reads them here)
from .kernels_cpp import backward_planned, forward_planned, refine_planned
from .kernels_launch import launch_backward, launch_decode, launch_forward  # noqa: F401  (launch_decode: pde_cta)
from .pde_reference import pde_refine_reference
from .pde_spec import PDE_IDS, project_coefficients

__all__ = ["MAX_FUSED_STEPS", "is_available", "launch_decode", "refine"]


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


def refine(x, alpha, beta, mask, init, pde: str, steps: int, causal: bool, want_final: bool, bounds=None):
    """The Triton backend of :func:`pde_cta.pde_refine` (arguments checked there; ``steps`` 1..MAX_FUSED_STEPS, a
    fused dtype): ``y``, or ``(y, final state)`` with ``want_final``. ``bounds``: the raw coefficients are projected
    onto them (straight-through gradient), inside the kernels where they run eagerly.

    One operation, its implementations chosen here by how it is called: traced, the registered op (no graph break);
    eager on CUDA without a streamed state, the C++ launcher's plan (one autograd node, no Python per launch); eager
    under autograd, the same kernels through :class:`_PDERefineFunction`; eager without gradients, the launch."""
    device = x.device
    alpha = alpha if alpha.device == device else alpha.to(device)
    beta = beta if beta is None or beta.device == device else beta.to(device)
    mask = mask if mask is None or mask.device == device else mask.to(device)
    if bounds is not None and (torch.compiler.is_compiling() or init is not None or want_final):
        # (traced: Inductor fuses the clamp; a streamed state's gradient runs the reference on what it is given)
        alpha, beta = project_coefficients(alpha, beta, bounds)
        bounds = None
    if torch.compiler.is_compiling():
        y, fin = _pde_refine_fwd(x, alpha, beta, mask, init, PDE_IDS[pde], steps, causal, want_final)
        return (y, fin) if want_final else y
    if init is None and not want_final and x.is_cuda:
        y = refine_planned((pde, steps, causal, bounds), x, alpha, beta, mask)
        if y is not None:
            return y
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, alpha, beta, init)):
        y, fin = _PDERefineFunction.apply(x, alpha, beta, mask, init, (pde, steps, causal, want_final, bounds))
    else:
        y, fin = launch_forward(x, alpha, beta, mask, init, pde, steps, causal, want_final, bounds)
    if want_final:
        return y, (fin if fin is not None else _no_state(x))
    return y
