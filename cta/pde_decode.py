# coding=utf-8
"""One decoded token of the causal PDE as a state update in plain torch ops (causal-conv1d's ``update`` beside its
``fn``): the path of every device but CUDA eager (the fused Triton decode kernel), and of ``torch.compile``, where
Inductor fuses these ops with the residual add and norm around them.

The state is ``[batch, steps, channels]`` fp32: entry ``s`` is the step-``s`` iterate at the previous position
(:func:`pde_reference.pde_refine_reference`'s final state). For a new token ``x`` the levels ``u_0 = x, ..., u_S``
are computed either by the scheme's causal recurrence (``S`` pointwise steps on ``[batch, 1, channels]``, each level
written back to its own buffer where it was read: under ``torch.compile`` Inductor fuses the whole site, state writes
included, into the kernel of the following norm), or, for the linear schemes, as a fixed linear map of the token and
the ``S`` stored values (:func:`causal_decode_map`, from the coefficients alone): the CPU keeps it while a site's
scalar coefficients keep their values, one concatenation and one small matrix product per token.

The refined token is ``u_S``, the new state ``u_0 .. u_{S-1}``. A padded token (``token_mask`` 0) is returned
unchanged and leaves zeros (a wall) as the state, as the sequence operator does.
"""

from __future__ import annotations

from typing import Optional

import torch

from .pde_spec import WAVE_DAMPING, scheme_of


def causal_decode_map(pde_type: str, steps: int, alpha: torch.Tensor, beta: Optional[torch.Tensor],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The linear map ``[S+1 levels, S+1 inputs, C']`` of a linear causal scheme over the inputs ``(x, state_0 ..
    state_{S-1})`` (``C'`` 1 for scalar coefficients, else ``channels``; in ``dtype``): the scheme's recurrence run
    on that basis, ``S`` tiny steps on ``[S+1, C']`` tensors whatever the batch."""
    to_row = lambda c: None if c is None else c.to(dtype).reshape(1, -1)  # noqa: E731  ([1, C'])
    alpha, beta = to_row(alpha), to_row(beta)
    width = max(alpha.shape[1], 1 if beta is None else beta.shape[1])
    basis = torch.eye(steps + 1, device=alpha.device, dtype=dtype).unsqueeze(-1)  # [S+1, S+1, 1]
    token = basis[0].expand(steps + 1, width)  # the token's own level: u_0 = x
    return torch.stack(_levels(token, basis[1:], scheme_of(pde_type), alpha, beta))


def pde_decode_update(hidden_states: torch.Tensor, state, *, pde_type: str, steps: int, alpha: torch.Tensor,
                      beta: Optional[torch.Tensor] = None, token_mask: Optional[torch.Tensor] = None,
                      decode_map: Optional[torch.Tensor] = None, block: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Refines one token (``[batch, channels]`` or ``[batch, 1, channels]``) and updates the state in place; returns
    the refined token in the input's shape and dtype. ``state``: ``[batch, steps, channels]``, or its ``steps``
    level buffers ``[batch, 1, channels]`` or the ``[batch, 1, channels, positions]`` conv states holding them at
    their last position (``pde_cache``); fp32 (fp64 for float64 models), the dtype it computes in.

    ``pde_type`` normalised, ``alpha`` / ``beta`` inside their bounds (tensors or floats); ``token_mask``: one entry
    per sequence (0: padding). ``decode_map``: the scheme's :func:`causal_decode_map` of these coefficients when the
    caller keeps it (``[S+1, S+1]`` for scalar ones), else the recurrence runs. ``block``: the ``[batch, steps,
    channels, 1]`` tensor whose rows are the level buffers ``state`` (``[batch, 1, channels, 1]`` each; the CPU cache's
    layout), read as they are and written by one op. Arguments are not checked here (:func:`pde_cta.pde_decode_step`
    checks them)."""
    # (Each op skipped where it would not change anything: on the CPU every call is host time of a decoded token.)
    whole = torch.is_tensor(state)
    dtype = state.dtype if whole else state[0].dtype
    x = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)  # fp32 (fp64 models)
    if x.dim() == 2:
        x = x.unsqueeze(1)  # [batch, 1, channels]: broadcasts against the levels
    valid = None if token_mask is None else token_mask.reshape(-1, 1, 1).to(dtype)
    scheme = scheme_of(pde_type)
    if decode_map is not None and scheme.linear:  # the caller's map (the CPU's, for scalar coefficients)
        refined = _mapped_update(x, state, decode_map, steps, valid, block)
    else:
        # the scheme's recurrence on the token, pointwise on [batch, 1, channels] (the stored values read as views)
        if block is not None:  # (the buffers as they are, the token as one of them: no view per level)
            x, stored = x.unsqueeze(-1), state
            valid = None if valid is None else valid.unsqueeze(-1)
            # per-channel coefficients [channels] along the channels, now the buffers' dim 2
            alpha, beta = (c.unsqueeze(-1) if torch.is_tensor(c) and c.dim() else c for c in (alpha, beta))
        else:
            stored = state.unsqueeze(2).unbind(1) if whole else _stored_levels(state)  # ([batch, 1, channels] views)
        levels = _levels(x, stored, scheme, alpha, beta)
        refined = levels[steps]
        _write_state(state if whole else stored if block is None else block, levels[:steps], valid)
    if valid is not None:
        refined = torch.lerp(x, refined, valid)  # exactly x where valid is 0 and refined where it is 1: one op
    return _as_input(refined, hidden_states)


def _mapped_update(x, state, decode_map, steps, valid, block=None):
    """The refined token ``[batch, 1, channels]`` through the linear map, ``state`` (or the ``block`` of its buffers)
    written in place. On the CPU each op costs a decoded token 5-15 µs between the model's matrix products (a cold
    cache): one concatenation, one matrix product, one write (one per level without a block), and views."""
    batch, _, channels = x.shape
    rows = steps + 1
    if torch.is_tensor(state):
        inputs = torch.cat([x, state], dim=1)  # [batch, S+1, channels]
    elif state[0].dim() == 4 and state[0].shape[-1] == 1:  # the cache's conv states [batch, 1, channels, 1]
        inputs = torch.cat([x.view(batch, 1, channels, 1), *state], dim=1)  # (as they are: no view per level)
    else:
        state = _stored_levels(state)
        inputs = torch.cat([x, *state], dim=1)
    if decode_map.dim() == 2 and batch == 1:  # (a plain matrix product: a fraction of the batched one's host time)
        levels = torch.mm(decode_map, inputs.view(rows, channels)).view(inputs.shape)
    elif decode_map.dim() == 2:
        levels = torch.matmul(decode_map, inputs.view(batch, rows, channels)).view(inputs.shape)
    else:  # per channel: [S+1, S+1, channels]
        levels = (decode_map * inputs.view(batch, 1, rows, channels)).sum(2).view(inputs.shape)
    if valid is not None:
        valid = valid.view(batch, *(1,) * (levels.dim() - 1))
    if torch.is_tensor(state) or block is not None:
        written = levels.narrow(1, 0, steps)
        (state if block is None else block).copy_(written if valid is None else written * valid)
        return levels.narrow(1, steps, 1).view(batch, 1, channels)
    parts = levels.unsqueeze(2).unbind(1)  # each in its buffer's shape (Tensor.split: a Python wrapper)
    for buffer, part in zip(state, parts):
        buffer.copy_(part if valid is None else part * valid)
    return parts[steps].view(batch, 1, channels)


def _stored_levels(state) -> list:
    """The ``[batch, 1, channels]`` views of a state's level buffers (a conv state's last position)."""
    return [level[..., -1] if level.dim() == 4 else level for level in state]


def _write_state(state, levels, valid):
    """The state (a ``[batch, S, channels]`` tensor or its ``S`` level buffers) := the levels ``u_0 .. u_{S-1}``
    (zeros for padded sequences)."""
    if not levels:
        return
    if not torch.is_tensor(state):
        # One [batch, 1, channels] write per buffer, at the index it was read: under torch.compile Inductor stores
        # the state from the kernel that refines the token (docs/decoding.md).
        for buffer, level in zip(state, levels):
            buffer.copy_(level if valid is None else level * valid)
    elif valid is None:
        torch.cat(levels, dim=1, out=state)
    else:
        torch.mul(torch.cat(levels, dim=1), valid, out=state)


def _as_input(refined, hidden_states):
    """``refined`` ``[batch, 1, channels]`` in the shape and dtype of the token it refines."""
    if refined.dim() != hidden_states.dim():
        refined = refined.reshape(hidden_states.shape)
    return refined if refined.dtype == hidden_states.dtype else refined.to(hidden_states.dtype)


def _levels(x, stored, scheme, alpha, beta):
    """The levels ``[u_0 = x, ..., u_S]`` (each ``[batch, 1, channels]``) of one token: the reference's causal step
    over the ``S`` stored values ``stored`` (``[batch, 1, channels]`` each); ``alpha``, ``beta``: tensors or floats."""
    if torch.is_tensor(alpha):
        alpha, beta = alpha.to(x.dtype), (beta.to(x.dtype) if torch.is_tensor(beta) else beta)
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
