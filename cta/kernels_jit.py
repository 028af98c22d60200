# coding=utf-8
"""The fixed Triton kernels of the CTA PDE operator and the Triton import (a leaf of the kernel files).

* ``_pde_bwd_kernel``: the tile backward of the schemes that do not filter (``PDEScheme.filters``: wave, reaction,
  bidirectional advection; causal ones with an initial state). Each program loads ``x`` and ``grad`` with a halo
  covering the forward trajectory (``2*steps`` per side bidirectional, ``steps`` causal), recomputes ``u_s`` for
  each adjoint step on chip and takes neighbours with ``tl.gather``.
* ``_pde_decode_kernel``: one new token per sequence, updating the causal state in place.
* ``_sum_rows_kernel``: the coefficient gradient's partial sums finished as the parameter's gradient.
* ``_widen``, ``_tanh``: helpers the generated streaming kernels (``kernels_source``) call too.

The scheme enters as constexprs from its ``PDEScheme`` (``WAVE``, ``ADV``, ``HAS_BETA``, the reaction and its
derivatives as @triton.jit functions, ``reaction_functions``). Imports without triton (``is_available()`` False);
with ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU tensors, as CI checks parity.
"""

from __future__ import annotations

import functools
import linecache
import re

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


@torch.compiler.assume_constant_result  # (traced calls read the answer, not the cache: Dynamo warns about one)
def is_available() -> bool:
    """True when triton imports and can run here: on CUDA, or on CPU through ``TRITON_INTERPRET=1``."""
    return _available()


@functools.lru_cache(maxsize=1)  # (torch.cuda.is_available() reads the environment at each call)
def _available() -> bool:
    return bool(HAS_TRITON and (INTERPRET or torch.cuda.is_available()))


class DirectLaunch:
    """``kernel[grid](*args, num_warps=num_warps)`` launching, as Triton's fused-softmax tutorial does, the binary
    ``kernel.warmup`` gives for the tensors' dtypes and 16-byte alignment (all else is fixed per launcher): no per-call
    binding (docs/kernels.md). ``tensors``: the tensor arguments' positions. The interpreter launches via the JIT."""

    def __init__(self, kernel, grid, num_warps: int, tensors):
        self.kernel, self.num_warps, self.tensors = kernel, num_warps, tuple(tensors)
        self.grid = (*grid, *(1,) * (3 - len(grid)))  # (a binary's launcher takes all three)
        self.binaries = {}

    def __call__(self, *args):
        if INTERPRET:
            return self.kernel[self.grid](*args, num_warps=self.num_warps)
        self.binary(*args)[1](*args)

    def binary(self, *args):
        """(compiled kernel, its launcher) of these arguments (compiled, or found in Triton's cache, on first use)."""
        key = [args[0].get_device()]
        for i in self.tensors:
            key += (args[i].dtype, args[i].data_ptr() % 16)
        key = tuple(key)
        binary = self.binaries.get(key)
        if binary is None:
            compiled = self.kernel.warmup(*args, grid=self.grid, num_warps=self.num_warps)
            binary = self.binaries[key] = (compiled, compiled[self.grid])
        return binary


def current_stream(device: torch.device):
    """The raw current stream of a CUDA ``device`` (through Triton's driver, as its launcher asks: no Python stream
    object), None elsewhere."""
    if device.type != "cuda":
        return None
    return triton.runtime.driver.active.get_current_stream(device.index)


def exec_jit(name: str, src: str, **names):
    """The @triton.jit function ``name`` of the generated source ``src`` (in linecache, for Triton and tracebacks),
    seeing this module's names and ``names``."""
    filename = f"<cta-triton-generated:{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace = dict(globals(), **names)
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]


if HAS_TRITON:
    _KEEP = tl.constexpr(1.0 - WAVE_DAMPING)

    # bf16 -> fp32 of the per-channel filters' rows: a bf16 is the top half of an fp32, so a packed pair widens with
    # one shift (low) and one mask (high), where Triton's conversion spends a byte permute and a shift on the high one
    # (docs/kernels.md). The interpreter runs no inline assembly: it converts.
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
        return tl.load(M + b64 * L + pos, mask=inseq, other=0.0) if HAS_MASK else inseq.to(tl.float32)

    @triton.jit
    def _load_coef(P, cols, cmask, VEC: tl.constexpr):
        c = tl.load(P + cols, mask=cmask, other=0.0) if VEC else tl.load(P + cols * 0)
        return c.to(tl.float32)

    @triton.jit
    def _load_coefs(A, Bc, cols, cmask, A_VEC: tl.constexpr, B_VEC: tl.constexpr, HAS_BETA: tl.constexpr,
                    CLAMP: tl.constexpr, A_LO: tl.constexpr, A_HI: tl.constexpr, B_LO: tl.constexpr,
                    B_HI: tl.constexpr):
        """(alpha, beta) (beta zero without one), clamped with ``CLAMP``: the module's projection, no clamp launch."""
        a = _load_coef(A, cols, cmask, A_VEC)
        b = _load_coef(Bc, cols, cmask, B_VEC) if HAS_BETA else a * 0.0
        if CLAMP:
            a = tl.minimum(tl.maximum(a, A_LO), A_HI)
            b = tl.minimum(tl.maximum(b, B_LO), B_HI)
        return a, b

    @triton.jit
    def _bidi_step(u, v, il, ir, vl, ol, orr, a, b, bp, bm, WAVE: tl.constexpr, ADV: tl.constexpr,
                   REACT: tl.constexpr):
        ur = tl.gather(u, ir, 0)
        if WAVE:
            ul = tl.gather(u, il, 0)
            v = _KEEP * v + a * (orr * (ur - u) - ol * (u - ul))
            u = u + v
        else:
            gr = orr * (a * (ur - u) - bp * u - bm * ur) if ADV else orr * (a * (ur - u))
            gl = tl.gather(gr, il, 0)  # flux through the left edge = flux of the row before (mask included)
            upd = gr - gl
            if REACT is not None:
                upd = upd + REACT(u, b) * vl
            u = u + upd
        return u, v

    @triton.jit
    def _causal_left(u, il, lv, is_first, init_s):
        return tl.where(is_first, init_s, tl.gather(u, il, 0) * lv)

    @triton.jit
    def _causal_update(u, v, pull, vl, a, b, WAVE: tl.constexpr, ADV: tl.constexpr, REACT: tl.constexpr):
        """One causal level from the pull ``left - u``, shared by the tile and decode kernels (the generated
        kernels emit the same operations)."""
        if WAVE:
            v = _KEEP * v + a * pull * vl
            u = u + v
        else:
            upd = (a + b) * pull if ADV else a * pull
            if REACT is not None:
                upd = upd + REACT(u, b)
            u = u + upd * vl
        return u, v

    @triton.jit
    def _init_at(INIT, init_off, s, C, cols, cmask, HAS_INIT: tl.constexpr):
        """Level ``s`` of a causal initial state (0 without one)."""
        return tl.load(INIT + init_off + s * C + cols, mask=cmask, other=0.0) if HAS_INIT else 0.0

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
    def _adjoint(g, gv, u, il, ir, vl, ol, orr, lv, is_first, init_s, a, b, bp, bm, WAVE: tl.constexpr,
                 ADV: tl.constexpr, REACT_DU: tl.constexpr, REACT_DB: tl.constexpr,
                 CAUSAL: tl.constexpr):
        """One adjoint step at ``u`` = u_s: the grads (g, gv) of (u_{s+1}, v_{s+1}) -> those of step s, and this
        step's per-element terms of dL/da, dL/db (the reaction's through ``REACT_DU``, ``REACT_DB``)."""
        dbc = g * 0.0
        if CAUSAL:
            w = g * vl  # (wave: the velocity's gradient joins the position's)
            if WAVE:
                w = (gv + g) * vl
                gv = _KEEP * (gv + g)
            c = a + b if ADV else a
            dac = w * (_causal_left(u, il, lv, is_first, init_s) - u)
            g = g + c * (vl * tl.gather(w, ir, 0) - w)
            if ADV:
                dbc = dac
        else:
            h = g
            if WAVE:
                h = gv + g
                gv = _KEEP * h
            ul = tl.gather(u, il, 0)
            ur = tl.gather(u, ir, 0)
            dac = h * (orr * (ur - u) - ol * (u - ul))
            hl = tl.gather(h, il, 0)
            hr = tl.gather(h, ir, 0)
            if ADV:
                d = 1.0 - orr * (a + bp) - ol * (a - bm)
                g = g * d + ol * (a - bm) * hl + orr * (a + bp) * hr
                dbp = h * (ol * ul - orr * u)
                dbm = h * (ol * u - orr * ur)
                dbc = tl.where(b >= 0.0, dbp, 0.0) + tl.where(b <= 0.0, dbm, 0.0)
            else:
                g = g + a * (orr * (hr - h) - ol * (h - hl))
            w = h * vl
        if REACT_DU is not None:
            g = g + w * REACT_DU(u, b)
            dbc = w * REACT_DB(u, b)
        return g, gv, dac, dbc

    @triton.jit
    def _pde_bwd_kernel(
        GY, X, DX, M, A, Bc, INIT, DA, DB,
        L, C, sxb, sxl, sgb, sgl, n_tiles,
        WAVE: tl.constexpr, ADV: tl.constexpr, HAS_BETA: tl.constexpr, REACT: tl.constexpr, REACT_DU: tl.constexpr,
        REACT_DB: tl.constexpr, CLAMP: tl.constexpr, A_LO: tl.constexpr, A_HI: tl.constexpr, B_LO: tl.constexpr,
        B_HI: tl.constexpr, CAUSAL: tl.constexpr, STEPS: tl.constexpr, HAS_MASK: tl.constexpr, A_VEC: tl.constexpr,
        B_VEC: tl.constexpr, HAS_INIT: tl.constexpr, HL: tl.constexpr, T: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        pid_l, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows, cols, cmask, b64, pos, inseq, vl, vprev, vnext, il, ir = _tile_setup(
            M, pid_l, pid_c, pid_b, L, C, HL, T, HAS_MASK, BLOCK_L, BLOCK_C)
        lmask = inseq & cmask
        x = tl.load(X + b64 * sxb + pos * sxl + cols, mask=lmask, other=0.0).to(tl.float32)
        g = tl.load(GY + b64 * sgb + pos * sgl + cols, mask=lmask, other=0.0).to(tl.float32)
        a, b = _load_coefs(A, Bc, cols, cmask, A_VEC, B_VEC, HAS_BETA, CLAMP, A_LO, A_HI, B_LO, B_HI)
        bp, bm = tl.maximum(b, 0.0), tl.minimum(b, 0.0)
        ol, orr = vl * vprev, vl * vnext
        lv = tl.where(pos == 0, 1.0, vprev)
        is_first = pos == 0
        init_off = b64 * STEPS * C
        useful = (rows >= HL) & (rows < HL + T) & inseq
        zero_tile = tl.zeros([BLOCK_L, BLOCK_C], dtype=tl.float32)
        gv = zero_tile
        da = tl.sum(zero_tile, axis=0)
        db = da
        for k in range(STEPS):  # the adjoint of step s at its iterate u_s, recomputed from x (no trajectory kept)
            s = STEPS - 1 - k
            u = x
            v = zero_tile
            for j in range(s):
                if CAUSAL:
                    left = _causal_left(u, il, lv, is_first, _init_at(INIT, init_off, j, C, cols, cmask, HAS_INIT))
                    u, v = _causal_update(u, v, left - u, vl, a, b, WAVE, ADV, REACT)
                else:
                    u, v = _bidi_step(u, v, il, ir, vl, ol, orr, a, b, bp, bm, WAVE, ADV, REACT)
            init_s = _init_at(INIT, init_off, s, C, cols, cmask, HAS_INIT)  # (an initial state is causal)
            g, gv, dac, dbc = _adjoint(g, gv, u, il, ir, vl, ol, orr, lv, is_first, init_s, a, b, bp, bm,
                                       WAVE, ADV, REACT_DU, REACT_DB, CAUSAL)
            da += tl.sum(tl.where(useful, dac, 0.0), axis=0)
            db += tl.sum(tl.where(useful, dbc, 0.0), axis=0)
        out_mask = useful & cmask
        tl.store(DX + (b64 * L + pos) * C + cols, g.to(DX.dtype.element_ty), mask=out_mask)
        ccols, ccmask = tl.reshape(cols, [BLOCK_C]), tl.reshape(cmask, [BLOCK_C])
        poff = (b64 * n_tiles + pid_l) * C
        tl.store(DA + poff + ccols, da, mask=ccmask)
        if HAS_BETA:
            tl.store(DB + poff + ccols, db, mask=ccmask)

    @triton.jit
    def _sum_rows_kernel(SRC, DST, rows, C, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """``DST[C] = SRC[rows, C].sum(0)``, summed in fp32 in a fixed order and stored in ``DST``'s dtype: the
        coefficient gradient's partial sums, finished as the parameter's gradient in one launch (no sum, cast and
        reshape ops: host time, docs/kernels.md)."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < C
        total = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for r in range(0, rows, ROWS):
            at = r + tl.arange(0, ROWS)
            total += tl.load(SRC + at[:, None] * C + cols[None, :], mask=(at[:, None] < rows) & cmask[None, :],
                             other=0.0)
        tl.store(DST + cols, tl.sum(total, 0).to(DST.dtype.element_ty), mask=cmask)

    # The pointer of level ``s`` (a buffer per step: ``pde_cache``) among ``L0 .. L15``, chosen at compile time.
    _LEVELS = ", ".join(f"L{i}" for i in range(16))
    _SELECT = "".join(f"    {'if' if i == 0 else 'elif'} s == {i}:\n        p = L{i}\n" for i in range(16))
    _level_pointer = exec_jit("_level_pointer", f"@triton.jit\ndef _level_pointer(s: tl.constexpr, {_LEVELS}):\n"
                              f"{_SELECT}    return p\n")

    @triton.jit
    def _pde_decode_kernel(
        X, Y, TM, A, Bc, C, sxb, slb, stm,
        L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11, L12, L13, L14, L15,
        WAVE: tl.constexpr, ADV: tl.constexpr, HAS_BETA: tl.constexpr, REACT: tl.constexpr,
        CLAMP: tl.constexpr, A_LO: tl.constexpr, A_HI: tl.constexpr, B_LO: tl.constexpr, B_HI: tl.constexpr,
        STEPS: tl.constexpr, HAS_MASK: tl.constexpr, A_VEC: tl.constexpr, B_VEC: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid_c = tl.program_id(0)
        b64 = tl.program_id(1).to(tl.int64)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        u = tl.load(X + b64 * sxb + cols, mask=cmask, other=0.0).to(tl.float32)
        v = u * 0.0
        vl = tl.load(TM + b64 * stm + cols * 0).to(tl.float32) if HAS_MASK else 1.0  # (the mask in its own dtype)
        a, b = _load_coefs(A, Bc, cols, cmask, A_VEC, B_VEC, HAS_BETA, CLAMP, A_LO, A_HI, B_LO, B_HI)
        for s in tl.static_range(STEPS):  # level s: its own buffer, `slb` apart between sequences
            level = _level_pointer(s, L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11, L12, L13, L14, L15)
            sp = level + b64 * slb + cols
            left = tl.load(sp, mask=cmask, other=0.0)
            tl.store(sp, u * vl, mask=cmask)
            u, v = _causal_update(u, v, left - u, vl, a, b, WAVE, ADV, REACT)
        tl.store(Y + b64 * C + cols, u.to(Y.dtype.element_ty), mask=cmask)

else:  # pragma: no cover - without triton nothing here is launched
    _KEEP = _tanh = _widen = None


@functools.lru_cache(maxsize=None)
def reaction_functions(scheme) -> tuple:
    """``(R, dR/du, dR/db)`` of a ``PDEScheme``'s reaction as @triton.jit functions of ``(u, b)`` (the kernels'
    constexpr arguments ``REACT``, ``REACT_DU``, ``REACT_DB``), or Nones for a scheme without one."""
    if scheme.reaction is None:
        return None, None, None
    stem = "_cta_reaction_" + re.sub(r"\W", "_", scheme.name)
    return tuple(exec_jit(f"{stem}_{part}", f"@triton.jit\ndef {stem}_{part}(u, b):\n    return {expression}\n",
                          tanh=_tanh)
                 for part, expression in zip(("r", "du", "db"), scheme.reaction))
