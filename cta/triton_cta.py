# coding=utf-8
"""Triton kernels for the CTA PDE operator (the CUDA path of :func:`pde_cta.pde_refine`).

Optional: this module imports without triton (``is_available()`` is then False). It is loaded as a flat sibling
module by transformers' remote-code loader, so it imports only ``.pde_cta`` besides torch and triton.

Design
------
* Layout ``[batch, seq, channels]``: strided batch/seq, contiguous channels (anything else is made contiguous once),
  64-bit offsets.
* Forward (every scheme): *streaming* kernels. A program owns ``BLOCK_C`` channels x ``T`` positions and walks along
  the sequence one row at a time; each pseudo-time level keeps the two or three row vectors its stencil still needs in
  registers, so level ``s`` advances as soon as level ``s - 1`` has produced its right neighbour (a wavefront through
  (row, level) space, ``S`` rows of lag for bidirectional stencils, none for causal ones). Each input row is read
  once (plus ``S`` warm-up rows per side and program), each output row written once, row loads are prefetched a few
  rows ahead, and threads never exchange data (each owns its channels for the whole walk) -- the neighbour exchange
  of a tile-in-registers design (``tl.gather`` per step) is gone. The operations are the reference's, in the same
  order (flux form, the same walls at sequence ends and padding), so fp32 results match it to rounding (bit for bit
  in the interpreter). The kernel source is generated per (scheme, steps, options), because the number of register
  vectors carried from row to row depends on the step count (``_stream_source``).
* These kernels are bound by instruction issue and latency more than by memory (Nsight Compute on an H200, 2
  bidirectional steps: ~85% SM issue, ~56% of DRAM bandwidth). Programs whose rows all lie inside the sequence (no
  padding mask, whole channel blocks: most programs of a long input) run a second copy of the loop without masks
  and validity factors (the same values). Rewriting the diffusion update with one instruction less per level
  (``u + a (d - d_left)``) was measured too and gained nothing, so the flux form stays.
* Interior programs of the linear schemes (the common training case) do not walk at all: away from walls, ``S``
  levels of a constant-coefficient stencil are one banded filter (the stencil's ``S``-th power, ``2S+1`` or ``S+1``
  taps per channel, computed per program; one set of scalar taps for a scalar coefficient), applied to a window of
  rows kept in registers: one multiply-add per tap instead of about six instructions per level. Its backward
  filters ``g`` only (``S - 1`` transposed levels, then the last level and the stencil's derivative), with the
  coefficient gradient split per row exactly as the walk splits it (so per-program partial sums add up). The
  results equal the walk's to fp32 rounding, not bit for bit (``_fir_interior``; ``CTA_FIR=0`` turns it off).
  Programs at the sequence ends filter too, reading the walls as an extension of the input (the even reflection
  for the zero-flux bidirectional walls, zeros for the causal ones: exact for these stencils, ``_wall_load``); the
  walk is left for padding masks, partial channel blocks, short sequences, causal states and some per-channel
  kernels above 4 steps (``_walls_mode``).
* With a scalar coefficient (the models' default) the filter is one matrix for all channels, so for bf16/fp16
  inputs the filtering programs run it on tensor cores (``_mma_interior``): 16-row tiles, each the product of two
  [16, 16] pieces of the banded matrix (split into two 16-bit parts, fp32 accumulation) with the input blocks
  around it. The forward is then ~1.1x copy from 3 steps on; the backward is used from 7 bidirectional steps
  (``MMA_MIN_STEPS``; ``CTA_MMA=0`` turns it off).
* Backward of the linear schemes (diffusion both ways, causal advection-diffusion = diffusion with ``a + b``), the
  training case: one streaming pass. Bidirectional: the step matrix ``M = I + a L`` is symmetric (walls included),
  so ``dx = M^S g`` is the forward walk applied to ``g``. Causal: ``dx`` is the anti-causal adjoint walk over ``g``.
  ``M`` is a polynomial in ``L``, so the two commute and ``dL/da = S <g, L M^(S-1) x> = S <L^T (M^T)^(S-1) g, x>``:
  the walk over ``g`` yields the factor at its last level (a flux difference), paired with ``x`` read at the output
  row only -- no walk over ``x``, and the causal backward walks no rows behind its tile. The coefficient gradient
  is summed per program in registers, then added with atomics into a few ``[channels]`` rows for a per-channel
  coefficient (``COEF_GRAD_ATOMIC``; ``[tiles, channels]`` partial sums under deterministic algorithms), or
  written as one value per program for a scalar one (the op then returns it as ``[1]``). Reads ``g`` and ``x``
  once, writes ``dx`` once; nothing but the input is saved by the forward.
* Backward of the other schemes (wave, reaction, bidirectional advection, any causal scheme with an
  ``initial_state``): the tile kernel. Each program loads ``x`` and ``grad`` with a halo that covers the forward
  trajectory the adjoint needs (``2*steps`` per side for bidirectional, ``steps`` left and ``steps`` right for causal),
  recomputes ``u_s`` from the input tile for each adjoint step (``steps*(steps-1)/2`` extra stencil applications, all
  on chip) and takes neighbours with ``tl.gather``. The tile forward kernel is kept too.
* Row validity (sequence ends, padding) is recomputed from the row index in every iteration, never carried from
  one iteration to the next: a chain of loop-carried validity scalars gave wrong results on an H200 (triton 3.6)
  while exact in the interpreter. ``STREAM_LAGGED_ON_CUDA`` (env ``CTA_STREAM_LAGGED=0``) can still send the lagged
  cases to the tile kernels.
* Eager calls go through a plain ``torch.autograd.Function`` (or straight to the launch under ``no_grad``), which costs
  less host time per call than the custom-op dispatcher; under ``torch.compile`` the registered custom ops are used.
* Gradients flow to ``hidden_states``, ``alpha`` and ``beta`` through the kernels. When the gradient also involves
  the streamed state (an ``initial_state`` that requires grad, or a returned final state that the loss uses), the
  backward runs the PyTorch reference's autograd on the saved inputs instead: exact, as for the reference, and slower
  (training through a streamed state is rare; the models detach the state they cache).
* ``steps`` 1..16 run fused; 17..64 fall back to the PyTorch reference; 0 is the identity. fp32, bf16 and fp16
  inputs run fused (fp32 accumulation); fp64 inputs fall back to the reference (which keeps fp64).
* The forward / backward / decode kernels are registered as torch custom ops (``cta::pde_refine_fwd``,
  ``cta::pde_refine_bwd``, ``cta::pde_decode_step``) with fake (meta) implementations and autograd, so that
  ``torch.compile`` traces through them without graph breaks.
* With ``TRITON_INTERPRET=1`` (set before triton is imported) the same kernels run on CPU tensors through Triton's
  interpreter; ``is_available()`` then reports True without CUDA. This is how CI checks parity.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
from typing import Optional, Tuple

import torch

from .pde_cta import (
    WAVE_DAMPING,
    check_pde_arguments,
    pde_decode_step_reference,
    pde_refine_reference,
)

try:  # triton is optional
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _HAS_TRITON = False

MAX_FUSED_STEPS = 16
_PDE_IDS = {"diffusion": 0, "wave": 1, "reaction_diffusion": 2, "advection_diffusion": 3}


_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpret() -> bool:
    # read once: triton decides interpreter-or-not when it is imported, which happened before this module loaded
    return _INTERPRET_AT_IMPORT


def is_available() -> bool:
    """True when triton imports and can run here: on CUDA, or on CPU through ``TRITON_INTERPRET=1``."""
    if not _HAS_TRITON:
        return False
    return _interpret() or torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

if _HAS_TRITON:
    _DIFF = tl.constexpr(0)
    _WAVE = tl.constexpr(1)
    _REACT = tl.constexpr(2)
    _ADV = tl.constexpr(3)
    _KEEP = tl.constexpr(1.0 - WAVE_DAMPING)

    # bf16 -> fp32 of the filters' rows: a bf16 is the top half of an fp32, so each packed pair of them widens with
    # one shift (the low one) and one mask (the high one); the conversion Triton emits spends a byte permute and a
    # shift on the high one (FIR_WIDEN_ASM; measured with STATIC_ROWS, see there). The interpreter runs no inline
    # assembly: it converts.
    _WIDEN_ASM = tl.constexpr(not _INTERPRET_AT_IMPORT)

    @triton.jit
    def _widen(x):
        if _WIDEN_ASM and x.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise("shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xFFFF0000;", "=r,=r,r", [x],
                                             dtype=tl.float32, is_pure=True, pack=2)
        return x.to(tl.float32)

    @triton.jit
    def _tanh(x):
        # 1 - 2 / (exp(2x) + 1): exact limits +-1 for large |x| (exp overflows to inf -> 1).
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _valid_at(M, b64, pos, L, HAS_MASK: tl.constexpr):
        inseq = (pos >= 0) & (pos < L)
        if HAS_MASK:
            val = tl.load(M + b64 * L + pos, mask=inseq, other=0.0)
        else:
            val = inseq.to(tl.float32)
        return val

    @triton.jit
    def _load_coef(P, cols, cmask, VEC: tl.constexpr):
        if VEC:
            c = tl.load(P + cols, mask=cmask, other=0.0)
        else:
            c = tl.load(P + cols * 0)
        return c

    @triton.jit
    def _bidi_step(u, v, il, ir, vl, ol, orr, a, b, bp, bm, PDE: tl.constexpr):
        ur = tl.gather(u, ir, 0)
        if PDE == _WAVE:
            ul = tl.gather(u, il, 0)
            v = _KEEP * v + a * (orr * (ur - u) - ol * (u - ul))
            u = u + v
        else:
            if PDE == _ADV:
                gr = orr * (a * (ur - u) - bp * u - bm * ur)
            else:
                gr = orr * (a * (ur - u))
            gl = tl.gather(gr, il, 0)  # flux through the left edge = flux of the row before (mask included)
            upd = gr - gl
            if PDE == _REACT:
                upd = upd - b * _tanh(u) * vl
            u = u + upd
        return u, v

    @triton.jit
    def _causal_left(u, il, lv, is_first, init_s):
        return tl.where(is_first, init_s, tl.gather(u, il, 0) * lv)

    @triton.jit
    def _causal_step(u, v, il, lv, vl, is_first, init_s, a, b, PDE: tl.constexpr):
        pull = _causal_left(u, il, lv, is_first, init_s) - u
        if PDE == _WAVE:
            v = _KEEP * v + a * pull * vl
            u = u + v
        else:
            if PDE == _ADV:
                upd = (a + b) * pull
            else:
                upd = a * pull
            if PDE == _REACT:
                upd = upd - b * _tanh(u)
            u = u + upd * vl
        return u, v

    @triton.jit
    def _step(u, v, s, il, ir, vl, ol, orr, lv, is_first, INIT, init_off, cols, cmask, a, b, bp, bm,
              PDE: tl.constexpr, CAUSAL: tl.constexpr, HAS_INIT: tl.constexpr, STEPS: tl.constexpr, C):
        if CAUSAL:
            if HAS_INIT:
                init_s = tl.load(INIT + init_off + s * C + cols, mask=cmask, other=0.0)
            else:
                init_s = 0.0
            u, v = _causal_step(u, v, il, lv, vl, is_first, init_s, a, b, PDE)
        else:
            u, v = _bidi_step(u, v, il, ir, vl, ol, orr, a, b, bp, bm, PDE)
        return u, v

    @triton.jit
    def _tile_setup(M, pid_l, pid_c, pid_b, L, C, HL: tl.constexpr, T: tl.constexpr, HAS_MASK: tl.constexpr,
                    BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.arange(0, BLOCK_L)[:, None]
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        cmask = cols < C
        b64 = pid_b.to(tl.int64)
        pos = pid_l.to(tl.int64) * T - HL + rows
        inseq = (pos >= 0) & (pos < L)
        vl = _valid_at(M, b64, pos, L, HAS_MASK)
        vprev = _valid_at(M, b64, pos - 1, L, HAS_MASK)
        vnext = _valid_at(M, b64, pos + 1, L, HAS_MASK)
        zero = tl.zeros([BLOCK_L, BLOCK_C], dtype=tl.int32)
        il = tl.maximum(rows - 1, 0) + zero
        ir = tl.minimum(rows + 1, BLOCK_L - 1) + zero
        return rows, cols, cmask, b64, pos, inseq, vl, vprev, vnext, il, ir

    @triton.jit
    def _pde_fwd_kernel(
        X, Y, M, A, Bc, INIT, FIN,
        L, C, sxb, sxl,
        PDE: tl.constexpr, CAUSAL: tl.constexpr, STEPS: tl.constexpr,
        HAS_MASK: tl.constexpr, A_VEC: tl.constexpr, B_VEC: tl.constexpr,
        HAS_INIT: tl.constexpr, WRITE_FINAL: tl.constexpr,
        HL: tl.constexpr, T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid_l = tl.program_id(0)
        pid_c = tl.program_id(1)
        pid_b = tl.program_id(2)
        rows, cols, cmask, b64, pos, inseq, vl, vprev, vnext, il, ir = _tile_setup(
            M, pid_l, pid_c, pid_b, L, C, HL, T, HAS_MASK, BLOCK_L, BLOCK_C)
        x = tl.load(X + b64 * sxb + pos * sxl + cols, mask=inseq & cmask, other=0.0)
        u = x.to(tl.float32)
        v = tl.zeros([BLOCK_L, BLOCK_C], dtype=tl.float32)
        a = _load_coef(A, cols, cmask, A_VEC)
        if PDE == _DIFF:
            b = a * 0.0
        elif PDE == _WAVE:
            b = a * 0.0
        else:
            b = _load_coef(Bc, cols, cmask, B_VEC)
        bp = tl.maximum(b, 0.0)
        bm = tl.minimum(b, 0.0)
        ol = vl * vprev
        orr = vl * vnext
        lv = tl.where(pos == 0, 1.0, vprev)
        is_first = pos == 0
        init_off = b64 * STEPS * C
        last_row = L - 1 - pid_l.to(tl.int64) * T + HL
        has_last = (last_row >= HL) & (last_row < HL + T)
        fin_off = b64 * STEPS * C
        for s in range(STEPS):
            if WRITE_FINAL:
                fs = tl.sum(tl.where(rows == last_row, u * vl, 0.0), axis=0, keep_dims=True)
                tl.store(FIN + fin_off + s * C + cols, fs, mask=cmask & (cols * 0 + has_last.to(tl.int32) > 0))
            u, v = _step(u, v, s, il, ir, vl, ol, orr, lv, is_first, INIT, init_off, cols, cmask, a, b, bp, bm,
                         PDE, CAUSAL, HAS_INIT, STEPS, C)
        out_mask = (rows >= HL) & (rows < HL + T) & inseq & cmask
        tl.store(Y + (b64 * L + pos) * C + cols, u.to(Y.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _adjoint(g, gv, u, il, ir, vl, ol, orr, lv, is_first, init_s, a, b, bp, bm,
                 PDE: tl.constexpr, CAUSAL: tl.constexpr, COEF: tl.constexpr):
        """One adjoint step at the iterate ``u`` (= u_s): (g, gv) = grads of (u_{s+1}, v_{s+1}) -> those of step s,
        plus the per-element contributions to dL/da, dL/db of this step (zeros when COEF is False)."""
        dac = g * 0.0
        dbc = g * 0.0
        if CAUSAL:
            if PDE == _WAVE:
                h = gv + g
                w = h * vl
                gv = _KEEP * h
                g = g + a * (vl * tl.gather(w, ir, 0) - w)
                if COEF:
                    dac = w * (_causal_left(u, il, lv, is_first, init_s) - u)
            else:
                if PDE == _ADV:
                    c = a + b
                else:
                    c = a
                w = g * vl
                if PDE == _REACT:
                    th = _tanh(u)
                    gnew = g - w * (c + b * (1.0 - th * th)) + c * vl * tl.gather(w, ir, 0)
                    if COEF:
                        dbc = -w * th
                else:
                    gnew = g - w * c + c * vl * tl.gather(w, ir, 0)
                if COEF:
                    dac = w * (_causal_left(u, il, lv, is_first, init_s) - u)
                    if PDE == _ADV:
                        dbc = dac
                g = gnew
        else:
            if PDE == _WAVE:
                h = gv + g
                hl = tl.gather(h, il, 0)
                hr = tl.gather(h, ir, 0)
                gv = _KEEP * h
                g = g + a * (orr * (hr - h) - ol * (h - hl))
                if COEF:
                    ul = tl.gather(u, il, 0)
                    ur = tl.gather(u, ir, 0)
                    dac = h * (orr * (ur - u) - ol * (u - ul))
            else:
                gl = tl.gather(g, il, 0)
                gr = tl.gather(g, ir, 0)
                if PDE == _ADV:
                    d = 1.0 - orr * (a + bp) - ol * (a - bm)
                    gnew = g * d + ol * (a - bm) * gl + orr * (a + bp) * gr
                elif PDE == _REACT:
                    th = _tanh(u)
                    d = 1.0 - (orr + ol) * a - b * (1.0 - th * th) * vl
                    gnew = g * d + a * (ol * gl + orr * gr)
                    if COEF:
                        dbc = -g * th * vl
                else:
                    gnew = g * (1.0 - (orr + ol) * a) + a * (ol * gl + orr * gr)
                if COEF:
                    ul = tl.gather(u, il, 0)
                    ur = tl.gather(u, ir, 0)
                    dac = g * (orr * (ur - u) - ol * (u - ul))
                    if PDE == _ADV:
                        dbp = g * (ol * ul - orr * u)
                        dbm = g * (ol * u - orr * ur)
                        dbc = tl.where(b >= 0.0, dbp, 0.0) + tl.where(b <= 0.0, dbm, 0.0)
                g = gnew
        return g, gv, dac, dbc

    @triton.jit
    def _pde_bwd_kernel(
        GY, X, DX, M, A, Bc, INIT, DA, DB,
        L, C, sxb, sxl, sgb, sgl, n_tiles,
        PDE: tl.constexpr, CAUSAL: tl.constexpr, STEPS: tl.constexpr,
        HAS_MASK: tl.constexpr, A_VEC: tl.constexpr, B_VEC: tl.constexpr,
        HAS_INIT: tl.constexpr, LINEAR: tl.constexpr,
        HL: tl.constexpr, T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid_l = tl.program_id(0)
        pid_c = tl.program_id(1)
        pid_b = tl.program_id(2)
        rows, cols, cmask, b64, pos, inseq, vl, vprev, vnext, il, ir = _tile_setup(
            M, pid_l, pid_c, pid_b, L, C, HL, T, HAS_MASK, BLOCK_L, BLOCK_C)
        lmask = inseq & cmask
        x = tl.load(X + b64 * sxb + pos * sxl + cols, mask=lmask, other=0.0).to(tl.float32)
        g = tl.load(GY + b64 * sgb + pos * sgl + cols, mask=lmask, other=0.0).to(tl.float32)
        a = _load_coef(A, cols, cmask, A_VEC)
        if PDE == _DIFF:
            b = a * 0.0
        elif PDE == _WAVE:
            b = a * 0.0
        else:
            b = _load_coef(Bc, cols, cmask, B_VEC)
        bp = tl.maximum(b, 0.0)
        bm = tl.minimum(b, 0.0)
        ol = vl * vprev
        orr = vl * vnext
        lv = tl.where(pos == 0, 1.0, vprev)
        is_first = pos == 0
        init_off = b64 * STEPS * C
        useful = (rows >= HL) & (rows < HL + T) & inseq
        zero_tile = tl.zeros([BLOCK_L, BLOCK_C], dtype=tl.float32)
        gv = zero_tile
        if LINEAR:
            # u -> u + c A u: dL/dc = STEPS * <g_S, A u_{S-1}>, and the adjoint needs no trajectory.
            u = x
            v = zero_tile
            for s in range(STEPS - 1):
                u, v = _step(u, v, s, il, ir, vl, ol, orr, lv, is_first, INIT, init_off, cols, cmask, a, b, bp, bm,
                             PDE, CAUSAL, False, STEPS, C)
            if CAUSAL:
                au = vl * (_causal_left(u, il, lv, is_first, 0.0) - u)
            else:
                au = orr * (tl.gather(u, ir, 0) - u) - ol * (u - tl.gather(u, il, 0))
            da = tl.sum(tl.where(useful, g * au, 0.0), axis=0) * STEPS
            db = da
            for k in range(STEPS):
                g, gv, dac, dbc = _adjoint(g, gv, x, il, ir, vl, ol, orr, lv, is_first, 0.0, a, b, bp, bm,
                                           PDE, CAUSAL, False)
        else:
            da = tl.sum(zero_tile, axis=0)
            db = da
            for k in range(STEPS):
                s = STEPS - 1 - k
                u = x
                v = zero_tile
                for j in range(s):
                    u, v = _step(u, v, j, il, ir, vl, ol, orr, lv, is_first, INIT, init_off, cols, cmask,
                                 a, b, bp, bm, PDE, CAUSAL, HAS_INIT, STEPS, C)
                if CAUSAL and HAS_INIT:
                    init_s = tl.load(INIT + init_off + s * C + cols, mask=cmask, other=0.0)
                else:
                    init_s = 0.0
                g, gv, dac, dbc = _adjoint(g, gv, u, il, ir, vl, ol, orr, lv, is_first, init_s, a, b, bp, bm,
                                           PDE, CAUSAL, True)
                da += tl.sum(tl.where(useful, dac, 0.0), axis=0)
                db += tl.sum(tl.where(useful, dbc, 0.0), axis=0)
        out_mask = useful & cmask
        tl.store(DX + (b64 * L + pos) * C + cols, g.to(DX.dtype.element_ty), mask=out_mask)
        ccols = tl.reshape(cols, [BLOCK_C])
        ccmask = tl.reshape(cmask, [BLOCK_C])
        poff = (b64 * n_tiles + pid_l) * C
        tl.store(DA + poff + ccols, da, mask=ccmask)
        if PDE != _DIFF:
            if PDE != _WAVE:
                tl.store(DB + poff + ccols, db, mask=ccmask)

    @triton.jit
    def _sum_rows_kernel(SRC, DST, rows, C, BLOCK: tl.constexpr):
        """``DST[C] = SRC[rows, C].sum(0)``, fp32 (the coefficient gradient's atomic rows; see
        ``COEF_GRAD_SUM_KERNEL``)."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < C
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in range(0, rows):
            total += tl.load(SRC + r * C + cols, mask=cmask, other=0.0)
        tl.store(DST + cols, total, mask=cmask)

    @triton.jit
    def _pde_decode_kernel(
        X, Y, S, TM, A, Bc, C, sxb, ssb, ssl,
        PDE: tl.constexpr, STEPS: tl.constexpr, HAS_MASK: tl.constexpr,
        A_VEC: tl.constexpr, B_VEC: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid_c = tl.program_id(0)
        b64 = tl.program_id(1).to(tl.int64)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        u = tl.load(X + b64 * sxb + cols, mask=cmask, other=0.0).to(tl.float32)
        v = u * 0.0
        if HAS_MASK:
            vl = tl.load(TM + b64 + cols * 0)
        else:
            vl = 1.0
        a = _load_coef(A, cols, cmask, A_VEC)
        if PDE == _DIFF:
            b = a * 0.0
        elif PDE == _WAVE:
            b = a * 0.0
        else:
            b = _load_coef(Bc, cols, cmask, B_VEC)
        for s in range(STEPS):
            sp = S + b64 * ssb + s * ssl + cols
            left = tl.load(sp, mask=cmask, other=0.0)
            tl.store(sp, u * vl, mask=cmask)
            pull = left - u
            if PDE == _WAVE:
                v = _KEEP * v + a * pull * vl
                u = u + v
            else:
                if PDE == _ADV:
                    upd = (a + b) * pull
                else:
                    upd = a * pull
                if PDE == _REACT:
                    upd = upd - b * _tanh(u)
                u = u + upd * vl
        tl.store(Y + b64 * C + cols, u.to(Y.dtype.element_ty), mask=cmask)


# ----------------------------------------------------------------------------------------------------------------
# Streaming kernels (generated source, one variant per scheme x steps x options)
# ----------------------------------------------------------------------------------------------------------------
#
# A program owns ``BLOCK_C`` channels x ``T`` positions and walks along the sequence one position (row) at a time.
# Every pseudo-time level ``s = 1..S`` keeps the few row vectors its stencil still needs in registers, so level ``s``
# at row ``q - s`` (bidirectional: one row of lag per level) or ``q`` (causal) is computed as soon as level ``s - 1``
# has produced its right neighbour: a wavefront through (row, level) space. Each input row is read once from DRAM
# (plus ``2S`` warm-up rows per program, from L2), each output row written once, and there is no exchange between
# threads at all (every thread owns its channels for the whole walk). The arithmetic is, operation by operation,
# the reference's (flux form, the same walls), so results match it to fp32 rounding. Row loads are prefetched
# ``D`` rows ahead. The source is generated because the number of carried register vectors depends on ``S``.

_GEN_CACHE = {}


def _gen_kernel(key):
    """Builds (once) and returns the @triton.jit streaming kernel for ``key`` (see ``_stream_source``)."""
    # (the default's key as is: this runs every launch)
    flags = (FIR_CLOSED_FORM_TAPS, FIR_WIDEN_ASM, LAST_TILE_SECOND)  # module switches of the source, for comparisons
    cache_key = key if flags == _SOURCE_DEFAULTS else (key, flags)
    fn = _GEN_CACHE.get(cache_key)
    if fn is None:
        name = "_cta_stream_" + "_".join(str(int(k)) if isinstance(k, bool) else str(k) for k in key)
        name += "".join(f"_{label}" for label, on in zip(("levels", "convert"), flags) if not on)
        name += "" if LAST_TILE_SECOND == _SOURCE_DEFAULTS[2] else "_order" + "".join(
            f"_{kind}{int(causal)}{int(per_channel)}" for kind, causal, per_channel in sorted(LAST_TILE_SECOND))
        fn = _exec_kernel(name, _stream_source(name, *key))
        _GEN_CACHE[cache_key] = fn
    return fn


def _taps_kernel(causal: bool, S: int):
    """Builds (once) and returns the kernel that writes ``TAPS[S + 1, C]``: the taps of ``S`` levels of the stencil
    with a coefficient per channel ``A[C]`` (``_fir_taps``: the same operations as the filters' own)."""
    key = ("taps", bool(causal), S)
    fn = _GEN_CACHE.get(key)
    if fn is None:
        name = f"_cta_taps_{int(causal)}_{S}"
        w = _Src()
        w.depth = 0
        w("@triton.jit")
        w(f"def {name}(A, TAPS, C, BLOCK: tl.constexpr):")
        w.depth = 1
        w("cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)")
        w("cmask = cols < C")
        w("a = tl.load(A + cols, mask=cmask, other=0.0).to(tl.float32)")
        _fir_taps(w, "tap", causal, S, "a")
        for k in range(S + 1):
            w(f"tl.store(TAPS + {k} * C + cols, tap{k}, mask=cmask)")
        fn = _exec_kernel(name, "\n".join(w.lines) + "\n")
        _GEN_CACHE[key] = fn
    return fn


def _exec_kernel(name: str, src: str):
    """The @triton.jit function ``name`` defined by the generated source ``src`` (kept in linecache, so that Triton
    and tracebacks can read it)."""
    filename = f"<cta-triton-generated:{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace = {"triton": triton, "tl": tl, "_tanh": _tanh, "_KEEP": _KEEP, "_widen": _widen}
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]


class _Src:
    def __init__(self):
        self.lines = []
        self.depth = 1
        self.widen = False  # the register filters' 16-bit rows widen through ``_widen`` (see ``_widened``)

    def __call__(self, line):
        self.lines.append("    " * self.depth + line)


def _coef_lines(w, name, ptr, vec):
    if vec:
        w(f"{name} = tl.load({ptr} + cols, mask=cmask, other=0.0).to(tl.float32)")
    else:  # one scalar load, broadcast by the arithmetic
        w(f"{name} = tl.load({ptr}).to(tl.float32)")


def _bidi_levels(w, pre, pde, first, last, carry, c="a", interior=False):
    """Bidirectional levels ``first..last`` of pipeline ``pre``: level s at row q-s from ``{pre}p{s-1}`` (row q-s)
    and ``{pre}n{s-1}`` (row q-s+1). ``vv{k}`` = validity of row q-k. Appends the loop-carried names to ``carry``.
    ``interior``: every row the program touches is a valid token, so the validity factors (all exactly 1) are left
    out -- the same values, fewer instructions (these kernels are issue-bound, not memory-bound)."""
    for s in range(first, last + 1):
        p, n = f"{pre}p{s - 1}", f"{pre}n{s - 1}"
        e = f"{pre}e{s}"
        times_e = "" if interior else f" * {e}"
        if not interior:
            w(f"{e} = vv{s} * vv{s - 1}")
        w(f"{pre}d{s} = {n} - {p}")
        if pde == "wave":
            w(f"{pre}D{s} = {pre}d{s}{times_e}")
            w(f"{pre}lap{s} = {pre}D{s} - {pre}dl{s}")
            w(f"{pre}dl{s} = {pre}D{s}")
            if s == 1:
                w(f"{pre}nv{s} = {c} * {pre}lap{s}")
            else:
                w(f"{pre}nv{s} = _KEEP * {pre}pv{s - 1} + {c} * {pre}lap{s}")
                w(f"{pre}pv{s - 1} = {pre}nv{s - 1}")
                carry.append(f"{pre}pv{s - 1}")
            w(f"{pre}n{s} = {p} + {pre}nv{s}")
            carry.append(f"{pre}dl{s}")
        else:
            if pde == "advection_diffusion":
                w(f"{pre}G{s} = ({c} * {pre}d{s} - bp * {p} - bm * {n}){times_e}")
            else:
                w(f"{pre}G{s} = {c} * {pre}d{s}{times_e}")
            w(f"{pre}up{s} = {pre}G{s} - {pre}gl{s}")
            if pde == "reaction_diffusion":
                w(f"{pre}up{s} = {pre}up{s} - b * _tanh({p})" + ("" if interior else f" * vv{s}"))
            w(f"{pre}gl{s} = {pre}G{s}")
            w(f"{pre}n{s} = {p} + {pre}up{s}")
            carry.append(f"{pre}gl{s}")
        w(f"{p} = {n}")
        carry.append(p)


def _causal_levels(w, pre, pde, first, last, carry, has_init=False, c="a", interior=False):
    """Causal levels at row q: level s from ``{pre}n{s-1}`` (row q) and ``{pre}p{s-1}`` (row q-1). ``interior``: as
    in :func:`_bidi_levels` (and row 0, where the initial state enters, is never in an interior program)."""
    times_v0 = "" if interior else " * vv0"
    for s in range(first, last + 1):
        p, n = f"{pre}p{s - 1}", f"{pre}n{s - 1}"
        w(f"{pre}left{s} = {p}" + ("" if interior else " * vv1"))
        if has_init and not interior:
            w(f"{pre}left{s} = tl.where(q == 0, ini{s - 1}, {pre}left{s})")
        w(f"{pre}pull{s} = {pre}left{s} - {n}")
        if pde == "wave":
            if s == 1:
                w(f"{pre}nv{s} = {c} * {pre}pull{s}{times_v0}")
            else:
                w(f"{pre}nv{s} = _KEEP * {pre}nv{s - 1} + {c} * {pre}pull{s}{times_v0}")
            w(f"{pre}n{s} = {n} + {pre}nv{s}")
        else:
            cc = "ab" if pde == "advection_diffusion" else c
            w(f"{pre}up{s} = {cc} * {pre}pull{s}")
            if pde == "reaction_diffusion":
                w(f"{pre}up{s} = {pre}up{s} - b * _tanh({n})")
            w(f"{pre}n{s} = {n} + {pre}up{s}{times_v0}")
        w(f"{p} = {n}")
        carry.append(p)


def _rows(r: str) -> str:
    """A row index in a condition combined with vectors: the interpreter mishandles scalar & vector masks, so there
    the row is broadcast first (``cz`` = int zeros of the channel vector)."""
    return f"(cz + {r})" if _interpret() else f"({r})"


# Interior programs of the linear schemes (diffusion; causal advection-diffusion, which is diffusion with a + b) run
# a banded filter instead of the level-by-level walk: ``S`` levels of a 3-point (bidirectional) or 2-point (causal)
# stencil with constant coefficients are, away from the walls, one filter of ``2S+1`` (``S+1``) taps, the stencil's
# ``S``-th power. Its taps are computed per program from the coefficient (a few vector operations); each output row
# then costs ``2S+1`` (``S+1``) multiply-adds on a window of input rows carried in registers, against about four
# operations and two register copies per level for the walk -- these kernels are instruction-bound. The backward
# filters g only: ``S - 1`` levels of the transposed stencil, then one level for the input gradient and the
# stencil's derivative for the coefficient's factor, paired with x at the output row -- the walk's per-row split
# (see ``_fir_backward``; the factor ``S`` is applied by the final store, as for the walk). Programs at the sequence
# ends run the same filter on the walls' extension of the input (``_wall_load``); padding masks keep the walk.


# The filter's taps in closed form (``_fir_taps``); False: level by level (``_fir_taps_by_levels``), for
# ``bench_scalar_coefficients.py --compare taps``.
FIR_CLOSED_FORM_TAPS = True


def _fir_tap_terms(causal: bool, S: int):
    """The taps of ``S`` levels in closed form: for each tap k, the pairs (integer factor, j) of its sum
    ``sum_j factor * m^(S-j) * c^j`` (m the stencil's centre weight). Bidirectional, ``(m + c (z + 1/z))^S``:
    tap k = sum over j >= k, j - k even, of C(S, j) C(j, (j - k) / 2) m^(S-j) c^j; causal, ``(m + c / z)^S``:
    tap k = C(S, k) m^(S-k) c^k."""
    from math import comb

    if causal:
        return [[(comb(S, k), k)] for k in range(S + 1)]
    return [[(comb(S, j) * comb(j, (j - k) // 2), j) for j in range(k, S + 1, 2)] for k in range(S + 1)]


def _fir_taps(w, name, causal, S, c):
    """Emits ``{name}{k}``, k = 0..S: taps of ``S`` levels (bidirectional: symmetric, tap k at offsets -k and +k;
    causal: tap k at offset -k). ``S = 0`` gives the identity.

    The taps are the closed form of ``_fir_tap_terms`` (powers of m and c, then a few multiply-adds per tap): with a
    coefficient per channel every program computes them for each of its channels, and the level-by-level
    convolution they replace (about 3 operations per tap and level, ~130 at 8 bidirectional steps) was a sizeable
    share of those programs' instructions. With 0 <= c <= 1/2 (1 causal) every term is non-negative: no
    cancellation."""
    if not FIR_CLOSED_FORM_TAPS:
        return _fir_taps_by_levels(w, name, causal, S, c)
    keep = f"{name}m"
    w(f"{keep} = 1.0 - {'' if causal else '2.0 * '}{c}")
    if S == 0:
        w(f"{name}0 = {keep} * 0.0 + 1.0")
        return
    # {name}p{j} = m^(S-j) c^j, from the powers of m ({name}m{e}) and of c ({name}c{e})
    pow_m = lambda e: "1.0" if e == 0 else (keep if e == 1 else f"{name}m{e}")  # noqa: E731
    pow_c = lambda e: "1.0" if e == 0 else (c if e == 1 else f"{name}c{e}")  # noqa: E731
    for e in range(2, S + 1):
        w(f"{pow_m(e)} = {pow_m(e - 1)} * {keep}")
        w(f"{pow_c(e)} = {pow_c(e - 1)} * {c}")
    for j in range(S + 1):
        factors = [f for f in (pow_m(S - j), pow_c(j)) if f != "1.0"]
        w(f"{name}p{j} = {' * '.join(factors)}")
    for k, terms in enumerate(_fir_tap_terms(causal, S)):
        expr = None
        for factor, j in terms:
            if expr is None:
                expr = f"{name}p{j}" if factor == 1 else f"{float(factor)!r} * {name}p{j}"
            else:
                expr = f"tl.fma({float(factor)!r}, {name}p{j}, {expr})"
        w(f"{name}{k} = {expr}")


def _fir_taps_by_levels(w, name, causal, S, c):
    """``_fir_taps`` level by level: the stencil convolved with itself ``S`` times (the taps before the closed form;
    ``FIR_CLOSED_FORM_TAPS = False``, kept for the paired comparison)."""
    keep = f"{name}m"
    w(f"{keep} = 1.0 - {'' if causal else '2.0 * '}{c}")
    prev = {0: "1.0"}
    for level in range(1, S + 1):
        cur = {}
        for k in range(level + 1):
            terms = []
            if k in prev:
                terms.append(f"{keep} * {prev[k]}")
            if causal:
                if k - 1 in prev:
                    terms.append(f"{c} * {prev[k - 1]}")
            else:
                if k == 0:  # symmetric: the neighbours at -1 and +1 are both tap 1
                    side = [f"2.0 * {prev[1]}"] if 1 in prev else []
                else:
                    side = [prev[j] for j in (k - 1, k + 1) if j in prev]
                if side:
                    terms.append(f"{c} * ({' + '.join(side)})")
            var = f"{name}{level}_{k}"
            w(f"{var} = {' + '.join(terms)}")
            cur[k] = var
        prev = cur
    for k in range(S + 1):
        w(f"{name}{k} = {prev[k]}" if S > 0 else f"{name}{k} = {keep} * 0.0 + 1.0")


def _fir_dtaps(w, name, causal, levels, c):
    """Emits ``{name}{k}``, k = 0..levels+1: taps of the stencil's derivative in ``c`` ([1, -2, 1], or causal -1 at
    offset 0 and 1 at offset -1) times ``levels`` levels: d/dc of ``levels + 1`` levels' taps, divided by
    ``levels + 1``."""
    _fir_taps(w, f"{name}e", causal, levels, c)
    e = lambda k: f"{name}e{k}" if 0 <= k <= levels else None  # noqa: E731
    for k in range(levels + 2):
        if causal:
            terms = ([e(k - 1)] if e(k - 1) else []) + ([f"-{e(k)}"] if e(k) else [])
        elif k == 0:
            terms = ([f"2.0 * {e(1)}"] if e(1) else []) + [f"-2.0 * {e(0)}"]
        else:
            terms = [t for t in (e(k - 1), e(k + 1)) if t] + ([f"-2.0 * {e(k)}"] if e(k) else [])
        w(f"{name}{k} = " + " + ".join(terms).replace("+ -", "- "))


def _fir_apply(w, out, taps, n, win, causal, center):
    """``out`` = the filter ``taps`` (0..n) on window ``win`` around index ``center`` (causal: tap k reads
    ``win[center - k]``; bidirectional: ``win[center - k] + win[center + k]``)."""
    w(f"{out} = {taps}0 * {win}{center}")
    for k in range(1, n + 1):
        pair = f"{win}{center - k}" if causal else f"({win}{center - k} + {win}{center + k})"
        w(f"{out} = tl.fma({taps}{k}, {pair}, {out})")


# Programs at the sequence ends (no padding mask) run the same filters: the walls are an extension of the input
# beyond the ends, exact for these linear stencils. Bidirectional (zero-flux walls, ``open_edge``): the even
# reflection about each end (row -1-r, row 2L-1-r) -- the 3-point stencil maps a reflection-symmetric sequence to a
# reflection-symmetric one and gives the wall's flux-form update at the end rows, so S levels of the walled scheme
# on the sequence are S levels of the unwalled one on its reflection (one reflection per side is exact for L >= S,
# the rows within S of an output; farther rows, which meet zero taps, are clamped into the sequence). Causal (the
# reference's zero left neighbour at the start): zeros before the first row, which the 2-point stencil keeps zero;
# its adjoint, the anti-causal stencil, reads zeros past the last row. Rows past the end are neither stored nor
# summed into the coefficient gradient.
WALL_REFLECT, WALL_ZERO = "reflect", "zero"


def _wall_kind(causal: bool, walls: bool):
    """The extension a scheme's end programs read (None: an interior program, which reads rows as they are)."""
    return (WALL_ZERO if causal else WALL_REFLECT) if walls else None


def _wall_load(ptr, r, stride, wall, vector=False):
    """``tl.load`` of row ``r`` of a stream: as is (``wall`` None), or with the walls' extension (``WALL_REFLECT``,
    ``WALL_ZERO``; ``vector``: ``r`` is a column of rows, as in the MMA blocks)."""
    if wall is None:
        return f"tl.load({ptr} + ({r}) * {stride})"
    if wall == WALL_REFLECT:
        mirrored = f"tl.where({r} < 0, -1 - ({r}), tl.where({r} >= L, 2 * L - 1 - ({r}), {r}))"
        return f"tl.load({ptr} + tl.minimum(tl.maximum({mirrored}, 0), L - 1) * {stride})"
    rr = f"({r})" if vector else _rows(r)
    return f"tl.load({ptr} + ({r}) * {stride}, mask=({rr} >= 0) & ({rr} < L), other=0.0)"


def _fir_loop(w, unroll, walls=False):
    """Opens the filter's row loop (row ``t``); the caller closes it (``w.depth -= 1``). ``walls``: the program may
    run past the sequence end, and stops there ('static': it runs all ``T`` rows, and the caller masks the stores)."""
    # (int32: the loop index must have one type in every branch of the kernel, and the walk's is int32)
    bound = "tl.minimum(L - start, T).to(tl.int32)" if walls is True else "T"
    w(f"for j in tl.range(0, {bound}, loop_unroll_factor={unroll}):" if unroll > 1 else f"for j in range(0, {bound}):")
    w.depth += 1
    w("t = start + j")


# The interior filters of these launches, keyed (kernel, causal, per-channel coefficient), read each stream's rows in
# order through a pointer that steps one row per load (one 64-bit add), and store through one that steps likewise,
# instead of computing every row's address from its index (programs at the sequence ends always load by index).
# Paired on an H200 (``bench_scalar_coefficients.py --compare pointers [--per-channel]``,
# results/fir_pointers[_per_channel]_NVIDIA_H200.json, 1x16384x4096 / 8x4096x4096 / 1x65536x512): per channel,
# the 8-step bidirectional forward 1.357 / 1.345 / 1.418x copy against 1.387 / 1.502 / 1.473x, the 4-step one
# 1.075 / 1.060 / 1.080x against 1.128 / 1.144 / 1.136x, the 8-step bidirectional backward 1.886 / 1.869 / 2.093x
# against 2.034 / 2.129 / 2.301x; the causal forwards gain a little (8 steps 1.115 / 1.099 / 1.139x against 1.142 /
# 1.133 / 1.164x). The per-channel causal backward lost (8 steps 1.799 / 1.725 / 1.997x against 1.731 / 1.693 /
# 1.949x) and the scalar bidirectional backward at 4 steps too (2.062 / 2.032 / 2.168x against 1.880 / 1.932 /
# 1.982x), so those, and the scalar kernels, keep the index.
FIR_POINTER_STEPS = {("fwd", False, True), ("fwd", True, True), ("bwd", False, True)}


# The per-channel filters widen their 16-bit rows to fp32 with ``_widen`` (bf16 by a shift and a mask) instead of
# ``.to`` (measured with STATIC_ROWS, see there). The scalar coefficient's register filters convert: in a scalar sweep
# with ``_widen`` (results/kernels_NVIDIA_H200_scalar_widen.json) its 2-step causal forward read 1.19-1.21x copy on
# the three large shapes, against 1.03-1.07x converting (kernels_NVIDIA_H200_scalar.json).
FIR_WIDEN_ASM = os.environ.get("CTA_WIDEN_ASM", "1") not in ("", "0")


def _widened(w, value: str) -> str:
    """``value`` (a 16-bit row) as fp32, in the filter source ``w`` (``w.widen``: through ``_widen``)."""
    return f"_widen({value})" if w.widen else f"{value}.to(tl.float32)"


class _Rows:
    """Emits the loads of one stream's consecutive rows, from row ``first`` on: ``load(dest, r)`` sets ``dest`` to
    row ``r`` (which must be the row after the previous load's) through a stepping pointer ``name`` (``pointers``,
    no walls' extension: see ``FIR_POINTER_STEPS``), or by index (``_wall_load``)."""

    def __init__(self, w, name, row, stride, first, wall, pointers):
        self.w, self.name, self.row, self.stride, self.wall = w, name, row, stride, wall
        self.stepping = pointers and wall is None
        if self.stepping:
            w(f"{name} = {row} + ({first}) * {stride}")

    def load(self, dest, r, to_float=False):
        value = f"tl.load({self.name})" if self.stepping else _wall_load(self.row, r, self.stride, self.wall)
        self.w(f"{dest} = {_widened(self.w, value) if to_float else value}")
        if self.stepping:
            self.w(f"{self.name} += {self.stride}")


def _fir_store(w, base, value, wall, pointers, past_end=""):
    """Stores ``value`` at row ``t`` of ``base`` (an output's [batch, seq, channels] pointer): through a pointer
    ``{base}_at`` that steps one row per store where ``_Rows`` steps (it is set before the loop, see
    ``_fir_store_start``), else by index."""
    if pointers and wall is None:
        w(f"tl.store({base.lower()}_at, {value}{past_end})")
        w(f"{base.lower()}_at += C")
    else:
        w(f"tl.store({base} + (b64 * L + t) * C + cols, {value}{past_end})")


def _fir_store_start(w, base, wall, pointers):
    if pointers and wall is None:
        w(f"{base.lower()}_at = {base} + (b64 * L + start) * C + cols")


def _fir_next_row(w, pre, rows, lead, D, dest):
    """``dest`` = the prefetched row ``t + lead`` of a stream; the prefetch (``rows``) advances to row
    ``t + lead + D``."""
    w(f"{dest} = {_widened(w, f'{pre}f0')}")
    for k in range(D - 1):
        w(f"{pre}f{k} = {pre}f{k + 1}")
    rows.load(f"{pre}f{D - 1}", f"t + {lead + D}")


def _fir_prefetch(w, pre, rows, lead, D):
    """Loads rows ``start + lead .. start + lead + D - 1`` of a stream into its prefetch registers."""
    for k in range(D):
        rows.load(f"{pre}f{k}", f"start + {lead + k}")


def _fir_taps_or_table(w, name, causal, S, c, table):
    """``_fir_taps``, or (``table``) the same taps loaded from the launch's table ``TAPS[S + 1, C]`` (see
    ``TAPS_TABLE``)."""
    if table:
        for k in range(S + 1):
            w(f"{name}{k} = tl.load(TAPS + {k} * C + cols)")
    else:
        _fir_taps(w, name, causal, S, c)


def _fir_interior(w, kind, pde, causal, S, D, unroll, walls=False, pointers=False, table=False):
    """The interior branch of a linear scheme's streaming kernel as a banded filter (see above). Returns the
    condition under which a program may take it (every row it reads lies inside the sequence). ``walls``: the same
    filter for programs at the sequence ends (rows beyond them read as the walls' extension, see ``_wall_load``);
    'static' (the forward only): a loop over all ``T`` rows whatever the program, with the stores past the end
    masked (the one copy of a kernel whose every program filters: see ``WALLS_ONE_COPY``)."""
    if kind == "bwd":
        assert walls != "static"
        return _fir_backward(w, causal, S, D, unroll, walls, pointers, table)
    c = "ab" if (causal and pde == "advection_diffusion") else "a"
    wide = S + 1 if causal else 2 * S + 1
    lead = 0 if causal else S  # newest window row - output row
    wall = _wall_kind(causal, walls)
    _fir_taps_or_table(w, "tap", causal, S, c, table)
    x_rows = _Rows(w, "x_at", "xrow", "sxl", f"start + {lead - wide + 1}", wall, pointers)
    for i in range(wide - 1):
        x_rows.load(f"xw{i}", f"start + {lead - wide + 1 + i}", to_float=True)
    _fir_prefetch(w, "x", x_rows, lead, D)
    _fir_store_start(w, "Y", wall, pointers)
    _fir_loop(w, unroll, walls)
    _fir_next_row(w, "x", x_rows, lead, D, f"xw{wide - 1}")
    _fir_apply(w, "yv", "tap", S, "xw", causal, S)
    past_end = f", mask={_rows('t')} < L" if walls == "static" else ""
    _fir_store(w, "Y", "yv.to(Y.dtype.element_ty)", wall, pointers, past_end)
    for i in range(wide - 1):
        w(f"xw{i} = xw{i + 1}")
    w.depth -= 1
    return f"(start + {lead - wide + 1} >= 0) & (start + T + {lead + D} <= L)"


def _fir_backward(w, causal, S, D, unroll, walls=False, pointers=False, table=False):
    """The backward's interior as filters on g only, with the walk's split of the coefficient gradient
    (``_stream_body``): with ``u = (M^T)^(S-1) g`` (one filter of S-1 levels: taps at offsets -k..k, or 0..k for the
    causal adjoint), the input gradient is ``M^T u = u + a L^T u`` and the coefficient's factor ``L^T u``, paired
    with x at the output row. ``u`` is kept at rows t-1, t, t+1 (causal: t, t+1). ``walls``: see
    ``_fir_interior`` (x is only read at output rows, so it needs no extension, only rows that exist)."""
    wall = _wall_kind(causal, walls)
    x_wall = WALL_REFLECT if walls else None  # the prefetch's rows past the end: any row of the sequence
    k = S - 1
    width = k + 1 if causal else 2 * k + 1  # g rows of one u row
    first = 0 if causal else -S  # the first g row a program reads (that of u at row start-1, bidirectional)
    n_u = 2 if causal else 3
    if k:
        _fir_taps_or_table(w, "gtap", causal, k, "a", table)

    def u_row(dest):  # u at the row whose g window ``gw`` holds
        if not k:
            w(f"{dest} = gw0")
        elif causal:  # the adjoint's taps point ahead: tap i reads gw{i}
            w(f"{dest} = gtap0 * gw0")
            for i in range(1, k + 1):
                w(f"{dest} = tl.fma(gtap{i}, gw{i}, {dest})")
        else:
            _fir_apply(w, dest, "gtap", k, "gw", False, k)

    g_rows = _Rows(w, "g_at", "grow", "sgl", f"start + {first}", wall, pointers)
    for i in range(width - 1):
        g_rows.load(f"gw{i}", f"start + {first + i}", to_float=True)
    for j in range(n_u - 1):  # u at the rows before the first output row's newest (bidirectional: start-1, start)
        g_rows.load(f"gw{width - 1}", f"start + {first + width - 1 + j}", to_float=True)
        u_row(f"u{j}")
        for i in range(width - 1):
            w(f"gw{i} = gw{i + 1}")
    _fir_prefetch(w, "g", g_rows, S, D)  # u at row t+1 needs g up to row t+S (the rows above end at row S-1)
    x_rows = _Rows(w, "x_at", "xrow", "sxl", "start", x_wall, pointers)
    _fir_prefetch(w, "x", x_rows, 0, D)
    _fir_store_start(w, "DX", wall, pointers)
    _fir_loop(w, unroll, walls)
    _fir_next_row(w, "g", g_rows, S, D, f"gw{width - 1}")
    u_row(f"u{n_u - 1}")
    _fir_next_row(w, "x", x_rows, 0, D, "xv")
    if causal:
        w("lu = u1 - u0")  # (L^T u)_t
        w("dxv = tl.fma(a, lu, u0)")
    else:
        w("lu = tl.fma(-2.0, u1, u0 + u2)")  # (L u)_t
        w("dxv = tl.fma(a, lu, u1)")
    w("acc = tl.fma(xv, lu, acc)")
    _fir_store(w, "DX", "dxv.to(DX.dtype.element_ty)", wall, pointers)
    for i in range(width - 1):
        w(f"gw{i} = gw{i + 1}")
    for i in range(n_u - 1):
        w(f"u{i} = u{i + 1}")
    w.depth -= 1
    return f"(start + {first} >= 0) & (start + T + {S + D} <= L)"


# Interior programs with a scalar coefficient and 16-bit inputs can run the same banded filter on tensor cores
# instead: the program's rows are cut into 16-row tiles, and each tile's output is ``W_a X_a + W_b X_b``, where
# ``X_a``, ``X_b`` are the 16-row blocks of input around it (rows t0-8..t0+7 and t0+8..t0+23, so up to 8 steps of
# halo each side) and ``W_a``, ``W_b`` the [16, 16] pieces of the banded filter matrix, built once per program from
# the taps. The taps are fp32; each matrix is split into a 16-bit high part and a 16-bit remainder (two MMAs on the
# same block, fp32 accumulation), so the filter keeps ~16 bits of each tap against 8 of a bf16 output. The 16-bit
# inputs themselves are exact operands. Per element this leaves the load, a few MMA instructions and the store,
# against ~2S+1 fp32 operations of the register filter -- which made the 8-step kernels instruction-bound.
MMA_BLOCK = 16  # rows of one MMA tile; the input blocks sit half a tile either side, which bounds the steps
MMA_MAX_STEPS = MMA_BLOCK // 2


def _mma_dot(a, b, acc=None):
    """A 16-bit tensor-core product (fp32 accumulation). The interpreter's bf16 ``tl.dot`` returns garbage
    (triton 3.9; its fp16 and fp32 products are right), so there the same operands go through an exact fp32
    product."""
    if _interpret():
        a, b = f"{a}.to(tl.float32)", f"{b}.to(tl.float32)"
        tail = ', input_precision="ieee"'
    else:
        tail = ""
    return f"tl.dot({a}, {b}{'' if acc is None else ', ' + acc}{tail})"


def _mma_band(w, name, taps, n, side):
    """``{name}{a,b}_{hi,lo}``: the filter ``taps`` (0..n) as the [16, 16] matrices acting on input blocks a and b
    (``offa``, ``offb``: input row - output row). ``side``: 'both' (tap k at offsets -k and +k), 'past' (at -k) or
    'future' (at +k). Each matrix is split into a 16-bit part and the 16-bit rounding of what remains."""
    for blk in "ab":
        off = f"off{blk}"
        dist = {"both": f"tl.abs({off})", "past": f"-{off}", "future": off}[side]
        w(f"{name}{blk}d = {dist}")
        w(f"{name}{blk} = tl.where({name}{blk}d == 0, {taps}0, 0.0)")
        for k in range(1, n + 1):
            w(f"{name}{blk} = tl.where({name}{blk}d == {k}, {taps}{k}, {name}{blk})")
        w(f"{name}{blk}_hi = {name}{blk}.to(X.dtype.element_ty)")
        w(f"{name}{blk}_lo = ({name}{blk} - {name}{blk}_hi.to(tl.float32)).to(X.dtype.element_ty)")


def _mma_apply(w, out, name, a, b):
    """``out = {name}a @ a + {name}b @ b``, each matrix as its two 16-bit parts."""
    w(f"{out} = {_mma_dot(f'{name}a_hi', a)}")
    w(f"{out} = {_mma_dot(f'{name}a_lo', a, out)}")
    w(f"{out} = {_mma_dot(f'{name}b_hi', b, out)}")
    w(f"{out} = {_mma_dot(f'{name}b_lo', b, out)}")


def _mma_blocks(w, streams, ahead, dynamic):
    """The MMA tile loop over the program's rows: when the body runs for tile ``m`` (rows t0..t0+15), ``{pre}b0`` and
    ``{pre}b1`` hold the input blocks around it (block j: rows start-8+16j .. start+7+16j) for each stream
    ``(pre, row pointer, row stride, shift, wall)``, and the next ``ahead`` blocks are in flight (``{pre}b2``...). A
    stream with ``shift`` 8 holds the tile's own rows in ``{pre}b0`` instead (block j: rows start+16j ..
    start+15+16j). ``wall``: how the stream reads rows beyond the sequence ends (``_wall_load``; None in interior
    programs). ``dynamic``: a loop the compiler keeps as a loop (the backward: unrolled, it holds more registers,
    and ran 13-17% slower on an H200 in a probe at 4 and 8 bidirectional steps, each form at its best
    configuration), otherwise unrolled (the forward: short programs of two tiles were best). Returns with
    ``w.depth`` inside the loop; the caller emits the body, then ``_mma_blocks_end``."""
    half = MMA_BLOCK // 2
    for pre, ptr, stride, shift, wall in streams:
        for i in range(ahead + 1):
            w(f"{pre}b{i} = {_wall_load(ptr, f'start + {shift - half + MMA_BLOCK * i} + mi', stride, wall, True)}")
    w(f"for m in {'range' if dynamic else 'tl.static_range'}(0, T // {MMA_BLOCK}):")
    w.depth += 1
    w(f"t0 = start + {MMA_BLOCK} * m")
    for pre, ptr, stride, shift, wall in streams:
        new, row = f"{pre}b{ahead + 1}", f"t0 + {half + shift + MMA_BLOCK * ahead}"  # block m + 1 + ahead
        blocks = f"T // {MMA_BLOCK}" + (" - 1" if shift else "")  # the index of the program's last block
        if ahead == 0 and not shift:
            w(f"{new} = {_wall_load(ptr, f'{row} + mi', stride, wall, True)}")
        elif dynamic:  # past the program's last block, load the last one again (an L1 hit) rather than branch
            last = f"tl.minimum({row}, start + T - {half + shift}) + mi"
            w(f"{new} = {_wall_load(ptr, last, stride, wall, True)}")
        else:  # a compile-time condition
            w(f"if m + {1 + ahead} <= {blocks}:")
            w(f"    {new} = {_wall_load(ptr, f'{row} + mi', stride, wall, True)}")
            w("else:")
            w(f"    {new} = {pre}b{ahead}")


def _mma_blocks_end(w, streams, ahead):
    for pre, *_ in streams:
        for i in range(ahead + 1):
            w(f"{pre}b{i} = {pre}b{i + 1}")
    w.depth -= 1


def _mma_interior(w, kind, pde, causal, S, ahead=0, walls=False):
    """The interior branch of a linear scheme's streaming kernel as the banded filter on tensor cores (see above;
    the same taps, and in the backward the same per-row split of the coefficient gradient, as ``_fir_interior``).
    ``ahead``: see ``_mma_blocks``. ``walls``: the same for programs at the sequence ends (see ``_wall_load``; tiles
    past the end are computed, not stored). Returns the condition under which an interior program may take it."""
    assert 1 <= S <= MMA_MAX_STEPS
    c = "ab" if (kind == "fwd" and causal and pde == "advection_diffusion") else "a"
    half = MMA_BLOCK // 2
    wall = _wall_kind(causal, walls)
    store_mask = ", mask=t0 + mi < L" if walls else ""
    w(f"mi = tl.arange(0, {MMA_BLOCK})[:, None]")
    w(f"mj = tl.arange(0, {MMA_BLOCK})[None, :]")
    w(f"offa = mj - mi - {half}")
    w(f"offb = mj - mi + {half}")
    w("x2 = xrow[None, :]")
    w("c2 = cols[None, :]")
    if kind == "fwd":
        _fir_taps(w, "tap", causal, S, c)
        _mma_band(w, "wf", "tap", S, "past" if causal else "both")
        streams = [("x", "x2", "sxl", 0, wall)]
        _mma_blocks(w, streams, ahead, dynamic=False)
        _mma_apply(w, "yv", "wf", "xb0", "xb1")
        w(f"tl.store(Y + (b64 * L + t0 + mi) * C + c2, yv.to(Y.dtype.element_ty){store_mask})")
        _mma_blocks_end(w, streams, ahead)
    else:
        # the walk's split of the coefficient gradient (see _fir_backward): the factor L^T (M^T)^(S-1) g, a filter
        # of S + 1 taps on the same g blocks as the input gradient, paired with the x tile itself
        _fir_taps(w, "tap", causal, S, c)
        _mma_band(w, "wd", "tap", S, "future" if causal else "both")  # the input gradient: the transposed filter
        _fir_dtaps(w, "dtap", causal, S - 1, c)
        _mma_band(w, "wl", "dtap", S, "future" if causal else "both")
        w("g2 = grow[None, :]")
        w(f"acc2 = tl.zeros([{MMA_BLOCK}, BLOCK_C], dtype=tl.float32)")
        # (x past the end reads zeros: those rows add nothing to the coefficient gradient)
        streams = [("g", "g2", "sgl", 0, wall), ("x", "x2", "sxl", half, WALL_ZERO if walls else None)]
        w("eye = tl.where(mi == mj, 1.0, 0.0).to(X.dtype.element_ty)")
        _mma_blocks(w, streams, ahead, dynamic=True)
        # the coefficient's product first, so that its factor is dead before the input gradient is computed
        _mma_apply(w, "lu", "wl", "gb0", "gb1")
        # x in the accumulator's layout through an MMA with the identity (exact): loaded in that layout directly, each
        # tile paid a layout conversion (5-10% slower at 4 and 8 steps on the three large shapes, in a probe)
        w(f"acc2 += {_mma_dot('eye', 'xb0')} * lu")
        _mma_apply(w, "dxv", "wd", "gb0", "gb1")
        w(f"tl.store(DX + (b64 * L + t0 + mi) * C + c2, dxv.to(DX.dtype.element_ty){store_mask})")
        _mma_blocks_end(w, streams, ahead)
        w("acc = tl.sum(acc2, axis=0)")
    return f"(start - {half} >= 0) & (start + T + {half} <= L)"


@functools.lru_cache(maxsize=None)  # (asked at every launch)
def _stream_int_args(kind: str, static_rows: bool) -> Tuple[tuple, tuple]:
    """The streaming kernels' integer parameters, in order: (runtime ints, constexprs before T and BLOCK_C). The
    channels ``C`` and the row strides are constexprs with ``static_rows``."""
    ints = ("L", "C", "sxb", "sxl") + (("sgb", "sgl", "n_tiles", "n_groups") if kind == "bwd" else ())
    statics = tuple(n for n in ints if n in ("C", "sxl", "sgl")) if static_rows else ()
    return tuple(n for n in ints if n not in statics), statics


def _stream_args(kind: str, static_rows: bool, t: int, block_c: int, **values) -> Tuple[tuple, tuple]:
    """(ints, constexprs) of a streaming launch from the named integer ``values`` (see ``_stream_int_args``)."""
    ints, statics = _stream_int_args(kind, static_rows)
    return tuple(values[n] for n in ints), tuple(values[n] for n in statics) + (t, block_c)


def _stream_source(name, kind, pde, causal, S, D, has_mask, a_vec, b_vec, has_init, write_final, even_c=False,
                   fir_unroll=0, mma=0, walls=False, coef_atomic=False, pointers=False, static_rows=False,
                   taps_table=False):
    """Source of one streaming kernel. ``kind`` 'fwd': ``Y = scheme^S(X)`` (+ causal final state);
    'bwd': linear schemes only (diffusion; causal advection-diffusion = diffusion with ``a + b``), no initial state:
    ``DX = adjoint^S(GY)`` and per-program partial sums of ``dL/dc`` in ``DA``. ``mma`` > 0: interior programs run the
    filter on tensor cores (``_mma_interior`` with ``mma - 1`` blocks ahead: scalar coefficients, 16-bit inputs,
    ``S <= MMA_MAX_STEPS``, ``T`` a multiple of ``MMA_BLOCK``). ``walls`` (see ``_walls_mode``): 1, programs at the
    sequence ends run the same filter, reading the walls as an extension of the input (``_wall_load``), and walk
    only where that does not apply (the programs a causal initial or final state reaches; a bidirectional
    sequence shorter than ``S``, which ``_walls_mode`` sends to 0); 2, the launch has none of those, and the kernel
    no walk; 3, as 2 with one copy of the filter, which every program runs (no interior branch: ``WALLS_ONE_COPY``).
    ``coef_atomic`` (backward, per-channel coefficient): each program adds its partial sums into a row of
    ``DA[n_groups, channels]`` with atomics instead of storing a row of ``DA[tiles, channels]`` (see
    ``COEF_GRAD_ATOMIC``). ``pointers``: the interior filter steps its row pointers (``FIR_POINTER_STEPS``).
    ``static_rows``: the channels and the row strides are constexprs (``STATIC_ROWS``), so that the unrolled
    filter addresses its rows as one pointer plus constant offsets. ``taps_table``: the register filters load their
    per-channel taps from ``TAPS`` (``TAPS_TABLE``) instead of computing them."""
    w = _Src()
    walk_d = min(D, WALK_MAX_PREFETCH)  # (a rolled loop: its prefetch registers move every row)
    ints, statics = _stream_int_args(kind, static_rows)
    tensors = "X, Y, M, A, Bc, INIT, FIN, TAPS" if kind == "fwd" else "GY, X, DX, M, A, Bc, DA, TAPS"
    params = list(ints) + [f"{n}: tl.constexpr" for n in statics + ("T", "BLOCK_C")]
    head = f"def {name}({tensors}, {', '.join(params)}):"
    w.depth = 0
    w("@triton.jit")
    w(head)
    w.depth = 1
    w("pid_c = tl.program_id(0)")
    w("pid_l = tl.program_id(1)")
    w("b64 = tl.program_id(2).to(tl.int64)")
    w("cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)")
    w("cmask = cols < C")
    w("cz = cols.to(tl.int64) * 0")
    if mma or ((kind, bool(causal), bool(a_vec or b_vec)) in LAST_TILE_SECOND and fir_unroll > 0 and walls < 3):
        # The end programs walk, or run the walls' filter as a rolled loop: either takes longer than an interior
        # tile, so the last one is scheduled second (program 1) rather than last, not to run alone at the end.
        w("n_t = (L + T - 1) // T")
        w("tile = tl.where(pid_l == 0, 0, tl.where(pid_l == 1, n_t - 1, pid_l - 1))")
        w("start = tile.to(tl.int64) * T")
    else:
        w("start = pid_l.to(tl.int64) * T")
    # The walk starts ``back`` rows before the program's first row: the bidirectional levels' lag; the causal forward
    # needs rows behind (its levels carry no lag); the causal backward's adjoint only rows ahead.
    back = 0 if (kind == "bwd" and causal) else S
    w(f"p0 = start - {back}")
    w("fz = tl.zeros([BLOCK_C], dtype=tl.float32)")
    w("xrow = X + b64 * sxb + cols")
    if kind == "bwd":
        w("grow = GY + b64 * sgb + cols")
    if has_mask:
        w("mrow = M + b64 * L")
    _coef_lines(w, "a", "A", a_vec)
    if pde in ("reaction_diffusion", "advection_diffusion"):
        _coef_lines(w, "b", "Bc", b_vec)
        w("bp = tl.maximum(b, 0.0)")
        w("bm = tl.minimum(b, 0.0)")
        w("ab = a + b")
    if kind == "bwd" and pde == "advection_diffusion":
        w("a = ab")  # causal advection-diffusion is diffusion with a + b
    lag = back + (S if (kind == "bwd" or not causal) else 0)  # iterations beyond T; output row = q - lag + back
    w(f"n_it = (tl.minimum(L - start, T) + {lag}).to(tl.int32)")
    # (prefix, row pointer, row stride, row offset): iteration q reads row q + offset of each input. The backward
    # reads x at its output row, S rows behind g (see _stream_body).
    srcs = [("x", "xrow", "sxl", 0)] if kind == "fwd" else [("x", "xrow", "sxl", -S), ("g", "grow", "sgl", 0)]
    # prefetch
    for k in range(walk_d):
        for pre, row, stride, off in srcs:
            r = _rows(f"p0 + {k + off}")
            w(f"{pre}f{k} = tl.load({row} + (p0 + {k + off}) * {stride}, mask=cmask & ({r} >= 0) & ({r} < L), "
              f"other=0.0)")
        if has_mask:
            w(f"mf{k} = tl.load(mrow + p0 + {k}, mask=(p0 + {k} >= 0) & (p0 + {k} < L), other=0)")
    if has_init:
        for s in range(S):
            w(f"ini{s} = tl.load(INIT + b64 * {S} * C + {s} * C + cols, mask=cmask, other=0.0)")
    if kind == "bwd":
        w("acc = fz")
        w("end = tl.minimum(start + T, L)")
    nvv = S + 1 if not (causal and kind == "fwd") else 2
    # Programs whose rows (loads, prefetches and validity lookups) all lie inside the sequence run a copy of the loop
    # with no masks and no validity factors: the kernels are instruction-issue bound, and those are most of the
    # instructions. Needs no padding mask and whole channel blocks.
    interior_path = not has_mask and even_c
    carry = []
    general = _stream_body(kind, pde, causal, S, walk_d, has_mask, has_init, write_final, srcs, nvv, carry,
                           depth=3 if interior_path else 2, interior=False)
    # ... and the linear schemes' interior programs run the banded filter instead (``fir_unroll`` > 0: its loop's
    # unroll factor; 0: the walk's interior copy).
    fir = edge = None
    linear = kind == "bwd" or _is_linear(pde, causal, has_init=False)
    tensor_cores = bool(mma) and not a_vec and not b_vec
    if interior_path and (tensor_cores or fir_unroll > 0) and linear:
        fir, edge = _Src(), _Src()
        fir.widen = edge.widen = FIR_WIDEN_ASM and (a_vec or b_vec)
        fir.depth = edge.depth = 2
        if walls == 3:  # one copy of the filter, on the walls' extension, that every program runs
            fir.depth = 1
            if tensor_cores:
                _mma_interior(fir, kind, pde, causal, S, ahead=mma - 1, walls=True)
            else:
                _fir_interior(fir, kind, pde, causal, S, D, fir_unroll, walls="static", table=taps_table)
        elif tensor_cores:
            fir_condition = _mma_interior(fir, kind, pde, causal, S, ahead=mma - 1)
            if walls:
                _mma_interior(edge, kind, pde, causal, S, ahead=mma - 1, walls=True)
        else:
            fir_condition = _fir_interior(fir, kind, pde, causal, S, D, fir_unroll, pointers=pointers,
                                          table=taps_table)
            if walls:  # a rolled loop: few programs run it, and a second unrolled copy cost the interior registers
                _fir_interior(edge, kind, pde, causal, S, D, 1, walls=True, table=taps_table)
        # which end programs may filter: one reflection covers S rows; the causal final state and the rows an
        # initial state reaches are the walk's
        edge_condition = " & ".join(([] if causal else [f"(L >= {S})"])
                                    + (["(start + T < L)"] if write_final and causal else [])
                                    + ([f"(start >= {S})"] if has_init else [])) or "True"
    elif interior_path:
        inner = _stream_body(kind, pde, causal, S, walk_d, has_mask, has_init, write_final, srcs, nvv, [],
                             depth=3, interior=True)
    # initialise the loop-carried state (prefetch registers are loaded above)
    seen = set()
    for v in carry:
        if v in seen or re.match(r"^[xg]f\d+$", v) or re.match(r"^mf\d+$", v):
            seen.add(v)
            continue
        seen.add(v)
        w(f"{v} = fz")
    if fir is not None and walls == 3:
        w.lines += fir.lines
    elif fir is not None:
        w(f"interior = {fir_condition}")
        w("if interior:")
        w.lines += fir.lines
        if walls == 2:  # every other program: no walk in this kernel (it cost the filters registers)
            w("else:")
            w.lines += edge.lines
        elif walls:
            w(f"elif {edge_condition}:")
            w.lines += edge.lines
    elif interior_path:
        lowest = back + max(nvv - 1, S if kind == "bwd" else 0)  # validity lookups; the backward's x rows
        w(f"interior = (start - {lowest} >= 0) & (start - {back} + T + {lag + walk_d} <= L)")
        w("if interior:")
        w("    for j in range(0, n_it):")
        w.lines += inner.lines
    if interior_path and not (fir is not None and walls >= 2):
        w("else:")
        w("    for j in range(0, n_it):")
        w.lines += general.lines
    elif not interior_path:
        w("for j in range(0, n_it):")
        w.lines += general.lines
    src = "\n".join(w.lines)
    if kind == "bwd" and (a_vec or b_vec) and coef_atomic:  # summed in place (relaxed: only the sum is wanted)
        src += (f"\n    tl.atomic_add(DA + ((b64 * n_tiles + pid_l) % n_groups) * C + cols, acc * {S}, mask=cmask, "
                f"sem='relaxed')")
    elif kind == "bwd" and (a_vec or b_vec):  # per-channel partial sums (causal advection's coefficient is a + b)
        src += f"\n    tl.store(DA + (b64 * n_tiles + pid_l) * C + cols, acc * {S}, mask=cmask)"
    elif kind == "bwd":  # a scalar coefficient: one partial sum per program (masked channels hold zeros)
        src += f"\n    tl.store(DA + (b64 * n_tiles + pid_l) * tl.num_programs(0) + pid_c, tl.sum(acc, 0) * {S})"
    return src + "\n"


def _stream_body(kind, pde, causal, S, D, has_mask, has_init, write_final, srcs, nvv, carry, depth, interior):
    """The loop body of :func:`_stream_source` (one row), appending the loop-carried names to ``carry``.
    ``interior``: every row touched is inside the sequence (no masks, validity factors left out)."""
    b = _Src()
    b.depth = depth
    b("q = p0 + j")
    for pre, row, stride, off in srcs:
        b(f"{pre}q = {pre}f0")
        for k in range(D - 1):
            b(f"{pre}f{k} = {pre}f{k + 1}")
        if interior:
            b(f"{pre}f{D - 1} = tl.load({row} + (q + {D + off}) * {stride})")
        else:
            rq = _rows(f"q + {D + off}")
            b(f"{pre}f{D - 1} = tl.load({row} + (q + {D + off}) * {stride}, mask=cmask & ({rq} >= 0) & ({rq} < L), "
              f"other=0.0)")
        carry += [f"{pre}f{k}" for k in range(D)]
    if has_mask:
        b("mq = mf0")
        for k in range(D - 1):
            b(f"mf{k} = mf{k + 1}")
        b(f"mf{D - 1} = tl.load(mrow + (q + {D}), mask=(q + {D} >= 0) & (q + {D} < L), other=0)")
        carry += [f"mf{k}" for k in range(D)]
        b("vq = mq.to(tl.float32)")
    elif not interior:
        b("vq = ((q >= 0) & (q < L)).to(tl.float32)")
    if not interior:
        # Validity of rows q-1..q-nvv+1, recomputed from the row index (and the mask, an L1-resident reload) rather
        # than shifted from iteration to iteration: a chain of loop-carried scalars is what the lagged kernels, wrong
        # on an H200 while exact in the interpreter, had and the lag-free causal forward (which passes there) did not.
        b("vv0 = vq")
        for k in range(1, nvv):
            if has_mask:
                b(f"vv{k} = tl.load(mrow + (q - {k}), mask=(q - {k} >= 0) & (q - {k} < L), other=0).to(tl.float32)")
            else:
                b(f"vv{k} = ((q - {k} >= 0) & (q - {k} < L)).to(tl.float32)")
    store_mask = f"{_rows('ro')} >= start" if interior else f"cmask & ({_rows('ro')} >= start) & ({_rows('ro')} < L)"
    if kind == "fwd":
        b("xn0 = xq.to(tl.float32)")
        if causal:
            _causal_levels(b, "x", pde, 1, S, carry, has_init, interior=interior)
            if write_final and not interior:  # row L-1 is never in an interior program
                b("if q == L - 1:")
                b.depth += 1
                for s in range(S):
                    b(f"tl.store(FIN + b64 * {S} * C + {s} * C + cols, xn{s} * vq, mask=cmask)")
                b.depth -= 1
            b("ro = q")
        else:
            _bidi_levels(b, "x", pde, 1, S, carry, interior=interior)
            b(f"ro = q - {S}")
        b(f"tl.store(Y + (b64 * L + ro) * C + cols, xn{S}.to(Y.dtype.element_ty), mask={store_mask})")
    else:
        # dc = S * <g, L M^(S-1) x> = S * <L^T (M^T)^(S-1) g, x> (L and M commute: M = I + a L). The adjoint walk
        # on g yields the factor at the output row ro = q - S as the last level's flux difference, paired with x
        # read at that row (the x stream lags S rows): no walk on x at all.
        b("gn0 = gq.to(tl.float32)")
        p, n = f"gp{S - 1}", f"gn{S - 1}"  # level S-1 at rows q-S and q-S+1
        if causal:
            # adjoint (anti-causal): level s at row q-s from g rows q-s (p) and q-s+1 (n)
            for s in range(1, S):
                ps, ns = f"gp{s - 1}", f"gn{s - 1}"
                if interior:
                    b(f"gn{s} = {ps} + a * ({ns} - {ps})")
                else:
                    b(f"gn{s} = {ps} + a * vv{s} * ({ns} * vv{s - 1} - {ps})")
                b(f"{ps} = {ns}")
                carry.append(ps)
            b(f"lu = {n} - {p}" if interior else f"lu = vv{S} * ({n} * vv{S - 1} - {p})")  # (L^T u)_ro
        else:
            _bidi_levels(b, "g", "diffusion", 1, S - 1, carry, c="a", interior=interior)
            b(f"gF = {n} - {p}" if interior else f"gF = ({n} - {p}) * vv{S} * vv{S - 1}")  # flux ro -> ro+1
            b("lu = gF - gFl")  # (L u)_ro, L symmetric
            b("gFl = gF")
            carry.append("gFl")
        b(f"gn{S} = {p} + a * lu")
        b(f"{p} = {n}")
        carry.append(p)
        b(f"ro = q - {S}")
        acc_mask = f"{_rows('ro')} >= start" if interior else f"({_rows('ro')} >= start) & ({_rows('ro')} < end)"
        b(f"acc += tl.where({acc_mask}, xq.to(tl.float32) * lu, 0.0)")
        b(f"tl.store(DX + (b64 * L + ro) * C + cols, gn{S}.to(DX.dtype.element_ty), mask={store_mask})")
    return b


# ----------------------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: that is a JITFunction, ~5 us of host time per call outside a kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _halos(causal: bool, steps: int, backward: bool, linear: bool) -> Tuple[int, int]:
    """(left, right) halo rows of a tile."""
    if causal:
        return (steps, steps) if backward else (steps, 0)
    if backward and not linear:
        return 2 * steps, 2 * steps
    return steps, steps


def _config(seq: int, channels: int, halo: int, device: torch.device, causal: bool = False, backward: bool = False):
    """(BLOCK_L, BLOCK_C, num_warps) of the tile kernels. GPU defaults from a sweep on an H200 (bf16,
    (1,16384,4096), 4 diffusion steps), made before the streaming kernels took over the common cases; small tiles in
    the interpreter."""
    if device.type != "cuda":  # interpreter: fewer, larger numpy programs are faster
        block_l = _next_pow2(max(halo + min(seq, 64), 2 * halo + 1, 2))
        block_c = min(_next_pow2(channels), 128)
        return block_l, block_c, 4
    block_l = 64 if backward else 32
    while block_l < 4 * halo and block_l < 256:
        block_l *= 2
    block_l = max(block_l, _next_pow2(halo + 1))
    if block_l <= 64:
        block_c = 128 if causal else 64
    else:
        block_c = max(16, 4096 // block_l)
    block_c = max(16, min(_next_pow2(channels), block_c))
    warps = 8 if (not causal and not backward and block_l * block_c >= 2048) else 4
    return block_l, block_c, warps


def _grid_config(seq, channels, causal, steps, backward, linear, device):
    hl, hr = _halos(causal, steps, backward, linear)
    block_l, block_c, warps = _config(seq, channels, hl + hr, device, causal, backward)
    t = block_l - hl - hr
    if t < 1:
        block_l = _next_pow2(hl + hr + 1)
        t = block_l - hl - hr
    return hl, t, block_l, block_c, warps


def _is_linear(pde: str, causal: bool, has_init: bool) -> bool:
    if has_init:
        return False
    return pde == "diffusion" or (pde == "advection_diffusion" and causal)


def _prep_coef(c: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if c is None:
        return torch.zeros(1, device=like.device, dtype=torch.float32)
    return c.detach().to(device=like.device, dtype=torch.float32).reshape(-1).contiguous()


def _prep_mask(mask: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.zeros(1, device=like.device, dtype=torch.float32)
    return mask.to(device=like.device, dtype=torch.float32).contiguous()


def _channels_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------------------------
# Raw launches (no autograd)
# ----------------------------------------------------------------------------------------------------------------


# Eager calls are host-bound at small sizes (a batch-1 decode step, or a training step of a few thousand tokens):
# Triton's generic launch path (argument binding, specialisation key, cache lookup) costs several times a decode
# kernel and more than the whole forward of a (1, 4096, 4096) tensor. After the first launch of a configuration,
# later ones call the compiled kernel's launcher directly. They are keyed on everything Triton specialises on: the
# kernel and its constexprs, the tensors' dtypes, the integer arguments themselves, and 16-byte alignment of the
# pointers (only the all-aligned case is cached; anything else goes through Triton's own path).
# CTA_DIRECT_LAUNCH=0 turns this off.
DIRECT_LAUNCH = os.environ.get("CTA_DIRECT_LAUNCH", "1") not in ("", "0")
_COMPILED = {}  # launch key -> (Triton's compiled kernel, its launcher: see _launcher)

# Triton 3.6's launcher object (``compiled.run``) is Python around a C function: it allocates the kernel's global and
# profile scratch buffers, then calls ``launch(grid, stream, function, cooperative, pdl, scratch, scratch, *args)``.
# Our kernels need no scratch; calling the C function directly saves that Python: 2.4 of 9.6 us per launch on an H200
# host (benchmarks/results/decode_micro_NVIDIA_H200.txt). Other Triton versions lay the call out differently and keep
# ``compiled.run``.
RAW_C_LAUNCH = triton.__version__.startswith("3.6.") if triton is not None else False


def _active_hook(hook):
    # Recent Triton installs an empty HookChain by default; calling it (and building the launch metadata it would be
    # given) does nothing but cost host time.
    return None if hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls) else hook


def _launch_hooks():
    """Triton's launch enter/exit hooks (profilers set them), passed on as Triton's own launch does."""
    runtime = triton.knobs.runtime
    return _active_hook(runtime.launch_enter_hook), _active_hook(runtime.launch_exit_hook)


def _launcher(compiled):
    """A callable with the signature of ``compiled.run`` (grid x/y/z, stream, function, packed metadata, launch
    metadata, enter and exit hooks, kernel arguments): the C launch function itself where ``RAW_C_LAUNCH`` allows
    (see there), else ``compiled.run``."""
    run = compiled.run
    c_launch = getattr(run, "launch", None)
    if not RAW_C_LAUNCH or c_launch is None or getattr(run, "global_scratch_size", 1) or \
            getattr(run, "profile_scratch_size", 1):
        return run
    cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl

    def launch(grid_x, grid_y, grid_z, stream, function, *args):
        c_launch(grid_x, grid_y, grid_z, stream, function, cooperative, pdl, None, None, *args)

    launch.c_launch = (c_launch, cooperative, pdl)  # for callers that prefer to skip this frame too
    return launch


def _direct_key(kernel, tensors, ints, consts, num_warps):
    """``(key, pointers)``: the key of ``_COMPILED`` for this launch (None where it is not cached: direct launch off,
    CPU tensors, a pointer not 16-byte aligned) and the tensors' addresses."""
    if not (DIRECT_LAUNCH and tensors[0].is_cuda):
        return None, None
    pointers = [t.data_ptr() for t in tensors]
    combined = 0
    for pointer in pointers:
        combined |= pointer
    if combined % 16:
        return None, pointers
    return (kernel, tensors[0].device.index, *[t.dtype for t in tensors], ints, consts, num_warps), pointers


def _launch(kernel, grid, tensors, ints, consts, num_warps):
    """``kernel[grid](*tensors, *ints, *consts, num_warps=num_warps)`` (``consts``: the constexprs, in the order of
    the kernel's signature), through the compiled kernel's launcher once Triton has compiled it for this key."""
    key, pointers = _direct_key(kernel, tensors, ints, consts, num_warps)
    if key is not None:
        cached = _COMPILED.get(key)
        if cached is not None:
            compiled, launcher = cached
            stream = triton.runtime.driver.active.get_current_stream(key[1])
            enter, leave = _launch_hooks()
            metadata = compiled.launch_metadata(grid, stream, *tensors, *ints, *consts) if enter is not None else None
            # Pointers as integers: the launcher then neither calls `data_ptr()` nor asks the driver to validate
            # each pointer (one cuPointerGetAttribute per tensor and launch). They are CUDA tensors' own addresses.
            launcher(grid[0], grid[1], grid[2] if len(grid) > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, metadata, enter, leave, *pointers, *ints, *consts)
            return
    compiled = kernel[grid](*tensors, *ints, *consts, num_warps=num_warps)
    if key is not None and compiled is not None and hasattr(compiled, "packed_metadata"):
        if len(_COMPILED) >= 4096:  # the integer arguments are in the key: many sequence lengths, many entries
            _COMPILED.clear()
        _COMPILED[key] = (compiled, _launcher(compiled))


_STREAM_TUNE = {}  # (kind, causal, steps) -> (T, BLOCK_C, num_warps, D[, U]) overrides, set by benchmarks and tests
USE_STREAM = True  # False: the tile kernels above for every case (kept for comparison)
# The streaming kernels with a row lag per level (bidirectional forward, both linear backwards) once carried the
# validity of the last S+1 rows as a chain of loop-carried scalars; that was exact through the interpreter but wrong
# on an H200 (triton 3.6) for steps >= 2. The flags are now recomputed from the row index, and the GPU parity tests
# pass. CTA_STREAM_LAGGED=0 runs those cases on the tile kernels instead (for comparison and debugging).
STREAM_LAGGED_ON_CUDA = os.environ.get("CTA_STREAM_LAGGED", "1") not in ("", "0")
# Interior programs of the linear schemes run the banded filter (see ``_fir_interior``; an initial state only reaches
# the first S rows, which are never interior); CTA_FIR=0 keeps the walk there (for comparison).
USE_FIR = os.environ.get("CTA_FIR", "1") not in ("", "0")
# Programs at the sequence ends (no padding mask) run the filters too, with the walls as an extension of the input
# (``_wall_load``); CTA_WALLS=0 makes them walk (for comparison).
USE_WALLS = os.environ.get("CTA_WALLS", "1") not in ("", "0")


# (T, BLOCK_C, num_warps, D, U) per (kernel, causal) and tuned step count: the best across three grids on an H200
# (`benchmarks/tune_stream.py`, triton 3.6, bf16, (1, 16384, 4096), diffusion): 480 configurations per key
# (stream_tuning_NVIDIA_H200.json; U = 0 is the walk, so the filter is only chosen where it is faster), then
# unroll factors up to a full unroll of short tiles (stream_tuning_steps8_*.json, stream_tuning_steps124_*.json);
# `tune_stream.py --merge` of the three files prints the forward entries. The backward entries were re-tuned after
# it came to filter g only (stream_tuning_bwd_split_*.json: `--kernels bwd --steps 1,2,4,8 --t-values 16,32 --blocks
# 64:1,128:1,128:2,256:2,256:4 --d-values 2,3 --unroll-values 0,1,16`; the previous entries were 0-11% slower there),
# except the bidirectional one at 4 steps: its best there, (16, 64, 1, 3, 16), timed 2.00x copy against 1.91x for
# the entry kept, with a scalar coefficient (mma_filter_*.json, this run and the one before; the grid's per-channel
# timing had it 3% ahead). On 1x65536x512 (stream_tuning_bwd_narrow_*.json, steps 1, 2, 4) these entries are within
# 0-4% of that shape's best, so there is no per-shape table.
# The forwards at 4 and 8 steps (but the causal one at 4) were re-tuned after the taps took their closed form
# (``_fir_taps``), on the three large shapes, with rows per program around the filter's window and the loop unrolled
# whole (`--kernels fwd --modes bidi,causal --steps 4,8 --t-values 16,17,18,20,22,24,32 --blocks 64:1,128:1,256:2
# --d-values 2,3 --unroll-values T --shape S`, stream_tuning_rows_fwd[_8x4096x4096,_narrow]_*.json): each entry is
# the best mean over the shapes of its multiple of each shape's best (x copy on 1x16384x4096 / 8x4096x4096 /
# 1x65536x512): bidirectional 4 steps 1.189 / 1.173 / 1.197 (16 rows: 1.195 / 1.170 / 1.259), 8 steps 1.389 /
# 1.383 / 1.492 (16 rows: 1.447 / 1.437 / 1.559), causal 8 steps 1.211 / 1.224 / 1.396 (16 rows: 1.284 / 1.243 /
# 1.418). A row or two more than 16 shortens the halo's share; more rows cost more (the window's registers). Rows
# in multiples of the window with the loop unrolled by the window's length, so that its registers rotate back in
# place every pass (stream_tuning_window_{bidi4,bidi8,causal8}_*.json, 1x16384x4096), did not beat 17-27 rows;
# 32 and 64 rows with a 16-fold unroll were slower still (stream_tuning_closed_taps_*.json, 1.65-2.95x at 8
# bidirectional steps).
# The backwards likewise (`--kernels bwd --modes bidi,causal --steps 4,8 --t-values 16,17,18,20,24 --blocks
# 128:1,128:2,256:2 --d-values 2,3 --unroll-values 1,T --shape S`, stream_tuning_rows_bwd_<S>_*.json): only the
# bidirectional one at 8 steps changed, to 24 rows, 2.587 / 2.280 / 2.557x copy against 2.506 / 2.454 / 2.729x (the
# others' entries are within 3% of their best mean); at 4 steps the grid's best, with one warp, is 2-5% faster per
# channel, but a scalar coefficient (the register filter up to 6 steps) was faster with the entry kept (see above),
# so it is an entry of _STREAM_DEFAULTS_PER_CHANNEL.
# kernels_NVIDIA_H200*.md were measured with this table.
# Other step counts use the nearest tuned one (ties: the smaller). Short tiles win: the kernels are latency-bound,
# and more, smaller programs hide more of it. Programs that loop over several tiles (the filter's taps computed once
# per program, fewer coefficient-gradient partial sums) were measured too (commit 928ef44, reverted): 5-22% slower
# forwards and within +-3% on backwards but for two cells 7-10% slower -- the taps held across tiles cost registers.
_STREAM_DEFAULTS = {
    ('fwd', False): {1: (8, 256, 2, 3, 8), 2: (8, 256, 2, 3, 8), 4: (24, 64, 1, 3, 24), 8: (17, 256, 2, 2, 17)},
    ('fwd', True): {1: (8, 256, 2, 3, 8), 2: (8, 128, 1, 3, 16), 4: (8, 256, 2, 3, 8), 8: (18, 256, 2, 2, 18)},
    ('bwd', False): {1: (16, 256, 4, 3, 16), 2: (16, 128, 2, 3, 16), 4: (16, 128, 2, 2, 16), 8: (24, 128, 2, 3, 24)},
    ('bwd', True): {1: (16, 256, 4, 3, 1), 2: (16, 128, 1, 3, 16), 4: (16, 128, 2, 3, 1), 8: (16, 256, 2, 3, 16)},
}
# Entries that differ for a coefficient per channel (the taps then per channel: more registers per program). Nsight
# Compute on an H200 (1x16384x4096, per channel; benchmarks/profile_kernels.py, results/kernel_profile*_H200.txt)
# showed the 4-step bidirectional kernels waiting on loads (long scoreboard: 5.7 and 6.7 cycles per issued
# instruction, backward and forward, 43% and 64% issue) and the 8-step bidirectional forward issue-bound (73% issue,
# 1.3 cycles of long scoreboard): prefetch depths beyond the earlier grids' 2-3 rows. The 4-step bidirectional kernels
# and the 8-step causal backward first (`tune_stream.py --kernels bwd --modes bidi --steps 4 --t-values 16,24,32
# --blocks 64:1,128:1,128:2 --d-values 3,4,6,8 --unroll-values 1,T --shape S`, likewise `--kernels fwd ... --t-values
# 17,24 --blocks 64:1,128:1` and `--kernels bwd --modes causal --steps 8 --t-values 16,24 --blocks 128:1,128:2,256:2
# --d-values 3,4,6`, stream_tuning_prefetch_{bwd_bidi4,fwd_bidi4,bwd_causal8}_<S>_*.json, on the three large shapes),
# then every key from these entries with 24 rows and deeper prefetch (`tune_stream.py --from-defaults --steps 1,2,4,8
# --t-values base,24 --d-values base,4,6,8,12 --shape S`, stream_tuning_prefetch_<S>_*.json). Each entry is the best
# mean over the shapes of its multiple of each shape's best; keys whose default was within 2% of that stay as they
# are. Against the entries before, in the last grid (x copy on 1x16384x4096 / 1x65536x512 / 8x4096x4096):
# bidirectional backward 1 step 1.552 / 1.725 / 1.529 (was 1.572 / 1.804 / 1.550), 2 steps 1.599 / 1.771 / 1.559
# (1.649 / 1.903 / 1.601), 8 steps 2.038 / 2.355 / 2.027 (2.208 / 2.271 / 2.193); causal backward 1 step 1.542 / 1.716
# / 1.526 (1.555 / 1.782 / 1.540), 2 steps 1.564 / 1.721 / 1.535 (1.635 / 1.875 / 1.587); causal forward 1 step 1.024
# / 1.053 / 1.018 (1.031 / 1.092 / 1.035), 4 steps 1.028 / 1.047 / 1.029 (1.070 / 1.072 / 1.070), 8 steps 1.145 /
# 1.198 / 1.126 (1.167 / 1.278 / 1.171); and in the first grids the 4-step bidirectional backward 1.616 / 1.844 /
# 1.585 (1.812 / 2.017 / 1.783), the 8-step causal backward 1.753 / 1.984 / 1.694 (1.866 / 2.070 / 1.808), and the
# 4-step bidirectional forward 1.136 / 1.141 (1.186 / 1.198) on the first two shapes (the third one's file did not
# come back from the GPU). The scalar coefficient keeps _STREAM_DEFAULTS (not re-tuned: it meets its targets).
# With STATIC_ROWS and the widened rows, the 8-step bidirectional kernels again (`tune_stream.py --kernels fwd --modes
# bidi --steps 8 --t-values 17,20,24,34 --blocks 256:2,128:1,512:4 --d-values 2,4,8 --unroll-values T --shape S`,
# then `--t-values 17,24,34,48 --blocks 128:2,256:4,64:1`; backward `--t-values 24,32,48[,64] --blocks
# 128:2,256:2,128:1[,64:1,256:4,64:2] --d-values 4,8[,12]`, stream_tuning_static[2]_{fwd,bwd}_bidi8_<S>_*.json on
# 1x16384x4096 and 1x65536x512), then the candidates paired on the three large shapes (`bench_scalar_coefficients.py
# --compare configs`, results/stream_configs_per_channel_NVIDIA_H200.json): forward (17, 256, 2, 4, 17) 1.250 / 1.256
# / 1.475x copy (1x16384x4096 / 8x4096x4096 / 1x65536x512, the last one with the tiles out of order, see
# LAST_TILE_SECOND) against 1.279 / 1.330 / 1.309x for (34, 128, 2, 4, 34); backward (24, 128, 2, 8, 24) 1.756 /
# 1.764 / 1.941x against 1.736 / 1.790 / 1.995x for (48, 128, 2, 8, 48) and 1.822 / 1.822 / 2.069x for the entry
# before. Programs of 34 rows with 4 channels per thread were slower (1.50x): the code of a fully unrolled program
# grows with rows x channels per thread. With the forward's ends filtering (see ``_walls_mode``), its grid again
# (`tune_stream.py --kernels fwd --modes bidi --steps 8 --t-values 17,24,34 --blocks 256:2,128:2,128:1,512:4
# --d-values 2,4,8 --unroll-values T --shape S`, stream_tuning_walls_fwd_bidi8_<S>_*.json): the entry stays best on
# 1x16384x4096 and 8x4096x4096 and is within 0.3% of it on 1x65536x512. Tried and slower, paired (--compare
# configs): 18 and 16 rows (stream_configs_waves_per_channel_*.json and, ends filtering,
# stream_configs_walls_per_channel_*.json: 18 rows 1.193 / 1.174 / 1.234x against 1.190 / 1.176 / 1.229x), chosen
# for whole waves of resident programs; and programs that loop over 34-68 rows, 17 unrolled per iteration, whose
# taps and halo cost less per row (about 22 instructions per element instead of 24, counted in the SASS) --
# 1.34-1.94x copy with 4 rows prefetched or a whole next iteration's 17 (stream_configs_loops[_prefetch]_*.json),
# likewise for backwards of 32-96 rows (1.84-2.70x against 1.73-1.97x): the short, fully unrolled programs issue
# all their loads at once.
_STREAM_DEFAULTS_PER_CHANNEL = {
    ('fwd', False): {4: (24, 64, 1, 8, 24), 8: (17, 256, 2, 4, 17)},
    ('fwd', True): {1: (8, 256, 2, 8, 8), 4: (8, 256, 2, 8, 8), 8: (24, 256, 2, 12, 24)},
    ('bwd', False): {1: (24, 256, 4, 8, 24), 2: (24, 128, 2, 8, 24), 4: (24, 128, 2, 8, 24), 8: (24, 128, 2, 8, 24)},
    ('bwd', True): {1: (24, 256, 4, 12, 1), 2: (24, 128, 1, 12, 24), 8: (24, 128, 2, 6, 24)},
}
# The walk's rows (padding masks, some sequence ends) keep at most this prefetch depth: its loop is not unrolled, so
# every prefetch register moves once per row (the depths above were measured on the filters' unrolled loops).
WALK_MAX_PREFETCH = 3


# Interior tiles of the linear schemes with a scalar coefficient (the models' default) and bf16/fp16 inputs run the
# filter on tensor cores (``_mma_interior``) from MMA_MIN_STEPS[(kind, causal)] to MMA_MAX_STEPS steps (None: never);
# CTA_MMA=0 keeps the register filter everywhere. The thresholds come from a paired run of both filters on an H200
# (``bench_scalar_coefficients.py --compare mma --steps 1,2,3,4,5,6,7,8``, results/mma_filter_NVIDIA_H200.json,
# 1x16384x4096): the tensor-core forward is 1.08-1.14x copy at every step count and wins from 3 steps (1.13 vs 1.16x
# bidirectional, 1.08 vs 1.10x causal; 1.11 vs 1.40x and 1.10 vs 1.26x at 8). Its backward (two filters on the g
# blocks, x through an identity MMA) is 2.08-2.20x copy; the register filter, which also reads x at the output row
# only, is ahead but for 8 bidirectional steps (2.16 vs 2.27x; 2.13 vs 2.10x at 7), and the causal one always
# (1.61-1.89x). Since the end programs filter too (``_walls_mode``), the bidirectional backward's threshold and
# programs come from the three large shapes (bench_mma_backward_shapes.py --steps 6,7,8 --modes bidi,
# mma_backward_shapes_*.json): with 128-row programs the MMA backward is 1.96 / 1.91 / 2.14x copy at 7 steps and
# 1.97 / 1.90 / 2.14x at 8 on 1x16384x4096 / 8x4096x4096 / 1x65536x512, against the register filter's 2.26 / 2.30 /
# 2.28x and 2.38 / 2.40 / 2.38x; at 6 steps the registers win (1.89 / 1.88 / 1.93x against 1.97 / 1.90 / 2.16x)
# (the backward's programs were re-tuned since, see ``_MMA_DEFAULTS``: the 7-step threshold was not re-measured with
# them).
USE_MMA = os.environ.get("CTA_MMA", "1") not in ("", "0")
MMA_MIN_STEPS = {("fwd", False): 3, ("fwd", True): 3, ("bwd", False): 7, ("bwd", True): None}
# (T, BLOCK_C, num_warps, D, A) of its programs (D: the prefetch depth of any walk in the kernel; A: input blocks
# loaded ahead, see ``_mma_blocks``), T a multiple of MMA_BLOCK. Bidirectional: the best on all three large shapes of
# one grid at 8 steps, since the forward runs one copy (`tune_stream.py --mma --kernels fwd,bwd --modes bidi --steps 8
# --shape S --t-values 32,64,128,256 --blocks 64:2,64:4,128:2,128:4,256:4 --d-values 2 --unroll-values 0,1,2`,
# stream_tuning_mma_{1x16384x4096,8x4096x4096,narrow}_*.json, the last one 1x65536x512): forward 32 x 256, 4 warps,
# two blocks ahead, 1.046 / 1.037 / 1.079x copy on 1x16384x4096 / 8x4096x4096 / 1x65536x512 against 1.097 / 1.086 /
# 1.177x for the entry before (none ahead); backward 256 x 128 with 2 warps (a warp count the earlier grids left out),
# 1.751 / 1.728 / 1.881x against 1.982 / 1.904 / 2.217x for 128 x 128 with 4 warps. They apply at every step count the
# filter takes, measured at 8 only. Causal forward: the best of `tune_stream.py --mma` at 4 and 8 steps on
# 1x16384x4096 (stream_tuning_mma_ahead_*.json); the causal backward (off by default) keeps the bidirectional
# backward's entry before.
# ``_STREAM_TUNE`` entries ``(kind + "_mma", causal, steps)`` override them (A may be left out, then 0).
_MMA_DEFAULTS = {
    ("fwd", False): (32, 256, 4, 2, 2), ("fwd", True): (32, 128, 4, 2, 1),
    ("bwd", False): (256, 128, 2, 2, 1), ("bwd", True): (128, 128, 4, 2, 1),
}


def _mma_ok(x: torch.Tensor, kind: str, causal: bool, a_vec: bool, b_vec: bool, has_mask: bool, steps: int,
            linear: bool) -> bool:
    """Whether a streaming launch takes the tensor-core filter for its interior tiles."""
    if not (USE_MMA and linear) or a_vec or b_vec or has_mask or steps > MMA_MAX_STEPS:
        return False
    first = MMA_MIN_STEPS.get((kind, bool(causal)))
    return (first is not None and steps >= first and x.dtype in (torch.bfloat16, torch.float16)
            and (x.is_cuda or _interpret()))


def _stream_config(seq: int, channels: int, steps: int, causal: bool, kind: str, device: torch.device,
                   per_channel: bool = False):
    """(T, BLOCK_C, num_warps, D, U) of the streaming kernels: rows per program, channels per program, warps, prefetch
    depth, and the banded filter's loop unroll factor (0: no filter; unrolling lets the compiler rename the window's
    registers instead of copying them row to row). ``_STREAM_TUNE`` (set by benchmarks and tests) overrides the
    defaults above (``_STREAM_DEFAULTS_PER_CHANNEL`` over ``_STREAM_DEFAULTS`` for a ``per_channel`` coefficient);
    its entries may leave out U (then 1)."""
    key = (kind, causal, steps)
    if key in _STREAM_TUNE:
        cfg = _STREAM_TUNE[key]
    elif device.type != "cuda":  # interpreter: one program per sequence and channel block (fewest interpreted steps)
        cfg = (max(seq, 1), min(_next_pow2(channels), 256), 1, 2, 1)
    else:
        cfg = _default_entry(kind, causal, steps, per_channel)
    t, block_c = _fit_program(seq, channels, *cfg[:2])
    unroll = (cfg[4] if len(cfg) > 4 else 1) if USE_FIR else 0
    return t, block_c, cfg[2], cfg[3], unroll


def _default_entry(kind: str, causal: bool, steps: int, per_channel: bool) -> tuple:
    """The default (T, BLOCK_C, num_warps, D, U) of a register-filter launch: the entry of the nearest tuned step
    count (ties: the smaller), ``_STREAM_DEFAULTS_PER_CHANNEL``'s over ``_STREAM_DEFAULTS``' for a ``per_channel``
    coefficient."""
    table = _STREAM_DEFAULTS[(kind, bool(causal))]
    tuned = min(table, key=lambda tuned: (abs(tuned - steps), tuned))
    overrides = _STREAM_DEFAULTS_PER_CHANNEL.get((kind, bool(causal)), {}) if per_channel else {}
    return overrides.get(tuned, table[tuned])


def _fit_program(seq: int, channels: int, t: int, block_c: int) -> Tuple[int, int]:
    """(T, BLOCK_C) of a configuration fitted to the input: rows doubled until the grid's second axis fits (65535),
    channels within [16, the next power of two of ``channels``]."""
    while _cdiv(seq, t) > 65535:
        t *= 2
    return t, max(16, min(block_c, _next_pow2(channels)))


def _is_per_channel(c: Optional[torch.Tensor], channels: int) -> bool:
    """Whether a coefficient has one value per channel (else it is a scalar, or absent)."""
    return c is not None and c.dim() == 1 and c.shape[0] == channels


def _coef_arg(c: Optional[torch.Tensor], like: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """A coefficient as the kernels read it (any float dtype, converted to fp32 in the kernel): (tensor, is_vector).
    A scalar stays a scalar: the filter taps are then scalars too, computed once per program instead of once per
    channel, and no per-call expansion kernel runs. Paired on an H200 against a scalar expanded to one value per
    channel (``benchmarks/bench_scalar_coefficients.py``, ``results/scalar_coefficients_NVIDIA_H200.json``): 5-13%
    faster at 8 steps, 3-6% at 4, and within 3% at 1-2 (never more than 0.5% slower)."""
    if c is None:
        return like, False
    if _is_per_channel(c, like.shape[-1]):
        if c.stride(0) != 1:
            c = c.contiguous()
        return c, True
    return c.reshape(1), False


def _mask_arg(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    if not mask.is_contiguous():
        mask = mask.contiguous()
    return mask


def _stream_plan(x, kind, steps, causal, a_vec, b_vec, has_mask, linear):
    """(T, BLOCK_C, num_warps, D, U, mma) of one streaming launch: the tensor-core filter's programs where it applies
    and the channels fill whole blocks of them (``mma`` = 1 + blocks loaded ahead), the register filter's otherwise
    (``mma`` = 0)."""
    _, seq, channels = x.shape
    if _mma_ok(x, kind, causal, a_vec, b_vec, has_mask, steps, linear):
        cfg = _STREAM_TUNE.get((kind + "_mma", causal, steps)) or _MMA_DEFAULTS[(kind, bool(causal))]
        t, block_c = _fit_program(seq, channels, *cfg[:2])
        if channels % block_c == 0 and t % MMA_BLOCK == 0:
            return t, block_c, cfg[2], cfg[3], 0, 1 + (cfg[4] if len(cfg) > 4 else 0)
    return (*_stream_config(seq, channels, steps, causal, kind, x.device, a_vec or b_vec), 0)


# The most steps at which per-channel launches filter their ends, per (kernel, causal); above, they walk them (see
# ``_walls_mode``). The benchmark's --compare walls lifts them all to MAX_FUSED_STEPS.
WALLS_MAX_STEPS_PER_CHANNEL = {("fwd", False): 8, ("fwd", True): 8, ("bwd", False): 8, ("bwd", True): 4}
# Forward launches where every program, interior or not, runs one copy of the filter on the walls' extension
# (``_walls_mode`` 3: no interior branch; the register filter loops over all T rows and masks the stores past the
# end), keyed (causal, tensor cores). An H200 probe that dropped the end programs' branch altogether (wrong at the
# ends, timing only, not kept) ran the bidirectional forwards several percent faster: the branch costs the interior
# programs. One copy with the walls' loads everywhere pays for those loads instead; paired on the three large shapes
# (``bench_scalar_coefficients.py --compare one-copy [--per-channel]``, results/walls_one_copy*_NVIDIA_H200.json)
# it wins for the bidirectional tensor-core forward at 8 steps (1.110 / 1.101 / 1.135x copy against 1.145 / 1.153
# / 1.157x on 1x16384x4096 / 8x4096x4096 / 1x65536x512) and ties at 4 (1.118 / 1.107 / 1.145 against 1.120 /
# 1.110 / 1.131); the causal one ties (1.03-1.05x both); the register filter loses bidirectionally (per channel,
# 8 steps: 1.97-2.18 against 1.55-1.60x; 2 steps scalar: 1.04-1.09 against 1.02-1.03x) and ties causally. Again
# with STATIC_ROWS (walls_one_copy_per_channel_static_rows_*.json, --per-channel --steps 8), the bidirectional
# per-channel forward: 1.646 / 1.660 / 1.642x against 1.265 / 1.265 / 1.376x with its ends walking.
WALLS_ONE_COPY = {(False, True)}


def _walls_mode(kind: str, seq: int, steps: int, causal: bool, has_init: bool, write_final: bool,
                per_channel: bool, one_copy: bool = False) -> int:
    """How the programs at the sequence ends run (``_stream_source``'s ``walls``): 0 walk, 1 filter where the walls'
    extension applies and walk elsewhere, 2 filter (it applies to every program), 3 as 2 with one copy of the filter
    that every program runs (``one_copy``, a forward in ``WALLS_ONE_COPY``).

    Paired on an H200 (``bench_scalar_coefficients.py --compare walls``, results/walls_filter*_NVIDIA_H200.json,
    8x4096x4096 and 1x16384x4096): with a scalar coefficient the kernels are faster or at most 3.3% slower at
    every step count (8 bidirectional steps on 8x4096x4096: forward 1.14 vs 1.19x copy, backward 2.11 vs 2.37x).
    With one per channel, up to 4 steps likewise. At 8 steps the second copy of the filter (its per-channel taps and
    window) made the interior programs slower; re-measured since the taps' closed form
    (walls_filter_per_channel_*.json, --steps 4,8 on 1x16384x4096 / 8x4096x4096 / 1x65536x512), the ends' filter
    wins at 8 steps for the causal forward (1.171 / 1.171 / 1.274x copy against 1.221 / 1.229 / 1.374x) and the
    bidirectional backward (2.469 / 2.178 / 2.381x against 2.582 / 2.300 / 2.556x), and loses for the bidirectional
    forward (1.512 / 1.522 / 1.525x against 1.389 / 1.395 / 1.459x) and the causal backward (2.104 / 2.052 /
    2.310x against 2.054 / 1.966 / 2.279x). Since the constant row offsets (``STATIC_ROWS``) and widened rows, the
    bidirectional forward's ends filter at 8 steps too (walls_filter_per_channel_static_rows_*.json, --steps 8:
    1.185 / 1.177 / 1.266x against 1.262 / 1.288 / 1.369x walking; the ends' copy of the filter is a rolled loop,
    so the code grows little); the causal backward, within 1% there (1.608 / 1.570 / 1.813x against 1.606 / 1.592
    / 1.832x), keeps its limit. So per-channel launches above ``WALLS_MAX_STEPS_PER_CHANNEL[(kind, causal)]``
    steps walk (5-7 and 9-16 steps were not measured)."""
    limit = WALLS_MAX_STEPS_PER_CHANNEL[(kind, bool(causal))]
    if not USE_WALLS or (per_channel and steps > limit and not one_copy):
        return 0
    if not causal and seq < steps:  # one reflection covers S rows: no program of this launch can filter its ends
        return 0
    if has_init or (causal and write_final):  # the programs the state reaches walk, the others filter
        return 1
    return 3 if one_copy else 2


# Register-filter launches, keyed (kernel, causal, per-channel coefficient), whose end programs take longer than an
# interior tile (they walk: a per-channel coefficient above WALLS_MAX_STEPS_PER_CHANNEL, a causal state; or they run
# the walls' filter as a rolled loop) run the last row tile second, as the tensor-core filter's launches do; the
# others run the tiles in order. Paired on an H200 (``bench_scalar_coefficients.py --compare last-tile
# --per-channel``, 1x16384x4096 / 8x4096x4096 / 1x65536x512): first with walking ends only
# (results/last_tile_per_channel_NVIDIA_H200.json), the 8-step causal backward 1.614 / 1.594 / 1.796x copy against
# 1.712 / 1.643 / 2.012x in order; then with the filtering ends too (last_tile_walls_per_channel_*.json, --steps
# 4,8): the bidirectional backward 1.546 / 1.548 / 1.695x against 1.589 / 1.547 / 1.793x at 4 steps and 1.719 /
# 1.723 / 1.920x against 1.759 / 1.742 / 1.966x at 8, the causal forward 1.027 / 1.019 / 1.011x against 1.029 /
# 1.017 / 1.055x at 4 and 1.087 / 1.098 / 1.116x against 1.113 / 1.092 / 1.126x at 8. The bidirectional forward
# keeps the order: 1.184 / 1.165 / 1.290x against 1.191 / 1.176 / 1.244x (on 1x65536x512 it has lost each time,
# also in five rounds with walking ends, last_tile_per_channel_narrow_*.json: 1.448 against 1.339x; I did not find
# why). The scalar coefficient's launches were not measured and keep the order.
LAST_TILE_SECOND = frozenset({("bwd", True, True), ("bwd", False, True), ("fwd", True, True)})
_SOURCE_DEFAULTS = (True, True, LAST_TILE_SECOND)  # FIR_CLOSED_FORM_TAPS, FIR_WIDEN_ASM, LAST_TILE_SECOND

# Launches, keyed (kernel, causal, per-channel coefficient), whose register filter takes the channels and row strides
# as constexprs (``_stream_source``'s ``static_rows``): its unrolled rows then load and store at constant offsets
# from one pointer, with no address arithmetic per row (one kernel per channel count and row stride). Paired on an
# H200 with the rows widened by ``_widen`` (``bench_scalar_coefficients.py --compare rows --per-channel --steps 4,8``,
# results/fir_rows_per_channel_NVIDIA_H200.json, x copy on 1x16384x4096 / 8x4096x4096 / 1x65536x512): the 8-step
# bidirectional forward 1.275 / 1.243 / 1.333 against 1.341 / 1.322 / 1.407 (both off: 1.362 / 1.342 / 1.420), its
# backward 1.831 / 1.795 / 2.035 against 1.889 / 1.855 / 2.094, the 8-step causal backward 1.706 / 1.629 / 1.931
# against 1.730 / 1.663 / 1.954; at 4 steps within 1% but for the causal forward (1.056 / 1.048 / 1.014 against
# 1.025 / 1.018 / 1.029), which keeps its strides as arguments.
STATIC_ROWS = {("fwd", False, True), ("bwd", False, True), ("bwd", True, True)}
STATIC_ROWS_ON = os.environ.get("CTA_STATIC_ROWS", "1") not in ("", "0")


def _static_rows(kind: str, causal: bool, per_channel: bool, unroll: int, mma: int) -> bool:
    return STATIC_ROWS_ON and unroll > 0 and not mma and (kind, bool(causal), bool(per_channel)) in STATIC_ROWS


# Launches, keyed (kernel, causal), whose register filters load their per-channel taps from a table that one small
# kernel writes first (``_taps_kernel``: [levels + 1, channels] fp32) instead of each program computing them for its
# channels (about 45 operations per channel at 8 bidirectional levels, over 17-24 rows; diffusion only: causal
# advection-diffusion filters with a + b). None by default: paired on an H200 (``bench_scalar_coefficients.py
# --compare taps-table --steps 2,4,8``, results/taps_table_NVIDIA_H200.json, 1x16384x4096 / 8x4096x4096 /
# 1x65536x512), every kernel was slower with the table, the 8-step bidirectional forward 1.340 / 1.275 / 1.447x copy
# against 1.264 / 1.257 / 1.331x computed, its backward 1.792 / 1.769 / 2.040x against 1.763 / 1.747 / 1.917x: the
# taps' loads wait at the start of every program, where their arithmetic overlapped the rows' loads, and the table
# is one more launch. Kept for that comparison.
TAPS_TABLE = set()
TAPS_TABLE_BLOCK = 1024  # channels per program of the taps kernel


def _taps_table(kind, pde, causal, steps, per_channel, has_mask, even_c, unroll, mma) -> int:
    """The levels of the taps table a launch reads (0: none; see ``TAPS_TABLE``): the forward's filter has ``steps``
    levels, the backward's ``steps - 1``."""
    levels = steps if kind == "fwd" else steps - 1
    if (kind, bool(causal)) not in TAPS_TABLE or pde != "diffusion" or not per_channel or has_mask or not even_c:
        return 0
    return levels if unroll > 0 and not mma and levels > 0 else 0


def _fir_taps_table(a: torch.Tensor, levels: int, causal: bool) -> torch.Tensor:
    """``TAPS[levels + 1, channels]``: the taps of ``levels`` levels for the per-channel coefficient ``a``."""
    channels = a.shape[0]
    taps = torch.empty((levels + 1, channels), device=a.device, dtype=torch.float32)
    _launch(_taps_kernel(causal, levels), (_cdiv(channels, TAPS_TABLE_BLOCK), 1, 1), (a, taps), (channels,),
            (TAPS_TABLE_BLOCK,), 4)
    return taps


def _stream_fwd(x, y, fin, alpha, beta, mask, init, pde, steps, causal, want_final):
    batch, seq, channels = x.shape
    a, a_vec = _coef_arg(alpha, x)
    b, b_vec = _coef_arg(beta, x)
    m = _mask_arg(mask)
    has_init = init is not None
    t, block_c, warps, d, unroll, mma = _stream_plan(x, "fwd", steps, causal, a_vec, b_vec, m is not None,
                                                     _is_linear(pde, causal, has_init))
    ini = init.to(device=x.device, dtype=torch.float32).contiguous() if has_init else x
    write_final = bool(causal and want_final)
    one_copy = (bool(causal), mma > 0) in WALLS_ONE_COPY
    static = _static_rows("fwd", causal, a_vec or b_vec, unroll, mma)
    even_c = channels % block_c == 0
    levels = _taps_table("fwd", pde, causal, steps, a_vec, m is not None, even_c, unroll, mma)
    kernel = _gen_kernel(("fwd", pde, bool(causal), steps, d, m is not None, a_vec, b_vec,
                          has_init and bool(causal), write_final, even_c, unroll, mma,
                          _walls_mode("fwd", seq, steps, causal, has_init and bool(causal), write_final, a_vec or b_vec,
                                      one_copy), False, ("fwd", bool(causal), a_vec or b_vec) in FIR_POINTER_STEPS,
                          static, levels > 0))
    taps = _fir_taps_table(a, levels, causal) if levels else x
    grid = (_cdiv(channels, block_c), _cdiv(seq, t), batch)
    ints, consts = _stream_args("fwd", static, t, block_c, L=seq, C=channels, sxb=x.stride(0), sxl=x.stride(1))
    _launch(kernel, grid, (x, y, m if m is not None else x, a, b, ini, fin if write_final else x, taps), ints, consts,
            warps)


def _stream_bwd_ok(pde: str, causal: bool, has_init: bool, device: torch.device) -> bool:
    return USE_STREAM and (device.type != "cuda" or STREAM_LAGGED_ON_CUDA) and _is_linear(pde, causal, has_init)


# A per-channel coefficient's gradient: each backward program adds its partial sums with atomics into one of a few
# [channels] rows (COEF_GRAD_ATOMIC), instead of writing a row of [tiles, channels] partial sums that a second kernel
# reduces. Those partial sums are 4 bytes per channel and program, 1/8 of the input's bytes at 16 rows per program
# (2-byte inputs), written once and read once. Programs take the rows in turn, so that about
# COEF_GRAD_ATOMIC_SPREAD addresses share the atomics (few channels on one address each would queue them up); the
# rows are then summed. The atomics' order varies from run to run, so the sum may differ in its last bits between
# runs; under ``torch.use_deterministic_algorithms(True)`` the partial sums are kept (a fixed order).
# CTA_COEF_ATOMIC=0 keeps them always. Paired on an H200 with the per-channel entries above
# (``bench_scalar_coefficients.py --compare coef-atomic``, results/coef_grad_atomic_NVIDIA_H200.json, eager launches,
# steps 1-8, both modes): 1.53-2.06x copy against 1.68-2.52x on 1x16384x4096 and 8x4096x4096; on 1x65536x512 a
# gain but for the 1- and 2-step causal backwards (2.14 / 1.94x against 1.85 / 1.87x, host time included; in the
# CUDA-graph sweep these cells' forward+backward fell from 2.87 / 3.00x to 2.53 / 2.58x with the new entries). The
# spread: with the entries before, 2048, 8192 and 32768 addresses (coef_grad_atomic_spreads_NVIDIA_H200.json) gave
# 4096 channels 1, 2 and 8 rows, and 512 channels 4, 16 and 64. One row was the fastest on the 4096-channel shapes
# at 1 step and for the causal backwards, and within 4% elsewhere; on 1x65536x512, 4 rows were slower than 16 or 64
# (1-step bidirectional: 1.829x against 1.743 / 1.757x, partial sums 1.974x). 4096 addresses: 1 row and 8.
COEF_GRAD_ATOMIC = os.environ.get("CTA_COEF_ATOMIC", "1") not in ("", "0")
COEF_GRAD_ATOMIC_SPREAD = 4096


# Where there are several rows (fewer than 4096 channels), they are summed by one small Triton kernel rather than
# torch's ``sum(0)``, whose reduction kernel was slower than that little work needs in a profile of one CUDA-graph
# forward+backward of 1x65536x512 (not kept). Paired (``bench_scalar_coefficients.py --compare coef-sum --steps
# 1,4,8 --shape 1x65536x512 --rounds 5``, results/coef_grad_sum_NVIDIA_H200.json, eager launches), the backwards
# read 1.673-1.900x copy against 1.690-1.940x. CTA_COEF_SUM_KERNEL=0: torch's sum. One row for 512 channels
# (COEF_GRAD_ATOMIC_SPREAD = 512) needs no sum at all, but its atomics queue up: in a CUDA-graph probe (not kept)
# it was slower in GPU time, though faster in eager launches (coef_grad_atomic_spreads_narrow_NVIDIA_H200.json,
# one launch fewer).
COEF_GRAD_SUM_KERNEL = os.environ.get("CTA_COEF_SUM_KERNEL", "1") not in ("", "0")
SUM_ROWS_BLOCK = 512


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows.sum(0)`` of a contiguous fp32 ``[n, channels]`` (``_sum_rows_kernel``, or torch's reduction)."""
    if not COEF_GRAD_SUM_KERNEL:
        return rows.sum(0)
    n, channels = rows.shape
    out = torch.empty(channels, device=rows.device, dtype=torch.float32)
    _launch(_sum_rows_kernel, (_cdiv(channels, SUM_ROWS_BLOCK), 1, 1), (rows, out), (n, channels), (SUM_ROWS_BLOCK,), 4)
    return out


def _coef_grad_groups(channels: int, programs: int) -> int:
    """Rows of the atomics' [rows, channels] sum: a power of two giving about ``COEF_GRAD_ATOMIC_SPREAD``
    addresses, or one row per program (``programs``) where there are fewer programs."""
    return max(1, min(_next_pow2(_cdiv(COEF_GRAD_ATOMIC_SPREAD, channels)), programs))


def _stream_bwd(gy, x, dx, alpha, beta, mask, pde, steps, causal):
    """Runs the streaming backward; returns the gradient of the kernel's coefficient summed to [channels] when it is
    per channel, to [1] when it is a scalar (each program then writes one partial sum, not one per channel: at
    1x16384x4096 and 16 rows per program, 128 KB instead of 16 MB written and reduced)."""
    batch, seq, channels = x.shape
    a, a_vec = _coef_arg(alpha, x)
    b, b_vec = _coef_arg(beta, x)
    m = _mask_arg(mask)
    t, block_c, warps, d, unroll, mma = _stream_plan(x, "bwd", steps, causal, a_vec, b_vec, m is not None, True)
    n_tiles = _cdiv(seq, t)
    per_channel = a_vec or b_vec
    static = _static_rows("bwd", causal, per_channel, unroll, mma)
    atomic = per_channel and COEF_GRAD_ATOMIC and not torch.are_deterministic_algorithms_enabled()
    groups = _coef_grad_groups(channels, batch * n_tiles) if atomic else 1
    if atomic:
        da = torch.zeros((groups, channels), device=x.device, dtype=torch.float32)
    else:
        partial = channels if per_channel else _cdiv(channels, block_c)
        da = torch.empty((batch * n_tiles, partial), device=x.device, dtype=torch.float32)
    even_c = channels % block_c == 0
    levels = _taps_table("bwd", pde, causal, steps, a_vec, m is not None, even_c, unroll, mma)
    kernel = _gen_kernel(("bwd", pde, bool(causal), steps, d, m is not None, a_vec, b_vec,
                          False, False, even_c, unroll, mma,
                          _walls_mode("bwd", seq, steps, causal, False, False, a_vec or b_vec), atomic,
                          ("bwd", bool(causal), per_channel) in FIR_POINTER_STEPS, static, levels > 0))
    taps = _fir_taps_table(a, levels, causal) if levels else x
    grid = (_cdiv(channels, block_c), n_tiles, batch)
    ints, consts = _stream_args("bwd", static, t, block_c, L=seq, C=channels, sxb=x.stride(0), sxl=x.stride(1),
                                sgb=gy.stride(0), sgl=gy.stride(1), n_tiles=n_tiles, n_groups=groups)
    _launch(kernel, grid, (gy, x, dx, m if m is not None else x, a, b, da, taps), ints, consts, warps)
    if atomic:
        return da[0] if groups == 1 else _sum_rows(da)
    return da.sum(0) if per_channel else da.sum().reshape(1)


def _coef_grad_shape(c: Optional[torch.Tensor], channels: int) -> Tuple[int]:
    """Shape of a coefficient's gradient as the backward returns it: [channels] for a per-channel coefficient, [1]
    for a scalar or an absent one."""
    return (channels,) if _is_per_channel(c, channels) else (1,)


def _fit_coef_grad(g: torch.Tensor, c: Optional[torch.Tensor], channels: int) -> torch.Tensor:
    """``g`` (per channel or one value) summed as far as ``c``'s gradient shape."""
    return g if g.shape == _coef_grad_shape(c, channels) else g.sum().reshape(1)


def _launch_fwd(x, alpha, beta, mask, init, pde, steps, causal, want_final):
    x = _channels_contiguous(x)
    batch, seq, channels = x.shape
    y = torch.empty((batch, seq, channels), device=x.device, dtype=x.dtype)
    if causal and want_final:
        fin = x.new_zeros((batch, steps, channels), dtype=torch.float32)
    else:  # nothing to fill: an empty tensor costs no fill dispatch
        fin = x.new_empty((batch, 0, channels), dtype=torch.float32)
    if y.numel() == 0:
        return y, fin
    if USE_STREAM and (causal or not x.is_cuda or STREAM_LAGGED_ON_CUDA):
        _stream_fwd(x, y, fin, alpha, beta, mask, init, pde, steps, causal, want_final)
        return y, fin
    hl, t, block_l, block_c, warps = _grid_config(seq, channels, causal, steps, False, False, x.device)
    a = _prep_coef(alpha, x)
    b = _prep_coef(beta, x)
    m = _prep_mask(mask, x)
    has_init = init is not None
    ini = init.to(device=x.device, dtype=torch.float32).contiguous() if has_init else a
    grid = (_cdiv(seq, t), _cdiv(channels, block_c), batch)
    _pde_fwd_kernel[grid](
        x, y, m, a, b, ini, fin if fin.numel() else a,
        seq, channels, x.stride(0), x.stride(1),
        PDE=_PDE_IDS[pde], CAUSAL=bool(causal), STEPS=steps,
        HAS_MASK=mask is not None, A_VEC=a.numel() > 1, B_VEC=b.numel() > 1,
        HAS_INIT=has_init, WRITE_FINAL=bool(causal and want_final and steps > 0),
        HL=hl, T=t, BLOCK_L=block_l, BLOCK_C=block_c, num_warps=warps,
    )
    return y, fin


def _launch_bwd(gy, x, alpha, beta, mask, init, pde, steps, causal, need_db=True):
    """(dx, dalpha summed to ``_coef_grad_shape(alpha)``, dbeta likewise). ``need_db=False`` (eager autograd without
    a ``beta``) returns None for dbeta of the streaming kernels instead of filling a tensor of zeros."""
    x = _channels_contiguous(x)
    gy = _channels_contiguous(gy)
    batch, seq, channels = x.shape
    dx = torch.empty((batch, seq, channels), device=x.device, dtype=x.dtype)
    linear = _is_linear(pde, causal, init is not None)
    if dx.numel() > 0 and steps > 0 and _stream_bwd_ok(pde, causal, init is not None, x.device):
        dc = _stream_bwd(gy, x, dx, alpha, beta, mask, pde, steps, causal)
        da = _fit_coef_grad(dc, alpha, channels)
        if pde == "advection_diffusion":  # causal advection-diffusion is diffusion with a + b: d/db = d/da
            db = _fit_coef_grad(dc, beta, channels)
            return dx, da, (db.clone() if db is da else db)  # (a custom op may not return one tensor twice)
        if not need_db:
            return dx, da, None
        return dx, da, torch.zeros(_coef_grad_shape(beta, channels), device=x.device, dtype=torch.float32)
    hl, t, block_l, block_c, warps = _grid_config(seq, channels, causal, steps, True, linear, x.device)
    n_tiles = _cdiv(seq, t)
    da = torch.zeros((batch * n_tiles, channels), device=x.device, dtype=torch.float32)
    db = torch.zeros((batch * n_tiles, channels), device=x.device, dtype=torch.float32)
    if dx.numel() > 0:
        a = _prep_coef(alpha, x)
        b = _prep_coef(beta, x)
        m = _prep_mask(mask, x)
        has_init = init is not None
        ini = init.to(device=x.device, dtype=torch.float32).contiguous() if has_init else a
        grid = (n_tiles, _cdiv(channels, block_c), batch)
        _pde_bwd_kernel[grid](
            gy, x, dx, m, a, b, ini, da, db,
            seq, channels, x.stride(0), x.stride(1), gy.stride(0), gy.stride(1), n_tiles,
            PDE=_PDE_IDS[pde], CAUSAL=bool(causal), STEPS=steps,
            HAS_MASK=mask is not None, A_VEC=a.numel() > 1, B_VEC=b.numel() > 1,
            HAS_INIT=has_init, LINEAR=linear,
            HL=hl, T=t, BLOCK_L=block_l, BLOCK_C=block_c, num_warps=warps,
        )
    da = da.sum(0)
    db = db.sum(0)
    if pde == "advection_diffusion" and causal and linear:
        db = da.clone()
    return dx, _fit_coef_grad(da, alpha, channels), _fit_coef_grad(db, beta, channels)


# ----------------------------------------------------------------------------------------------------------------
# Custom ops (torch.compile sees them as opaque nodes) + autograd
# ----------------------------------------------------------------------------------------------------------------

_PDE_NAMES = {v: k for k, v in _PDE_IDS.items()}


def _op_registered(name: str) -> bool:
    """True when another copy of this module (e.g. transformers' remote-code copy) already registered ``cta::name``."""
    try:
        getattr(torch.ops.cta, name)
        return True
    except (AttributeError, RuntimeError):
        return False


_REGISTER = not _op_registered("pde_refine_fwd")


def _pde_refine_fwd_impl(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    init: Optional[torch.Tensor],
    pde: int,
    steps: int,
    causal: bool,
    want_final: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    return _launch_fwd(x, alpha, beta, mask, init, _PDE_NAMES[pde], steps, causal, want_final)


def _pde_refine_fwd_fake(x, alpha, beta, mask, init, pde, steps, causal, want_final):
    batch, seq, channels = x.shape
    y = x.new_empty((batch, seq, channels))
    fin = x.new_empty((batch, steps if (causal and want_final) else 0, channels), dtype=torch.float32)
    return y, fin


def _pde_refine_bwd_impl(
    gy: torch.Tensor,
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    init: Optional[torch.Tensor],
    pde: int,
    steps: int,
    causal: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_bwd(gy, x, alpha, beta, mask, init, _PDE_NAMES[pde], steps, causal)


def _pde_refine_bwd_fake(gy, x, alpha, beta, mask, init, pde, steps, causal):
    channels = x.shape[-1]
    return (
        x.new_empty(x.shape),
        x.new_empty(_coef_grad_shape(alpha, channels), dtype=torch.float32),
        x.new_empty(_coef_grad_shape(beta, channels), dtype=torch.float32),
    )


def _fwd_setup_context(ctx, inputs, output):
    x, alpha, beta, mask, init, pde, steps, causal, want_final = inputs
    ctx.save_for_backward(x, alpha, beta, mask, init)
    ctx.meta = (pde, steps, causal)
    ctx.set_materialize_grads(False)  # None for an unused output: the final state's gradient decides the path
    if not (causal and want_final):
        ctx.mark_non_differentiable(output[1])


def _coef_grads(alpha, beta, da, db):
    """The coefficients' gradients in their own shapes and dtypes (``da``/``db``: ``_coef_grad_shape``)."""
    dalpha = da.to(alpha.dtype).reshape(alpha.shape)
    dbeta = None
    if beta is not None:
        dbeta = db.to(beta.dtype).reshape(beta.shape)
    return dalpha, dbeta


def _state_backward(ctx, gy, gfin):
    """(dx, dalpha, dbeta, dinit) through the reference's autograd on the saved inputs, for gradients that involve
    the streamed state: the kernels' backward has no initial-state gradient and no final-state input."""
    x, alpha, beta, mask, init = ctx.saved_tensors
    pde, steps, causal = ctx.meta
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[4])
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip((x, alpha, beta, init), needs)]
        y, fin = pde_refine_reference(
            leaves[0], pde_type=_PDE_NAMES[pde], steps=steps, alpha=leaves[1], beta=leaves[2], causal=causal,
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
    pde, steps, causal = ctx.meta
    if gy is None:
        gy = torch.zeros_like(x)
    if eager:
        dx, da, db = _launch_bwd(gy, x, alpha, beta, mask, init, _PDE_NAMES[pde], steps, causal,
                                 need_db=beta is not None)
    else:
        dx, da, db = _pde_refine_bwd(gy, x, alpha, beta, mask, init, pde, steps, causal)
    dalpha, dbeta = _coef_grads(alpha, beta, da, db)
    return dx, dalpha, dbeta, None, None, None, None, None, None


class _PDERefineFunction(torch.autograd.Function):
    """Eager-mode twin of the ``cta::pde_refine_fwd`` custom op and its registered autograd (same kernels)."""

    @staticmethod
    def forward(ctx, x, alpha, beta, mask, init, pde, steps, causal, want_final):
        y, fin = _launch_fwd(x, alpha, beta, mask, init, _PDE_NAMES[pde], steps, causal, want_final)
        _fwd_setup_context(ctx, (x, alpha, beta, mask, init, pde, steps, causal, want_final), (y, fin))
        return y, fin

    @staticmethod
    def backward(ctx, gy, gfin):
        return _kernel_backward(ctx, gy, gfin, eager=True)


def _decode_arguments(x, y, state, a, b, token_mask, pde: int, steps: int):
    """``(grid, tensors, ints, consts)`` of the decode kernel. ``x``/``y``: ``[batch, (1,) channels]`` with
    contiguous channels; ``state``: fp32; ``a``/``b``: fp32 ``[1]`` or ``[channels]`` (``b`` None for
    diffusion/wave); ``token_mask``: fp32 ``[batch]`` or None."""
    channels = x.shape[-1]
    block_c = min(_next_pow2(channels), 1024)
    grid = (_cdiv(channels, block_c), x.shape[0])
    # Pointers the kernel never reads (no mask, no beta) are given `x`: no allocation and no fill launch per call.
    tm = x if token_mask is None else token_mask
    bb = a if b is None else b
    return (grid, (x, y, state, tm, a, bb), (channels, x.stride(0), state.stride(0), state.stride(1)),
            (pde, steps, token_mask is not None, a.numel() > 1, b is not None and b.numel() > 1, block_c))


_DECODE_WARPS = 4


def _launch_decode(x, y, state, a, b, token_mask, pde: int, steps: int):
    """Launches the decode kernel (arguments as in :func:`_decode_arguments`); returns ``y``."""
    grid, tensors, ints, consts = _decode_arguments(x, y, state, a, b, token_mask, pde, steps)
    _launch(_pde_decode_kernel, grid, tensors, ints, consts, _DECODE_WARPS)
    return y


def bind_decode_update(x, state, alpha, beta, token_mask, pde: int, steps: int):
    """:func:`pde_decode_update` prepared once: a function ``launch(x, y, state, token_mask)`` that calls the
    compiled kernel's launcher with every other argument bound (``alpha``, ``beta``, and the strides of ``x`` and
    ``state``). Valid for tokens ``x`` (and outputs ``y``) of this shape, dtype, device and 16-byte alignment, for
    this state buffer, and for a token mask like this one (None, or fp32 ``[batch]`` 16-byte aligned; pass None
    again for the first kind). None where no launcher is cached for this key yet (run :func:`pde_decode_update`
    once first) or direct launch is off.

    A decode step of a patched model runs one launch per site and token; building its arguments and its cache key
    each time cost more host time than the launch itself.
    """
    grid, tensors, ints, consts = _decode_arguments(x, x, state, alpha, beta, token_mask, pde, steps)
    key, pointers = _direct_key(_pde_decode_kernel, tensors, ints, consts, _DECODE_WARPS)
    cached = _COMPILED.get(key) if key is not None else None
    if cached is None:
        return None
    compiled, call = cached
    # The arguments between the stream and the launch metadata: those of compiled.run, or of the C launch function.
    middle = (compiled.function, compiled.packed_metadata)
    if hasattr(call, "c_launch"):
        call, cooperative, pdl = call.c_launch
        middle = (compiled.function, cooperative, pdl, None, None, compiled.packed_metadata)
    current_stream = triton.runtime.driver.active.get_current_stream
    device = key[1]
    grid_x, grid_y = grid
    b = tensors[5]
    tail = (pointers[4], pointers[5], *ints, *consts)  # alpha and b bound (the closure keeps them alive)
    # Triton's launch hooks as found now (None, or empty HookChains): while they are these objects and their lists
    # of calls stay empty, a launch skips _launch_hooks (three calls per launch, at one launch per site and token).
    runtime = triton.knobs.runtime
    enter_seen, leave_seen = runtime.launch_enter_hook, runtime.launch_exit_hook
    enter_calls, leave_calls = getattr(enter_seen, "calls", None), getattr(leave_seen, "calls", None)
    idle = _launch_hooks() == (None, None)
    idle_middle = (*middle, None, None, None)  # no launch metadata, no hooks

    def launch(x, y, state, token_mask):
        stream = current_stream(device)
        x_ptr = x.data_ptr()
        # Integer pointers, as in _launch; the kernel never reads the mask pointer without a mask.
        tm_ptr = x_ptr if token_mask is None else token_mask.data_ptr()
        if idle and runtime.launch_enter_hook is enter_seen and runtime.launch_exit_hook is leave_seen and \
                not enter_calls and not leave_calls:
            call(grid_x, grid_y, 1, stream, *idle_middle, x_ptr, y.data_ptr(), state.data_ptr(), tm_ptr, *tail)
            return
        enter, leave = _launch_hooks()
        metadata = None
        if enter is not None:
            tm = x if token_mask is None else token_mask
            metadata = compiled.launch_metadata((grid_x, grid_y, 1), stream, x, y, state, tm, alpha, b, *ints, *consts)
        call(grid_x, grid_y, 1, stream, *middle, metadata, enter, leave, x_ptr, y.data_ptr(), state.data_ptr(),
             tm_ptr, *tail)

    return launch


def _pde_decode_impl(
    x: torch.Tensor,
    state: torch.Tensor,
    alpha: torch.Tensor,
    beta: Optional[torch.Tensor],
    token_mask: Optional[torch.Tensor],
    pde: int,
    steps: int,
) -> torch.Tensor:
    x = _channels_contiguous(x)
    y = torch.empty((x.shape[0], x.shape[1]), device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    if state.stride(-1) != 1:
        raise ValueError("`state` must have contiguous channels (stride 1 along its last dimension).")
    a = _prep_coef(alpha, x)
    b = _prep_coef(beta, x) if beta is not None else None
    tm = _prep_mask(token_mask.reshape(-1), x) if token_mask is not None else None
    return _launch_decode(x, y, state, a, b, tm, pde, steps)


def pde_decode_update(hidden_states, state, alpha, beta, token_mask, pde: int, steps: int) -> torch.Tensor:
    """The lean decode step used by :class:`pde_cta.PDERefinement` at inference (no validation, no autograd).

    ``hidden_states`` ``[batch, 1, channels]`` (contiguous channels) on the device of ``state`` (fp32
    ``[batch, steps, channels]``, updated in place, contiguous channels); ``alpha`` / ``beta``: fp32 contiguous
    ``[1]`` or ``[channels]`` already projected onto their bounds; ``token_mask`` fp32 ``[batch]`` or None;
    ``pde``: an id of ``_PDE_IDS``; ``1 <= steps <= MAX_FUSED_STEPS``. Everything a decode step on an H200 is
    spent on is host time (a batch-1 step of a 4096-wide model is launch-bound), hence this path.
    """
    x = _channels_contiguous(hidden_states)
    return _launch_decode(x, torch.empty_like(x), state, alpha, beta, token_mask, pde, steps)


def _pde_decode_fake(x, state, alpha, beta, token_mask, pde, steps):
    return x.new_empty(x.shape)


if _REGISTER:
    _pde_refine_fwd = torch.library.custom_op("cta::pde_refine_fwd", _pde_refine_fwd_impl, mutates_args=())
    _pde_refine_fwd.register_fake(_pde_refine_fwd_fake)
    _pde_refine_bwd = torch.library.custom_op("cta::pde_refine_bwd", _pde_refine_bwd_impl, mutates_args=())
    _pde_refine_bwd.register_fake(_pde_refine_bwd_fake)
    torch.library.register_autograd("cta::pde_refine_fwd", _kernel_backward, setup_context=_fwd_setup_context)
    _pde_decode_op = torch.library.custom_op("cta::pde_decode_step", _pde_decode_impl, mutates_args=("state",))
    _pde_decode_op.register_fake(_pde_decode_fake)
else:  # pragma: no cover - a second copy of this module shares the first copy's ops
    _pde_refine_fwd = torch.ops.cta.pde_refine_fwd
    _pde_refine_bwd = torch.ops.cta.pde_refine_bwd
    _pde_decode_op = torch.ops.cta.pde_decode_step


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
    batch, seq, channels = hidden_states.shape
    if steps == 0:
        if return_final_state:
            return hidden_states, hidden_states.new_zeros((batch, 0, channels), dtype=torch.float32)
        return hidden_states
    if not hidden_states.is_cuda and not _interpret():
        raise ValueError("pde_refine_triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors).")
    device = hidden_states.device
    if alpha.device != device:
        alpha = alpha.to(device)
    if beta is not None and beta.device != device:
        beta = beta.to(device)
    mask = attention_mask
    if mask is not None and mask.device != device:
        mask = mask.to(device)
    init = initial_state
    args = (hidden_states, alpha, beta, mask, init, _PDE_IDS[pde], int(steps), bool(causal), bool(return_final_state))
    if torch.compiler.is_compiling():  # the registered custom op: no graph break
        y, fin = _pde_refine_fwd(*args)
    elif torch.is_grad_enabled() and (  # plain tests, not a generator: this runs once per layer and call
        hidden_states.requires_grad or alpha.requires_grad or (beta is not None and beta.requires_grad)
        or (init is not None and init.requires_grad)
    ):  # eager training: the same kernels through a plain autograd.Function (less dispatch overhead per call)
        y, fin = _PDERefineFunction.apply(*args)
    else:  # eager inference: launch directly
        y, fin = _launch_fwd(hidden_states, alpha, beta, mask, init, pde, int(steps), bool(causal),
                             bool(return_final_state))
    if return_final_state:
        return y, fin
    return y


def pde_decode_step_triton(
    hidden_states: torch.Tensor,
    state: torch.Tensor,
    *,
    pde_type: str,
    steps: int,
    alpha,
    beta=None,
    token_mask: Optional[torch.Tensor] = None,
):
    """One-token causal decode step; updates ``state`` ``[batch, steps, channels]`` (fp32) in place."""
    if not is_available():
        raise RuntimeError("pde_decode_step_triton needs triton and a CUDA device (or TRITON_INTERPRET=1).")
    if hidden_states.dim() != 2:
        raise ValueError(f"`hidden_states` must have shape [batch, channels], got {tuple(hidden_states.shape)}.")
    batch, channels = hidden_states.shape
    pde, alpha, beta = check_pde_arguments(
        hidden_states.unsqueeze(1), pde_type, steps, alpha, beta, None, state, True
    )
    if token_mask is not None and token_mask.numel() != batch:
        raise ValueError(f"`token_mask` must have {batch} elements (one per sequence), got {tuple(token_mask.shape)}.")
    if state.dtype != torch.float32:
        raise ValueError(f"`state` must be float32, got {state.dtype}.")
    if steps == 0:
        return hidden_states.clone()
    if steps > MAX_FUSED_STEPS or state.stride(-1) != 1:
        return pde_decode_step_reference(
            hidden_states, state, pde_type=pde, steps=steps, alpha=alpha, beta=beta, token_mask=token_mask
        )
    tm = token_mask.to(hidden_states.device) if token_mask is not None else None
    args = (hidden_states, state, alpha.to(hidden_states.device),
            beta.to(hidden_states.device) if beta is not None else None, tm, _PDE_IDS[pde], int(steps))
    if torch.compiler.is_compiling():
        return _pde_decode_op(*args)
    # Eager decode is latency-bound: the custom-op dispatcher costs ~150 us per call on an H200, the launch ~10 us.
    return _pde_decode_impl(*args)
