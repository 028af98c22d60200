# coding=utf-8
"""Launches of the Triton PDE kernels (no autograd): the forward, the backward and the one-token decode step.

``launch_forward`` runs the streaming forward for every scheme; ``launch_backward`` the streaming backward for the
linear schemes and the tile backward (``kernels_jit._pde_bwd_kernel``) for the others; ``launch_decode`` the decode
kernel. Inputs are ``[batch, seq, channels]`` with contiguous channels (anything else is made contiguous once) and
any batch / sequence strides; offsets are 64-bit.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .kernels_config import (
    FIR_POINTER_STEPS,
    cdiv,
    coef_grad_groups,
    is_linear,
    next_pow2,
    static_rows,
    stream_plan,
    tile_config,
    walls_mode,
)
from .kernels_jit import _pde_bwd_kernel, _pde_decode_kernel, _sum_rows_kernel
from .kernels_source import stream_args, stream_kernel
from .pde_spec import PDE_IDS

SUM_ROWS_BLOCK = 512  # channels per program of the coefficient gradient's row sum
DECODE_WARPS = 4


def _channels_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def is_per_channel(c: Optional[torch.Tensor], channels: int) -> bool:
    """Whether a coefficient has one value per channel (else it is a scalar, or absent)."""
    return c is not None and c.dim() == 1 and c.shape[0] == channels


def _coef_arg(c: Optional[torch.Tensor], like: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """A coefficient as the streaming kernels read it (any float dtype, converted in the kernel): (tensor,
    is_vector). A scalar stays a scalar: the filter taps are then computed once per program, not once per channel
    (5-13% faster at 8 steps than a scalar expanded per channel)."""
    if c is None:
        return like, False
    if is_per_channel(c, like.shape[-1]):
        return (c if c.stride(0) == 1 else c.contiguous()), True
    return c.reshape(1), False


def _fp32_coef(c: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A coefficient as the tile and decode kernels read it: fp32 ``[1]`` or ``[channels]`` (zeros when absent)."""
    if c is None:
        return torch.zeros(1, device=like.device, dtype=torch.float32)
    return c.detach().to(device=like.device, dtype=torch.float32).reshape(-1).contiguous()


def _mask_arg(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask if mask.is_contiguous() else mask.contiguous()


def coef_grad_shape(c: Optional[torch.Tensor], channels: int) -> Tuple[int]:
    """Shape of a coefficient's gradient as the backward returns it: [channels] for a per-channel coefficient, [1]
    for a scalar or an absent one."""
    return (channels,) if is_per_channel(c, channels) else (1,)


def _fit_coef_grad(g: torch.Tensor, c: Optional[torch.Tensor], channels: int) -> torch.Tensor:
    """``g`` (per channel or one value) summed as far as ``c``'s gradient shape."""
    return g if g.shape == coef_grad_shape(c, channels) else g.sum().reshape(1)


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows.sum(0)`` of a contiguous fp32 ``[n, channels]``."""
    n, channels = rows.shape
    out = torch.empty(channels, device=rows.device, dtype=torch.float32)
    _sum_rows_kernel[(cdiv(channels, SUM_ROWS_BLOCK),)](rows, out, n, channels, SUM_ROWS_BLOCK, num_warps=4)
    return out


def _stream_forward(x, y, fin, alpha, beta, mask, init, pde, steps, causal, want_final):
    batch, seq, channels = x.shape
    a, a_vec = _coef_arg(alpha, x)
    b, b_vec = _coef_arg(beta, x)
    m = _mask_arg(mask)
    per_channel = a_vec or b_vec
    has_init = init is not None and bool(causal)
    t, block_c, warps, d, unroll, mma = stream_plan(x, "fwd", steps, causal, per_channel, m is not None,
                                                    is_linear(pde, causal, init is not None))
    ini = init.to(device=x.device, dtype=torch.float32).contiguous() if init is not None else x
    write_final = bool(causal and want_final)
    static = static_rows("fwd", causal, per_channel, unroll, mma)
    kernel = stream_kernel((
        "fwd", pde, bool(causal), steps, d, m is not None, a_vec, b_vec, has_init, write_final,
        channels % block_c == 0, unroll, mma,
        walls_mode("fwd", seq, steps, causal, has_init, write_final, per_channel, mma > 0), False,
        ("fwd", bool(causal), per_channel) in FIR_POINTER_STEPS, static,
    ))
    ints, consts = stream_args("fwd", static, t, block_c, L=seq, C=channels, sxb=x.stride(0), sxl=x.stride(1))
    grid = (cdiv(channels, block_c), cdiv(seq, t), batch)
    kernel[grid](x, y, m if m is not None else x, a, b, ini, fin if write_final else x, *ints, *consts,
                 num_warps=warps)


def _stream_backward(gy, x, dx, alpha, beta, mask, pde, steps, causal):
    """Runs the streaming backward; returns the gradient of the kernel's coefficient summed to [channels] when it is
    per channel, to [1] when it is a scalar (each program then writes one partial sum, not one per channel)."""
    batch, seq, channels = x.shape
    a, a_vec = _coef_arg(alpha, x)
    b, b_vec = _coef_arg(beta, x)
    m = _mask_arg(mask)
    per_channel = a_vec or b_vec
    t, block_c, warps, d, unroll, mma = stream_plan(x, "bwd", steps, causal, per_channel, m is not None, True)
    n_tiles = cdiv(seq, t)
    static = static_rows("bwd", causal, per_channel, unroll, mma)
    # per channel: atomics into a few [channels] rows; deterministic: [tiles, channels] partial sums in fixed order
    atomic = per_channel and not torch.are_deterministic_algorithms_enabled()
    groups = coef_grad_groups(channels, batch * n_tiles) if atomic else 1
    if atomic:
        da = torch.zeros((groups, channels), device=x.device, dtype=torch.float32)
    else:
        partial = channels if per_channel else cdiv(channels, block_c)
        da = torch.empty((batch * n_tiles, partial), device=x.device, dtype=torch.float32)
    kernel = stream_kernel((
        "bwd", pde, bool(causal), steps, d, m is not None, a_vec, b_vec, False, False, channels % block_c == 0,
        unroll, mma, walls_mode("bwd", seq, steps, causal, False, False, per_channel, mma > 0), atomic,
        ("bwd", bool(causal), per_channel) in FIR_POINTER_STEPS, static,
    ))
    ints, consts = stream_args("bwd", static, t, block_c, L=seq, C=channels, sxb=x.stride(0), sxl=x.stride(1),
                               sgb=gy.stride(0), sgl=gy.stride(1), n_tiles=n_tiles, n_groups=groups)
    grid = (cdiv(channels, block_c), n_tiles, batch)
    kernel[grid](gy, x, dx, m if m is not None else x, a, b, da, *ints, *consts, num_warps=warps)
    if atomic:
        return da[0] if groups == 1 else _sum_rows(da)
    return da.sum(0) if per_channel else da.sum().reshape(1)


def launch_forward(x, alpha, beta, mask, init, pde: str, steps: int, causal: bool, want_final: bool):
    """(y, final state): ``steps`` fused steps (1..MAX_FUSED_STEPS) of ``pde`` on ``x``; the final state is
    ``[batch, steps, channels]`` fp32 for a causal ``want_final``, else empty."""
    x = _channels_contiguous(x)
    batch, seq, channels = x.shape
    y = torch.empty((batch, seq, channels), device=x.device, dtype=x.dtype)
    if causal and want_final:
        fin = x.new_zeros((batch, steps, channels), dtype=torch.float32)
    else:  # nothing to fill: an empty tensor costs no fill launch
        fin = x.new_empty((batch, 0, channels), dtype=torch.float32)
    if y.numel():
        _stream_forward(x, y, fin, alpha, beta, mask, init, pde, steps, causal, want_final)
    return y, fin


def launch_backward(gy, x, alpha, beta, mask, init, pde: str, steps: int, causal: bool, need_db: bool = True):
    """(dx, dalpha summed to ``coef_grad_shape(alpha)``, dbeta likewise). ``need_db=False`` (eager autograd without
    a ``beta``) returns None for dbeta of the streaming backward instead of a tensor of zeros."""
    x = _channels_contiguous(x)
    gy = _channels_contiguous(gy)
    batch, seq, channels = x.shape
    dx = torch.empty((batch, seq, channels), device=x.device, dtype=x.dtype)
    linear = is_linear(pde, causal, init is not None)
    if dx.numel() > 0 and steps > 0 and linear:
        dc = _stream_backward(gy, x, dx, alpha, beta, mask, pde, steps, causal)
        da = _fit_coef_grad(dc, alpha, channels)
        if pde == "advection_diffusion":  # causal advection-diffusion is diffusion with a + b: d/db = d/da
            db = _fit_coef_grad(dc, beta, channels)
            return dx, da, (db.clone() if db is da else db)  # (a custom op may not return one tensor twice)
        if not need_db:
            return dx, da, None
        return dx, da, torch.zeros(coef_grad_shape(beta, channels), device=x.device, dtype=torch.float32)
    hl, t, block_l, block_c, warps = tile_config(seq, channels, causal, steps, linear, x.device)
    n_tiles = cdiv(seq, t)
    da = torch.zeros((batch * n_tiles, channels), device=x.device, dtype=torch.float32)
    db = torch.zeros((batch * n_tiles, channels), device=x.device, dtype=torch.float32)
    if dx.numel() > 0:
        a, b = _fp32_coef(alpha, x), _fp32_coef(beta, x)
        m = mask.to(device=x.device, dtype=torch.float32).contiguous() if mask is not None else a
        ini = init.to(device=x.device, dtype=torch.float32).contiguous() if init is not None else a
        grid = (n_tiles, cdiv(channels, block_c), batch)
        _pde_bwd_kernel[grid](
            gy, x, dx, m, a, b, ini, da, db,
            seq, channels, x.stride(0), x.stride(1), gy.stride(0), gy.stride(1), n_tiles,
            PDE=PDE_IDS[pde], CAUSAL=bool(causal), STEPS=steps,
            HAS_MASK=mask is not None, A_VEC=a.numel() > 1, B_VEC=b.numel() > 1,
            HAS_INIT=init is not None, LINEAR=linear,
            HL=hl, T=t, BLOCK_L=block_l, BLOCK_C=block_c, num_warps=warps,
        )
    da = da.sum(0)
    db = db.sum(0)
    if pde == "advection_diffusion" and causal and linear:
        db = da.clone()
    return dx, _fit_coef_grad(da, alpha, channels), _fit_coef_grad(db, beta, channels)


def launch_decode(x, state, alpha, beta, token_mask, pde: str, steps: int) -> torch.Tensor:
    """One new token ``x`` ``[batch, channels]``: returns the refined token and updates ``state`` (fp32
    ``[batch, steps, channels]``, contiguous channels) in place."""
    x = _channels_contiguous(x)
    y = torch.empty((x.shape[0], x.shape[-1]), device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    if state.stride(-1) != 1:
        raise ValueError("`state` must have contiguous channels (stride 1 along its last dimension).")
    a = _fp32_coef(alpha, x)
    b = _fp32_coef(beta, x) if beta is not None else a  # (never read for diffusion / wave)
    tm = token_mask.reshape(-1).to(device=x.device, dtype=torch.float32).contiguous() if token_mask is not None else x
    channels = x.shape[-1]
    block_c = min(next_pow2(channels), 1024)
    _pde_decode_kernel[(cdiv(channels, block_c), x.shape[0])](
        x, y, state, tm, a, b, channels, x.stride(0), state.stride(0), state.stride(1),
        PDE_IDS[pde], steps, token_mask is not None, a.numel() > 1, beta is not None and b.numel() > 1, block_c,
        num_warps=DECODE_WARPS,
    )
    return y
