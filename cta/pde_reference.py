# coding=utf-8
"""The readable PyTorch reference of the Continuous-Time Attention PDE operator: the ground truth of every other
backend, vectorised, on any device. ``u`` is ``[batch, seq, channels]``; an optional ``attention_mask`` ``[batch,
seq]`` marks real tokens with 1. Computed in fp32, returned in the input dtype; ``steps == 0`` is the identity.

Schemes (``pde_spec.PDEScheme``): explicit pseudo-time steps in flux form, so that walls are exact. ``e(i, i+1)`` is
1 when positions ``i`` and ``i+1`` are both real tokens and 0 otherwise: sequence ends and padding are *walls*; a
padded position never changes and is never read.

Bidirectional (encoders), zero-flux walls: ``u[i] += G(i+1/2) - G(i-1/2) + R(u[i], b)`` with the edge flux
``G(i+1/2) = e(i,i+1) * (a * (u[i+1] - u[i]) - b+ * u[i] - b- * u[i+1])`` (``b+ = max(b, 0)``, ``b- = min(b, 0)``;
the ``b`` terms only for a scheme with ``advection``: upwind transport with velocity ``b``, mass-conservative at
walls; ``R`` the scheme's ``reaction``, if any). ``wave``: ``v = (1 - WAVE_DAMPING) * v + a * lap(u); u += v`` with
``v = 0`` at the start and ``a = c**2``.

Causal (decoders), zero-inflow walls: position ``i`` reads only its left neighbour ``l = u[i-1]`` (0 at the start of
the sequence and after padding: the sequence behaves as if preceded by zeros, like causal-conv1d's zero initial
state), so after any number of steps it depends only on positions ``<= i``: ``u[i] += c * (l - u[i]) + R(u[i], b)``
with ``c = a`` (``a + b`` with ``advection``: the upwind stencil of causal transport is the same left difference);
``wave``: ``v[i] = (1 - WAVE_DAMPING) * v[i] + a * (l - u[i]); u[i] += v[i]``.

Stable bounds and why: ``PDEScheme.bounds`` and ``.stability``. The authors' public causal stencil ``u[i] += a *
(u[i] - 2 u[i-1] + u[i-2])`` has amplification ``|1 + 4a| > 1`` at the alternating mode and is deliberately not
provided.
"""

from __future__ import annotations

from typing import Optional

import torch

from .pde_spec import WAVE_DAMPING, check_decode_arguments, check_pde_arguments, project_coefficients, scheme_of


def _bidirectional_step(u, v, scheme, alpha, beta, open_edge, valid):
    """One explicit step of the bidirectional scheme in flux form (fp32, [B, L, C])."""
    flux = alpha * (u[:, 1:] - u[:, :-1])  # into the left cell of each edge, from u[i+1] - u[i] on the L-1 edges
    if scheme.advection:
        flux = flux - beta.clamp(min=0) * u[:, :-1] - beta.clamp(max=0) * u[:, 1:]
    flux = flux * open_edge
    update = torch.nn.functional.pad(flux, (0, 0, 0, 1)) - torch.nn.functional.pad(flux, (0, 0, 1, 0))
    if scheme.wave:
        v = (1.0 - WAVE_DAMPING) * v + update
        return u + v, v
    if scheme.reaction:
        update = update + scheme.torch_reaction(u, beta) * valid
    return u + update, v


def _causal_step(u, v, left, scheme, alpha, beta, valid):
    """One explicit causal step; ``left`` holds u[i-1] (already zero at walls)."""
    pull = left - u
    if scheme.wave:
        v = (1.0 - WAVE_DAMPING) * v + alpha * pull * valid
        return u + v, v
    update = (alpha + beta if scheme.advection else alpha) * pull
    if scheme.reaction:
        update = update + scheme.torch_reaction(u, beta)
    return u + update * valid, v


def pde_refine_reference(hidden_states: torch.Tensor, *, pde_type: str, steps: int, alpha, beta=None,
                         causal: bool = False, attention_mask: Optional[torch.Tensor] = None,
                         initial_state: Optional[torch.Tensor] = None, return_final_state: bool = False):
    """Readable, vectorised fp32 reference of :func:`pde_refine` (the ground truth of every backend).

    ``initial_state`` / the returned final state (causal only) are ``[batch, steps, channels]``: entry ``s`` is the
    value of the step-``s`` iterate at the position just before the first one (zeros = start of sequence / wall)."""
    pde_type, alpha, beta = check_pde_arguments(hidden_states, pde_type, steps, alpha, beta, attention_mask,
                                                initial_state, causal)
    return reference_refine(hidden_states, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, causal=causal,
                            attention_mask=attention_mask, initial_state=initial_state,
                            return_final_state=return_final_state)


def causal_state_history(hidden_states: torch.Tensor, *, pde_type: str, steps: int, alpha, beta=None,
                         attention_mask: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None):
    """The causal :func:`pde_refine_reference` and the state after *every* position: ``(out, states)`` with
    ``states`` ``[batch, steps, channels, seq]`` (column ``-1`` is the final state). What a cache that may be rolled
    back to an earlier position keeps (assisted decoding)."""
    pde_type, alpha, beta = check_pde_arguments(hidden_states, pde_type, steps, alpha, beta, attention_mask,
                                                initial_state, True)
    return reference_refine(hidden_states, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, causal=True,
                            attention_mask=attention_mask, initial_state=initial_state, return_final_state=True,
                            return_state_history=True)


def reference_refine(hidden_states, *, pde_type, steps, alpha, beta, causal, attention_mask, initial_state,
                     return_final_state, return_state_history=False):
    """:func:`pde_refine_reference` on arguments :func:`pde_spec.check_pde_arguments` has checked (``pde_cta``'s
    torch backend: the checks run once per call)."""
    batch, seq, channels = hidden_states.shape
    compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    u = hidden_states.to(compute_dtype)
    alpha = alpha.to(compute_dtype)
    beta = beta.to(compute_dtype) if beta is not None else None
    if attention_mask is None:
        valid = torch.ones(batch, seq, 1, device=u.device, dtype=compute_dtype)
    else:
        valid = attention_mask.to(device=u.device, dtype=compute_dtype).unsqueeze(-1)
    scheme = scheme_of(pde_type)
    v = torch.zeros_like(u) if scheme.wave else None
    final_state = []
    if causal:
        if initial_state is None:
            initial_state = torch.zeros(batch, steps, channels, device=u.device, dtype=compute_dtype)
        left_valid = torch.nn.functional.pad(valid[:, :-1], (0, 0, 1, 0), value=1.0)
        for step in range(steps):
            final_state.append(u * valid if return_state_history else u[:, -1] * valid[:, -1])
            left = torch.cat([initial_state[:, step : step + 1].to(compute_dtype), u[:, :-1]], dim=1) * left_valid
            u, v = _causal_step(u, v, left, scheme, alpha, beta, valid)
    else:
        open_edge = valid[:, 1:] * valid[:, :-1]
        for step in range(steps):
            u, v = _bidirectional_step(u, v, scheme, alpha, beta, open_edge, valid)
    out = u.to(hidden_states.dtype)
    if return_state_history:
        if not final_state:
            return out, torch.zeros(batch, 0, channels, seq, device=u.device, dtype=compute_dtype)
        return out, torch.stack(final_state, dim=1).transpose(2, 3)  # [batch, steps, channels, seq]
    if return_final_state:
        empty = torch.zeros(batch, 0, channels, device=u.device, dtype=compute_dtype)
        return out, torch.stack(final_state, dim=1) if final_state else empty
    return out


def pde_decode_step_reference(hidden_states: torch.Tensor, state: torch.Tensor, *, pde_type: str, steps: int, alpha,
                              beta=None, token_mask: Optional[torch.Tensor] = None,
                              state_indices: Optional[torch.Tensor] = None, coefficient_bounds=None):
    """One causal decode step (the ``update`` to :func:`pde_refine`'s ``fn``, as in causal-conv1d).

    ``hidden_states`` is ``[batch, channels]`` (the new token), ``state`` ``[batch, steps, channels]`` fp32 as returned
    by ``pde_refine(..., causal=True, return_final_state=True)``; it is updated in place. ``token_mask``: one entry per
    sequence (0: padding, returned unchanged). ``state_indices``: the rows of ``state`` (a table) that hold the
    sequences' states. ``coefficient_bounds``: ``((alpha_min, alpha_max), (beta_min, beta_max) | None)`` to clamp the
    coefficients into first (:class:`PDERefinement`'s projection), or None. Returns the refined token."""
    pde_type, alpha, beta, bounds = check_decode_arguments(hidden_states, state, pde_type, steps, alpha, beta,
                                                           token_mask, coefficient_bounds, state_indices)
    if state_indices is not None:
        rows = state_indices.reshape(-1).long()
        gathered = state.index_select(0, rows)
        out = pde_decode_step_reference(hidden_states, gathered, pde_type=pde_type, steps=steps, alpha=alpha,
                                        beta=beta, token_mask=token_mask, coefficient_bounds=bounds)
        state.index_copy_(0, rows, gathered)
        return out
    if not torch.is_tensor(state) or state.dim() != 3 or hidden_states.dim() != 2:
        raise ValueError("pde_decode_step_reference takes `hidden_states` [batch, channels] and `state` [batch, steps, "
                         "channels] (cta.pde_decode_update also takes a cache's level buffers).")
    alpha, beta = project_coefficients(alpha, beta, bounds)
    out, new_state = reference_refine(
        hidden_states.unsqueeze(1), pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, causal=True,
        attention_mask=None if token_mask is None else token_mask.reshape(-1, 1), initial_state=state,
        return_final_state=True)
    state.copy_(new_state)
    return out.squeeze(1)
