# coding=utf-8
"""One decoded token of the causal PDE as a state update in plain torch ops (causal-conv1d's ``update`` beside its
``fn``): the path of every device but CUDA eager (the fused Triton decode kernel), and of ``torch.compile``, where
Inductor fuses these ops with the residual add and norm around them.

The state is ``[batch, steps, channels]`` fp32: entry ``s`` is the step-``s`` iterate at the previous position
(:func:`pde_reference.pde_refine_reference`'s final state). For a new token ``x`` the levels ``u_0 = x, ..., u_S``
are the scheme's causal recurrence: ``S`` pointwise steps, one op each (scalar coefficients as numbers on the CPU),
then one write of the state (one per level buffer where a cache keeps one per step: under ``torch.compile`` Inductor
fuses the whole site, state writes included, into the kernel of the following norm).

The refined token is ``u_S``, the new state ``u_0 .. u_{S-1}``. A padded token (``token_mask`` 0) is returned
unchanged and leaves zeros (a wall) as the state, as the sequence operator does.
"""

from __future__ import annotations

from typing import Optional

import torch

from .pde_spec import WAVE_DAMPING, scheme_of


def decode_update_torch(hidden_states: torch.Tensor, state, *, pde_type: str, steps: int, alpha, beta=None,
                        token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch backend of :func:`pde_cta.pde_decode_update` (its arguments checked there, ``alpha`` / ``beta``
    inside their bounds, tensors or numbers): refines one token (``[batch, channels]`` or ``[batch, 1, channels]``)
    and updates ``state`` in place; returns the refined token in the input's shape and dtype.

    ``state``: a ``[batch, steps, channels]`` tensor (or the cache's ``[batch, steps, channels, 1]`` block), or its
    ``steps`` level buffers ``[batch, 1, channels]`` / ``[batch, 1, channels, positions]`` (the last position is the
    state); fp32 (fp64 for float64 models), the dtype it computes in."""
    # (Each op skipped where it would not change anything: on the CPU every call is host time of a decoded token.)
    whole = isinstance(state, torch.Tensor)
    dtype = state.dtype if whole else state[0].dtype
    batch = hidden_states.shape[0]
    x = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)
    level = (batch, *state.shape[2:]) if whole else (batch, 1, x.shape[-1])  # one level: [batch, (1,) channels(, 1)]
    if x.shape != level:
        x = x.reshape(level)
    stored = state.unbind(1) if whole else _stored_levels(state)
    valid = None if token_mask is None else token_mask.reshape(batch, *(1,) * (x.dim() - 1)).to(dtype)
    if whole and state.dim() == 4:  # per-channel coefficients [channels] along the block's channel dim
        alpha, beta = (c.unsqueeze(-1) if isinstance(c, torch.Tensor) and c.dim() else c for c in (alpha, beta))
    levels = _levels(x, stored, scheme_of(pde_type), alpha, beta)
    refined = levels[steps]
    _write_state(state, levels[:steps], valid)
    if valid is not None:
        refined = torch.lerp(x, refined, valid)  # exactly x where valid is 0 and refined where it is 1: one op
    if refined.shape != hidden_states.shape:
        refined = refined.reshape(hidden_states.shape)
    return refined if refined.dtype == hidden_states.dtype else refined.to(hidden_states.dtype)


def _stored_levels(state) -> list:
    """The ``[batch, 1, channels]`` views of a state's level buffers (a conv state's last position)."""
    return [level[..., -1] if level.dim() == 4 else level for level in state]


def _write_state(state, levels, valid):
    """The state (a tensor with the levels along dim 1, or its ``S`` level buffers) := the levels ``u_0 .. u_{S-1}``
    (zeros for padded sequences)."""
    if not levels:
        return
    if not isinstance(state, torch.Tensor):
        # One write per buffer, at the index it was read: under torch.compile Inductor stores the state from the
        # kernel that refines the token (docs/decoding.md).
        for buffer, level in zip(state, levels):
            target = buffer[..., -1] if buffer.dim() == 4 else buffer
            target.copy_(level if valid is None else level * valid)
    elif valid is None:
        torch.stack(levels, dim=1, out=state)
    else:
        torch.mul(torch.stack(levels, dim=1), valid.unsqueeze(1), out=state)


def _levels(x, stored, scheme, alpha, beta):
    """The levels ``[u_0 = x, ..., u_S]`` (each ``[batch, 1, channels]``) of one token: the reference's causal step
    over the ``S`` stored values ``stored`` (``[batch, 1, channels]`` each); ``alpha``, ``beta``: tensors or floats."""
    if isinstance(alpha, torch.Tensor):
        alpha, beta = alpha.to(x.dtype), (beta.to(x.dtype) if isinstance(beta, torch.Tensor) else beta)
    coefficient = alpha + beta if scheme.advection else alpha
    reaction = scheme.torch_reaction
    # R = sign * b * f(u) with a number b: one fused add instead of a product and a sum (each op is host time here)
    factor = scheme.torch_reaction_factor if isinstance(beta, float) else None
    u, velocity, levels = x, None, [x]
    for value in stored:
        if scheme.wave:
            pull = value - u
            velocity = coefficient * pull if velocity is None else (1.0 - WAVE_DAMPING) * velocity + coefficient * pull
            u = u + velocity
        elif factor is not None:
            u = torch.lerp(u, value, coefficient).add_(factor[1](u), alpha=factor[0] * beta)
        elif reaction is not None:
            u = torch.lerp(u, value, coefficient) + reaction(u, beta)
        else:
            u = torch.lerp(u, value, coefficient)  # u + c * (value - u): one op
        levels.append(u)
    return levels
