# coding=utf-8
"""The fixed Triton kernels of the CTA PDE operator and the Triton import (a leaf of the kernel files).

* ``_pde_bwd_kernel``: the tile backward of the schemes the streaming backward does not cover (wave, reaction,
  bidirectional advection, any causal scheme with an initial state). Each program loads ``x`` and ``grad`` with a
  halo that covers the forward trajectory the adjoint needs (``2*steps`` per side bidirectional, ``steps`` each
  side causal), recomputes ``u_s`` for each adjoint step on chip and takes neighbours with ``tl.gather``.
* ``_pde_decode_kernel``: one new token per sequence; reads and updates the causal state ``[batch, steps,
  channels]`` in place.
* ``_sum_rows_kernel``: the per-channel coefficient gradient's atomic rows summed.
* ``_widen``, ``_tanh``: helpers the generated streaming kernels (``kernels_source``) call too.

Optional: this module imports without triton (``is_available()`` is then False). With ``TRITON_INTERPRET=1`` (Triton's
own switch, set before triton is imported) the kernels run on CPU tensors through Triton's interpreter; that is how CI
checks parity.
"""

from __future__ import annotations

import functools

import torch

from .pde_spec import WAVE_DAMPING

try:  # triton is optional
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

# Whether Triton runs kernels through its interpreter (its own TRITON_INTERPRET switch, read through its public knobs;
# the kernels below are decorated, so the choice is made, at import).
INTERPRET = bool(HAS_TRITON and triton.knobs.runtime.interpret)


@functools.lru_cache(maxsize=None)  # asked at every call; torch.cuda.is_available() reads the environment each time
def is_available() -> bool:
    """True when triton imports and can run here: on CUDA, or on CPU through ``TRITON_INTERPRET=1``."""
    return HAS_TRITON and (INTERPRET or torch.cuda.is_available())


if HAS_TRITON:
    _DIFF = tl.constexpr(0)
    _WAVE = tl.constexpr(1)
    _REACT = tl.constexpr(2)
    _ADV = tl.constexpr(3)
    _KEEP = tl.constexpr(1.0 - WAVE_DAMPING)

    # bf16 -> fp32 of the per-channel filters' rows: a bf16 is the top half of an fp32, so each packed pair widens
    # with one shift (the low one) and one mask (the high one); the conversion Triton emits spends a byte permute and a
    # shift on the high one (docs/kernels.md). The interpreter runs no inline assembly: it converts.
    _WIDEN_ASM = tl.constexpr(not INTERPRET)

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
        return c.to(tl.float32)

    @triton.jit
    def _load_coefs(A, Bc, cols, cmask, A_VEC: tl.constexpr, B_VEC: tl.constexpr, PDE: tl.constexpr):
        """(alpha, beta) of a kernel; beta is zero for the schemes without one."""
        a = _load_coef(A, cols, cmask, A_VEC)
        if PDE == _DIFF:
            b = a * 0.0
        elif PDE == _WAVE:
            b = a * 0.0
        else:
            b = _load_coef(Bc, cols, cmask, B_VEC)
        return a, b

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
    def _causal_update(u, v, pull, vl, a, b, PDE: tl.constexpr):
        """One causal level from the pull towards the left neighbour (``left - u``): the one definition of the causal
        step shared by the tile kernels and the decode kernel (the generated kernels emit the same operations)."""
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
    def _causal_step(u, v, il, lv, vl, is_first, init_s, a, b, PDE: tl.constexpr):
        return _causal_update(u, v, _causal_left(u, il, lv, is_first, init_s) - u, vl, a, b, PDE)

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
        a, b = _load_coefs(A, Bc, cols, cmask, A_VEC, B_VEC, PDE)
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
        """``DST[C] = SRC[rows, C].sum(0)``, fp32 (the coefficient gradient's atomic rows: one small kernel, faster
        than torch's reduction for this little work, docs/kernels.md)."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < C
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in range(0, rows):
            total += tl.load(SRC + r * C + cols, mask=cmask, other=0.0)
        tl.store(DST + cols, total, mask=cmask)

    @triton.jit
    def _level_pointer(s: tl.constexpr, L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11, L12, L13, L14, L15):
        """The pointer of level ``s`` (a separate buffer per step: see ``pde_cache``), chosen at compile time."""
        if s == 0:
            p = L0
        elif s == 1:
            p = L1
        elif s == 2:
            p = L2
        elif s == 3:
            p = L3
        elif s == 4:
            p = L4
        elif s == 5:
            p = L5
        elif s == 6:
            p = L6
        elif s == 7:
            p = L7
        elif s == 8:
            p = L8
        elif s == 9:
            p = L9
        elif s == 10:
            p = L10
        elif s == 11:
            p = L11
        elif s == 12:
            p = L12
        elif s == 13:
            p = L13
        elif s == 14:
            p = L14
        else:
            p = L15
        return p

    @triton.jit
    def _pde_decode_kernel(
        X, Y, TM, A, Bc, C, sxb, slb, stm,
        L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11, L12, L13, L14, L15,
        PDE: tl.constexpr, STEPS: tl.constexpr, HAS_MASK: tl.constexpr,
        A_VEC: tl.constexpr, B_VEC: tl.constexpr, BLOCK_C: tl.constexpr,
        CLAMP: tl.constexpr, A_LO: tl.constexpr, A_HI: tl.constexpr, B_LO: tl.constexpr, B_HI: tl.constexpr,
    ):
        pid_c = tl.program_id(0)
        b64 = tl.program_id(1).to(tl.int64)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        u = tl.load(X + b64 * sxb + cols, mask=cmask, other=0.0).to(tl.float32)
        v = u * 0.0
        if HAS_MASK:  # the token's attention-mask entry, in the mask's own dtype
            vl = tl.load(TM + b64 * stm + cols * 0).to(tl.float32)
        else:
            vl = 1.0
        a, b = _load_coefs(A, Bc, cols, cmask, A_VEC, B_VEC, PDE)
        if CLAMP:  # the learnable module's projection onto the stable bounds (no clamp launch per token)
            a = tl.minimum(tl.maximum(a, A_LO), A_HI)
            b = tl.minimum(tl.maximum(b, B_LO), B_HI)
        for s in tl.static_range(STEPS):  # level s: its own buffer, `slb` apart between sequences
            level = _level_pointer(s, L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11, L12, L13, L14, L15)
            sp = level + b64 * slb + cols
            left = tl.load(sp, mask=cmask, other=0.0)
            tl.store(sp, u * vl, mask=cmask)
            u, v = _causal_update(u, v, left - u, vl, a, b, PDE)
        tl.store(Y + b64 * C + cols, u.to(Y.dtype.element_ty), mask=cmask)

else:  # pragma: no cover - without triton nothing here is launched
    _KEEP = _tanh = _widen = None
