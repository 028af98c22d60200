# coding=utf-8
"""The causal constant-coefficient schemes (diffusion, advection-diffusion: ``PDEScheme.filters``) as fixed filters:
the CPU path of ``pde_refine`` where no gradient is asked, in a few large ops instead of several per step
(on the CPU every op costs a served token microseconds of host time).

``S`` steps of ``u[i] += c (u[i-1] - u[i])`` (``c = a``, or ``a + b`` with advection) are one banded filter: level
``s`` at position ``i`` is ``sum_k C(s, k) c^k (1 - c)^(s-k) x[i-k]``. The zero-inflow wall at the start is zero
padding. A stored initial state (entry ``s``: level ``s`` at the position before the first) reaches level ``s' > s`` only
at positions ``< s' - s``, so it changes the first ``S`` positions alone: those are the reference's, computed on them.
Where the CPU kernel builds (``kernels_cpu``), the filter and the final state are one C++ pass over the tokens with the
same arithmetic as the torch ops (``CTA_CPU_KERNEL=0``: the torch ops).
"""

from __future__ import annotations

from functools import lru_cache
from math import comb

import torch

from .kernels_cpu import kernel as cpu_kernel
from .pde_reference import reference_refine
from .pde_spec import written_into


@lru_cache(maxsize=256)  # (a pure function of the coefficient's value: served coefficients keep theirs)
def _level_taps(c: float, steps: int) -> tuple:
    """``taps[s][k]``: the weight of ``x[i-k]`` in level ``s`` at position ``i`` (``s = 0 .. steps``)."""
    return tuple(tuple(comb(s, k) * c ** k * (1.0 - c) ** (s - k) for k in range(s + 1)) for s in range(steps + 1))


@lru_cache(maxsize=256)
def _final_state_map(c: float, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """``[steps, steps + 1]``: levels ``0 .. steps-1`` at the last position from the last ``steps + 1`` inputs."""
    taps = _level_taps(c, steps)
    rows = [[taps[s][steps - j] if steps - j <= s else 0.0 for j in range(steps + 1)] for s in range(steps)]
    return torch.tensor(rows, dtype=dtype)


def filtered_refine(hidden_states: torch.Tensor, c: float, *, pde_type: str, steps: int, alpha, beta,
                    initial_state, return_final_state: bool, out=None):
    """:func:`pde_reference.pde_refine_reference` of a causal filter scheme with the scalar effective coefficient
    ``c`` (the arguments checked, no attention mask); ``alpha`` / ``beta`` are passed on to the reference for the
    positions an initial state reaches. ``out``: where given (checked), the refined tokens are written there."""
    batch, length, channels = hidden_states.shape
    if length <= steps:  # (every position within reach of the initial state: the reference, on a few tokens)
        refined = reference_refine(hidden_states, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, causal=True,
                                   attention_mask=None, initial_state=initial_state,
                                   return_final_state=return_final_state)
        return written_into(refined, out)
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    u = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)
    kernel = cpu_kernel() if u.is_cpu else None
    if kernel is not None:  # (one pass over the tokens, the same arithmetic as the ops below)
        direct = out if out is not None and out.dtype == dtype and out.is_contiguous() else None
        out_u, final_state = kernel.causal_filter(u, _level_taps(c, steps), return_final_state, direct)
    else:
        taps = _level_taps(c, steps)[steps]
        out_u = u * taps[0]
        for k in range(1, steps + 1):
            out_u[:, k:].add_(u[:, :-k], alpha=taps[k])
        final_state = torch.matmul(_final_state_map(c, steps, dtype), u[:, length - steps - 1:]) \
            if return_final_state else None
    if initial_state is not None:
        out_u[:, :steps] = reference_refine(u[:, :steps], pde_type=pde_type, steps=steps, alpha=alpha, beta=beta,
                                            causal=True, attention_mask=None, initial_state=initial_state,
                                            return_final_state=False)
    refined = out_u if out_u.dtype == hidden_states.dtype else out_u.to(hidden_states.dtype)
    return written_into((refined, final_state) if return_final_state else refined, out)
