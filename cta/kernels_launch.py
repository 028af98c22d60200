# coding=utf-8
"""Launches of the Triton PDE kernels (no autograd): the streaming forward (every scheme), the backward (streaming
for the linear schemes, the tile kernel for the others) and the one-token decode step. Inputs are ``[batch, seq,
channels]`` with contiguous channels and any batch / sequence strides; offsets are 64-bit."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .kernels_config import (FINISH_MAX_ELEMENTS, FIR_POINTER_STEPS, MAX_FUSED_STEPS, cdiv, coef_grad_groups,
                             next_pow2, static_rows, stream_plan, tile_config, StreamKernelSpec, walls_mode)
from .kernels_jit import (DirectLaunch, current_stream, _pde_bwd_kernel, _pde_decode_kernel, _sum_rows_kernel,
                          reaction_functions)
from .kernels_source import stream_args, stream_kernel
from .pde_spec import SCHEMES

SUM_ROWS_ELEMENTS = 2048  # fp32 partial sums per program and iteration of the coefficient gradient's finish
DECODE_WARPS = 4
FLOAT32_MAX = 3.4028234663852886e38


def _channels_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def is_per_channel(c: Optional[torch.Tensor], channels: int) -> bool:
    """Whether a coefficient has one value per channel (else it is a scalar, or absent)."""
    return c is not None and c.dim() == 1 and c.shape[0] == channels


def _coef_arg(c: Optional[torch.Tensor], like: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """(tensor, is_vector) of a coefficient as the streaming kernels read it (any float dtype). A scalar stays a
    scalar: its filter taps are computed once per program (5-13% faster at 8 steps than expanded per channel)."""
    if c is None:
        return like, False
    if is_per_channel(c, like.shape[-1]):
        return (c if c.stride(0) == 1 else c.contiguous()), True
    return c, False


def _fp32_coef(c: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A coefficient as the tile kernel reads it: fp32 ``[1]`` or ``[channels]`` (zeros when absent)."""
    if c is None:
        return torch.zeros(1, device=like.device, dtype=torch.float32)
    return c.detach().to(device=like.device, dtype=torch.float32).reshape(-1).contiguous()


def _mask_arg(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask if mask.is_contiguous() else mask.contiguous()


def _coef_grad_like(rows: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Coefficient ``c``'s gradient in its dtype and shape from fp32 partial sums ``rows`` ``[n, channels]``
    (contiguous), in one launch: summed over rows (per channel) or everything (scalar); no ``c``: a 0-d fp32 zero."""
    if c is None:
        return rows.new_zeros(())
    if not is_per_channel(c, rows.shape[-1]):
        rows = rows.reshape(-1, 1)
    n, channels = rows.shape
    out = torch.empty(c.shape, device=rows.device, dtype=c.dtype)
    launch, block, block_rows = _sum_rows_launch(n, channels)
    launch(rows, out, n, channels, block, block_rows)
    return out


def _coef_grad_output(c: Optional[torch.Tensor], like: torch.Tensor, channels: int) -> torch.Tensor:
    """The tensor the backward kernel stores coefficient ``c``'s gradient in: its dtype and shape (no ``c``: fp32
    per channel)."""
    if c is None:
        return like.new_empty((channels,), dtype=torch.float32)
    return torch.empty(c.shape, device=like.device, dtype=c.dtype)


@functools.lru_cache(maxsize=None)
def _sum_rows_launch(n: int, channels: int):
    block = min(max(next_pow2(channels), 16), SUM_ROWS_ELEMENTS)
    rows = min(SUM_ROWS_ELEMENTS // block, next_pow2(n))
    return DirectLaunch(_sum_rows_kernel, (cdiv(channels, block),), 4, (0, 1)), block, rows


@functools.lru_cache(maxsize=None)
def _scheme_constexprs(pde: str, bounds) -> tuple:
    """The fixed kernels' constexprs (WAVE, ADV, HAS_BETA, REACT(_DU, _DB), CLAMP, A_LO, A_HI, B_LO, B_HI)."""
    scheme = SCHEMES[pde]
    unbounded = (-FLOAT32_MAX, FLOAT32_MAX)
    (a_lo, a_hi), (b_lo, b_hi) = (bounds[0], bounds[1] or unbounded) if bounds is not None else (unbounded,) * 2
    return (scheme.wave, scheme.advection, scheme.uses_beta, *reaction_functions(scheme), bounds is not None,
            float(a_lo), float(a_hi), float(b_lo), float(b_hi))


# Eager calls are host-bound at small shapes: what a streaming launch derives from its inputs' metadata (configuration,
# generated kernel, grid, integer arguments) is cached per distinct metadata: a repeated call costs a dict lookup.


@functools.lru_cache(maxsize=4096)
def _forward_launch(pde, causal, steps, batch, seq, channels, sxb, sxl, dtype, on_gpu, a_vec, b_vec, has_mask,
                    has_init, write_final, bounds):
    """(launcher, integer arguments) of the streaming forward for one input's metadata."""
    per_channel = a_vec or b_vec
    filters = SCHEMES[pde].filters(causal) and not has_init
    t, block_c, warps, d, unroll, mma = stream_plan(seq, channels, dtype, on_gpu, "fwd", steps, causal, per_channel,
                                                    has_mask, filters)
    spec = StreamKernelSpec(
        "fwd", pde, causal, steps, d, has_mask=has_mask, a_vec=a_vec, b_vec=b_vec, has_init=has_init,
        write_final=write_final, even_c=channels % block_c == 0, fir_unroll=unroll, mma=mma,
        walls=walls_mode("fwd", seq, steps, causal, has_init, write_final, per_channel, mma > 0),
        pointers=("fwd", causal, per_channel) in FIR_POINTER_STEPS,
        static_rows=static_rows("fwd", causal, per_channel, unroll, mma), bounds=bounds)
    ints, consts = stream_args("fwd", spec.static_rows, t, block_c, L=seq, C=channels, sxb=sxb, sxl=sxl)
    return DirectLaunch(stream_kernel(spec), (cdiv(channels, block_c), cdiv(seq, t), batch), warps, range(7)), \
        ints + consts


@functools.lru_cache(maxsize=4096)
def _backward_launch(pde, causal, steps, batch, seq, channels, sxb, sxl, sgb, sgl, dtype, on_gpu, a_vec, b_vec,
                     has_mask, deterministic, bounds):
    """(launcher, integer arguments, ``_Workspace.get`` arguments, finish) of the streaming backward; ``finish``: it
    sums the coefficient gradient itself (``kernels_source._coef_grad_store``), else a second kernel does."""
    per_channel = a_vec or b_vec
    t, block_c, warps, d, unroll, mma = stream_plan(seq, channels, dtype, on_gpu, "bwd", steps, causal, per_channel,
                                                    has_mask, True)
    n_tiles = cdiv(seq, t)
    grid = (cdiv(channels, block_c), n_tiles, batch)
    # per channel: atomics into a few [channels] rows; deterministic: [tiles, channels] partial sums in fixed order
    atomic = per_channel and not deterministic
    groups = coef_grad_groups(channels, batch * n_tiles) if atomic else 1
    workspace = (groups if atomic else batch * n_tiles) * channels if per_channel else grid[0] * n_tiles * batch
    spec = StreamKernelSpec(
        "bwd", pde, causal, steps, d, has_mask=has_mask, a_vec=a_vec, b_vec=b_vec, even_c=channels % block_c == 0,
        fir_unroll=unroll, mma=mma, walls=walls_mode("bwd", seq, steps, causal, False, False, per_channel, mma > 0),
        coef_atomic=atomic, finish=batch * seq * channels <= FINISH_MAX_ELEMENTS,
        pointers=("bwd", causal, per_channel) in FIR_POINTER_STEPS,
        static_rows=static_rows("bwd", causal, per_channel, unroll, mma), bounds=bounds)
    ints, consts = stream_args("bwd", spec.static_rows, t, block_c, L=seq, C=channels, sxb=sxb, sxl=sxl, sgb=sgb,
                               sgl=sgl, n_tiles=n_tiles, n_groups=groups,
                               FIN_ROWS=max(1, SUM_ROWS_ELEMENTS // block_c))
    return DirectLaunch(stream_kernel(spec), grid, warps, range(10)), ints + consts, (workspace, grid[0], atomic), \
        spec.finish


class _Workspace:
    """The backward's fp32 partial sums and int32 counters per device and stream, left at zero by each launch's last
    program (``kernels_source._coef_grad_store``): a launch allocates and clears nothing. Under CUDA graph capture
    each launch gets its own (a cached one would outlive the graph's memory pool)."""

    buffers = {}

    @classmethod
    def get(cls, device, floats: int, counters: int, atomic: bool):
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        key = (device, current_stream(device), atomic)
        held = None if capturing else cls.buffers.get(key)
        if held is None or held[0].numel() < floats or held[1].numel() < counters:
            floats, counters = (max(floats, 1024), max(counters, 64)) if held is None else \
                (max(floats, held[0].numel()), max(counters, held[1].numel()))  # (grows, never shrinks)
            held = (torch.zeros(floats, device=device, dtype=torch.float32),
                    torch.zeros(counters, device=device, dtype=torch.int32))
            if not capturing:
                cls.buffers[key] = held
        return held


def launch_forward(x, alpha, beta, mask, init, pde: str, steps: int, causal: bool, want_final: bool, bounds=None):
    """(y, final state): ``steps`` fused steps (1..MAX_FUSED_STEPS) of ``pde`` on ``x``; the final state is
    ``[batch, steps, channels]`` fp32 for a causal ``want_final``, else None. ``bounds``: ``((alpha_min,
    alpha_max), (beta_min, beta_max) | None)`` the kernel clamps the coefficients into as it reads them, or None."""
    x = _channels_contiguous(x)
    y = x.new_empty(x.shape)
    fin = x.new_zeros((x.shape[0], steps, x.shape[2]), dtype=torch.float32) if causal and want_final else None
    if y.numel():
        launch, args = forward_arguments(x, y, alpha, beta, mask, init, fin, pde, steps, causal, bounds)
        launch(*args)
    return y, fin


def forward_arguments(x, y, alpha, beta, mask, init, fin, pde: str, steps: int, causal: bool, bounds):
    """(launcher, arguments) of :func:`launch_forward`'s streaming kernel writing ``y`` (and ``fin``), in the
    kernel's parameter order ``X, Y, M, A, Bc, INIT, FIN`` then its integers (``kernels_cpp`` replays them)."""
    batch, seq, channels = x.shape
    a, a_vec = _coef_arg(alpha, x)
    b, b_vec = _coef_arg(beta, x)
    m = _mask_arg(mask)
    launch, ints = _forward_launch(pde, causal, steps, batch, seq, channels, x.stride(0), x.stride(1), x.dtype,
                                   x.is_cuda, a_vec, b_vec, m is not None, init is not None and causal,
                                   fin is not None, bounds)
    ini = init.to(device=x.device, dtype=torch.float32).contiguous() if init is not None else x
    return launch, (x, y, m if m is not None else x, a, b, ini, fin if fin is not None else x, *ints)


def launch_backward(gy, x, alpha, beta, mask, init, pde: str, steps: int, causal: bool, need_db: bool = True,
                    bounds=None):
    """(dx, dalpha, dbeta), each coefficient's gradient in its dtype and shape (no beta: a 0-d fp32 zero, or None
    with ``need_db=False``); with ``bounds`` (:func:`launch_forward`) the clamped ones', passed straight through."""
    x, gy = _channels_contiguous(x), _channels_contiguous(gy)
    batch, seq, channels = x.shape
    dx = x.new_empty(x.shape)
    filters = SCHEMES[pde].filters(causal) and init is None
    if dx.numel() > 0 and steps > 0 and filters:
        scheme = SCHEMES[pde]
        launch, args, da, db, sums = streaming_backward_arguments(
            gy, x, dx, alpha, beta, mask, pde, steps, causal, bounds, torch.are_deterministic_algorithms_enabled())
        launch(*args)
        if sums is not None:
            da, db = _coef_grad_like(sums, alpha), (_coef_grad_like(sums, beta) if scheme.advection else None)
        if db is None and need_db:  # (a scheme without beta gives zeros)
            db = torch.zeros_like(beta) if beta is not None else x.new_zeros((), dtype=torch.float32)
        return dx, da, db
    hl, t, block_l, block_c, warps = tile_config(seq, channels, causal, steps, filters, x.device)
    n_tiles = cdiv(seq, t)
    da = torch.zeros((batch * n_tiles, channels), device=x.device, dtype=torch.float32)
    db = torch.zeros((batch * n_tiles, channels), device=x.device, dtype=torch.float32)
    if dx.numel() > 0:
        a, b = _fp32_coef(alpha, x), _fp32_coef(beta, x)
        m = mask.to(device=x.device, dtype=torch.float32).contiguous() if mask is not None else a
        ini = init.to(device=x.device, dtype=torch.float32).contiguous() if init is not None else a
        _pde_bwd_kernel[(n_tiles, cdiv(channels, block_c), batch)](
            gy, x, dx, m, a, b, ini, da, db, seq, channels, x.stride(0), x.stride(1), gy.stride(0), gy.stride(1),
            n_tiles, *_scheme_constexprs(pde, bounds), CAUSAL=bool(causal), STEPS=steps, HAS_MASK=mask is not None,
            A_VEC=a.numel() > 1, B_VEC=b.numel() > 1, HAS_INIT=init is not None, HL=hl, T=t, BLOCK_L=block_l,
            BLOCK_C=block_c, num_warps=warps,
        )
    return dx, _coef_grad_like(da, alpha), _coef_grad_like(db, beta)


def streaming_backward_arguments(gy, x, dx, alpha, beta, mask, pde: str, steps: int, causal: bool, bounds,
                                 deterministic: bool):
    """``(launcher, arguments, da, db, sums)`` of the streaming backward writing ``dx``, in the kernel's parameter
    order ``GY, X, DX, M, A, Bc, DA, DB, WS, CNT`` then its integers (``kernels_cpp`` replays them). Where it
    finishes the coefficient gradients itself they land in ``da`` / ``db`` (their coefficients' dtype and shape);
    ``sums`` ``[n, channels or 1]``: the fp32 partial sums still to finish (``_coef_grad_like``), else None."""
    batch, seq, channels = x.shape
    scheme = SCHEMES[pde]
    a, a_vec = _coef_arg(alpha, x)
    b, b_vec = _coef_arg(beta, x) if scheme.uses_beta else (x, False)
    m = _mask_arg(mask)
    m = m if m is not None else x
    launch, ints, workspace, finish = _backward_launch(
        pde, causal, steps, batch, seq, channels, x.stride(0), x.stride(1), gy.stride(0), gy.stride(1), x.dtype,
        x.is_cuda, a_vec, b_vec, m is not x, deterministic, bounds)
    if not finish:  # the partial sums in a buffer of this call's, summed by a second kernel (gy: never written)
        sums = (torch.zeros if workspace[2] else torch.empty)(workspace[0], device=x.device, dtype=torch.float32)
        return launch, (gy, x, dx, m, a, b, gy, gy, sums, gy, *ints), None, None, \
            sums.view(-1, channels if a_vec or b_vec else 1)
    partials, counters = _Workspace.get(x.device, *workspace)
    # causal advection's scalar and per-channel coefficients together: per-channel sums in da, finished after
    mixed = scheme.advection and a_vec != b_vec
    da = _coef_grad_output(None if mixed else alpha, x, channels)
    db = _coef_grad_output(None if mixed else beta, x, channels) if scheme.advection else None
    # (gy in DB's place: never written, and the interpreter copies aliased arguments back)
    args = (gy, x, dx, m, a, b, da, db if db is not None else gy, partials, counters, *ints)
    return launch, args, da, db, (da.view(1, -1) if mixed else None)


def _token_mask_arg(token_mask: Optional[torch.Tensor], x: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """(tensor, stride between sequences) of a decode step's token mask (one entry per sequence, in its own dtype)."""
    if token_mask is None:
        return x, 0
    tm = token_mask if token_mask.device == x.device else token_mask.to(x.device)
    if tm.dtype == torch.bool:
        tm = tm.view(torch.uint8)
    if tm.dim() == 0:
        return tm, 0
    if tm.shape[0] != x.shape[0]:  # e.g. [1, batch]
        tm = tm.reshape(-1)
    return tm, tm.stride(0)


@functools.lru_cache(maxsize=1024)
def _decode_launch(pde, steps, batch, channels, has_mask, a_vec, b_vec, bounds):
    """(launcher, constexpr arguments) of the decode kernel."""
    block_c = min(next_pow2(channels), 1024)
    scheme = _scheme_constexprs(pde, bounds)  # (the reaction's derivatives are the backward's)
    consts = (*scheme[:4], *scheme[6:], steps, has_mask, a_vec, b_vec, block_c)
    return _pde_decode_kernel[(cdiv(channels, block_c), batch)], consts


def launch_decode(x, levels, alpha, beta, token_mask, pde: str, steps: int, bounds=None) -> torch.Tensor:
    """Refines one new token ``x`` ``[batch, (1,) channels]`` and updates the state in place: ``levels``, its
    ``steps`` fp32 buffers ``[batch, (1,) channels(, 1)]`` with contiguous channels and one stride between sequences.
    ``token_mask``: one entry per sequence, any dtype and shape. ``bounds``: as :func:`launch_forward`'s."""
    x = _channels_contiguous(x)
    y = x.new_empty(x.shape)
    if y.numel() == 0:
        return y
    if len(levels) != steps or steps > MAX_FUSED_STEPS:
        raise ValueError(f"The decode kernel takes one state buffer per step (1..{MAX_FUSED_STEPS}); got {len(levels)} "
                         f"for {steps} steps.")
    level_stride = levels[0].stride(0)
    if any(level.stride(-1) != 1 or level.stride(0) != level_stride for level in levels):
        raise ValueError("The state buffers must have contiguous channels (stride 1 along their last dimension) and "
                         "one stride between sequences.")
    device = x.device
    a, a_vec = _coef_arg(alpha if alpha.device == device else alpha.to(device), x)
    b, b_vec = _coef_arg(beta if beta is None or beta.device == device else beta.to(device), x)
    tm, tm_stride = _token_mask_arg(token_mask, x)
    channels = x.shape[-1]
    launch, consts = _decode_launch(pde, steps, x.shape[0], channels, token_mask is not None, a_vec, b_vec, bounds)
    pointers = (*levels, *(None,) * (MAX_FUSED_STEPS - steps))  # (None: compile-time constants, no launch cost)
    launch(x, y, tm, a, b, channels, x.stride(0), level_stride, tm_stride, *pointers, *consts,
           num_warps=DECODE_WARPS)
    return y
