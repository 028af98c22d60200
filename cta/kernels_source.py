# coding=utf-8
"""The streaming Triton kernels of the CTA PDE operator, as generated source (one kernel per ``StreamKernelSpec``;
``stream_kernel(spec)`` builds and caches it).

A program owns ``BLOCK_C`` channels x ``T`` rows and walks along the sequence a row at a time; every pseudo-time level
``s = 1..S`` keeps the row vectors its stencil needs in registers and advances as soon as level ``s - 1`` has produced
its right neighbour (a wavefront: ``S`` rows of lag bidirectionally, none causally). Each row is read and written
once, rows are prefetched ``D`` ahead, threads never exchange data, and the operations are the reference's in its
order (fp32 matches it to rounding). Generated, because the registers carried from row to row depend on ``S``.

* Interior programs of the linear schemes run ``S`` levels as one banded filter (the stencil's ``S``-th power) on a
  window of rows in registers (``_fir_interior``), or, scalar coefficient and 16-bit inputs, as 16-row MMA tiles
  (``_mma_interior``); end programs filter the walls' extension of the input (``_wall_load``); padding masks,
  partial channel blocks and causal states walk.
* The linear backward is one streaming pass: ``M = I + a L`` is symmetric bidirectionally, so ``dx = M^S g`` is the
  forward walk on ``g`` (causal: the anti-causal adjoint), and ``dL/da = S <L^T (M^T)^(S-1) g, x>`` pairs the last
  level with ``x`` at the output row; summed per program, added with atomics (per channel) or stored (scalar).
* Row validity is recomputed from the row index in every iteration, never carried: a chain of loop-carried validity
  scalars gave wrong results on an H200 (triton 3.6) while exact in the interpreter.

Measurements behind each choice: ``docs/kernels.md``; launch configurations: ``kernels_config``.
"""

from __future__ import annotations

import functools
import re
from typing import Tuple

from .kernels_config import LAST_TILE_SECOND, MMA_BLOCK, MMA_MAX_STEPS, WALK_MAX_PREFETCH, StreamKernelSpec
from .kernels_jit import INTERPRET, exec_jit, reaction_functions
from .pde_spec import SCHEMES

@functools.lru_cache(maxsize=None)
def stream_kernel(spec: StreamKernelSpec):
    """Builds (once) and returns the @triton.jit streaming kernel of ``spec``."""
    return exec_jit(spec.name, stream_source(spec), _react=reaction_functions(SCHEMES[spec.pde])[0])


class _Src:
    def __init__(self, depth=1):
        self.lines, self.depth = [], depth
        self.widen = False  # the register filters' 16-bit rows widen through ``_widen`` (see ``_widened``)

    def __call__(self, *lines):
        self.lines += ["    " * self.depth + line for line in lines]


def _coef_lines(w, name, ptr, vec, bounds):
    if vec:
        w(f"{name} = tl.load({ptr} + cols, mask=cmask, other=0.0).to(tl.float32)")
    else:  # one scalar load, broadcast by the arithmetic
        w(f"{name} = tl.load({ptr}).to(tl.float32)")
    if bounds is not None:  # the module's projection onto the stable bounds, in the kernel (no clamp launch)
        w(f"{name} = tl.minimum(tl.maximum({name}, {float(bounds[0])!r}), {float(bounds[1])!r})")


def _bidi_levels(w, pre, scheme, first, last, carry, c="a", interior=False):
    """Bidirectional levels ``first..last``: level s at row q-s from ``{pre}p{s-1}`` (row q-s) and ``{pre}n{s-1}``
    (row q-s+1); ``vv{k}``: validity of row q-k; loop-carried names go to ``carry``. ``interior``: every row is a
    valid token, so the validity factors (exactly 1) are left out (these kernels are issue-bound)."""
    for s in range(first, last + 1):
        p, n = f"{pre}p{s - 1}", f"{pre}n{s - 1}"
        e = f"{pre}e{s}"
        times_e = "" if interior else f" * {e}"
        if not interior:
            w(f"{e} = vv{s} * vv{s - 1}")
        w(f"{pre}d{s} = {n} - {p}")
        if scheme.wave:
            w(f"{pre}D{s} = {pre}d{s}{times_e}", f"{pre}lap{s} = {pre}D{s} - {pre}dl{s}", f"{pre}dl{s} = {pre}D{s}")
            if s == 1:
                w(f"{pre}nv{s} = {c} * {pre}lap{s}")
            else:
                w(f"{pre}nv{s} = _KEEP * {pre}pv{s - 1} + {c} * {pre}lap{s}")
                w(f"{pre}pv{s - 1} = {pre}nv{s - 1}")
                carry.append(f"{pre}pv{s - 1}")
            w(f"{pre}n{s} = {p} + {pre}nv{s}")
            carry.append(f"{pre}dl{s}")
        else:
            flux = f"({c} * {pre}d{s} - bp * {p} - bm * {n})" if scheme.advection else f"{c} * {pre}d{s}"
            w(f"{pre}G{s} = {flux}{times_e}", f"{pre}up{s} = {pre}G{s} - {pre}gl{s}")
            if scheme.reaction:  # the scheme's reaction R(u, b) (``_react``)
                w(f"{pre}up{s} = {pre}up{s} + _react({p}, b)" + ("" if interior else f" * vv{s}"))
            w(f"{pre}gl{s} = {pre}G{s}", f"{pre}n{s} = {p} + {pre}up{s}")
            carry.append(f"{pre}gl{s}")
        w(f"{p} = {n}")
        carry.append(p)


def _causal_levels(w, pre, scheme, first, last, carry, has_init=False, c="a", interior=False):
    """Causal levels at row q: level s from ``{pre}n{s-1}`` (row q) and ``{pre}p{s-1}`` (row q-1). ``interior``: as
    in :func:`_bidi_levels` (row 0, where the initial state enters, is never interior)."""
    times_v0 = "" if interior else " * vv0"
    for s in range(first, last + 1):
        p, n = f"{pre}p{s - 1}", f"{pre}n{s - 1}"
        w(f"{pre}left{s} = {p}" + ("" if interior else " * vv1"))
        if has_init and not interior:
            w(f"{pre}left{s} = tl.where(q == 0, ini{s - 1}, {pre}left{s})")
        w(f"{pre}pull{s} = {pre}left{s} - {n}")
        if scheme.wave:
            keep = "" if s == 1 else f"_KEEP * {pre}nv{s - 1} + "
            w(f"{pre}nv{s} = {keep}{c} * {pre}pull{s}{times_v0}", f"{pre}n{s} = {n} + {pre}nv{s}")
        else:
            w(f"{pre}up{s} = {'ab' if scheme.advection else c} * {pre}pull{s}")
            if scheme.reaction:
                w(f"{pre}up{s} = {pre}up{s} + _react({n}, b)")
            w(f"{pre}n{s} = {n} + {pre}up{s}{times_v0}")
        w(f"{p} = {n}")
        carry.append(p)


def _rows(r: str) -> str:
    """A row index in a condition combined with vectors: the interpreter mishandles scalar & vector masks, so there
    the row is broadcast first (``cz`` = int zeros of the channel vector)."""
    return f"(cz + {r})" if INTERPRET else f"({r})"


# Interior programs of the linear schemes (diffusion; causal advection-diffusion = diffusion with a + b) filter:
# away from the walls ``S`` levels of a 3-point (2-point causal) constant stencil are one filter of ``2S+1`` (``S+1``)
# taps, computed per program; each output row costs that many multiply-adds on a register window, against about four
# operations and two register copies per level for the walk (these kernels are instruction-bound). The backward
# filters g only (``_fir_backward``: the walk's per-row split; the factor ``S`` is applied by the final store).


def _fir_tap_terms(causal: bool, S: int):
    """Per tap k of ``S`` levels, the pairs (factor, j) of ``sum_j factor * m^(S-j) * c^j`` (m the centre weight).
    Bidirectional ``(m + c (z + 1/z))^S``: j >= k, j - k even, factor C(S, j) C(j, (j - k) / 2); causal
    ``(m + c / z)^S``: C(S, k) m^(S-k) c^k."""
    from math import comb

    if causal:
        return [[(comb(S, k), k)] for k in range(S + 1)]
    return [[(comb(S, j) * comb(j, (j - k) // 2), j) for j in range(k, S + 1, 2)] for k in range(S + 1)]


def _fir_taps(w, name, causal, S, c):
    """Emits ``{name}{k}``, k = 0..S: taps of ``S`` levels (bidirectional: tap k at offsets -k and +k; causal: at -k;
    ``S = 0``: the identity), in ``_fir_tap_terms``' closed form: per-channel programs compute them per channel, and
    the level-by-level convolution would take about 130 operations per channel at 8 bidirectional steps, a sizeable
    share of their instructions. With 0 <= c <= 1/2 (1 causal) every term is non-negative: no cancellation."""
    keep = f"{name}m"
    w(f"{keep} = 1.0 - {'' if causal else '2.0 * '}{c}")
    if S == 0:
        w(f"{name}0 = {keep} * 0.0 + 1.0")
        return
    # {name}p{j} = m^(S-j) c^j, from the powers of m ({name}m{e}) and of c ({name}c{e})
    pow_m = lambda e: "1.0" if e == 0 else (keep if e == 1 else f"{name}m{e}")  # noqa: E731
    pow_c = lambda e: "1.0" if e == 0 else (c if e == 1 else f"{name}c{e}")  # noqa: E731
    for e in range(2, S + 1):
        w(f"{pow_m(e)} = {pow_m(e - 1)} * {keep}", f"{pow_c(e)} = {pow_c(e - 1)} * {c}")
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


def _fir_dtaps(w, name, causal, levels, c):
    """Emits ``{name}{k}``, k = 0..levels+1: the stencil's derivative in ``c`` ([1, -2, 1]; causal -1 at 0, 1 at -1)
    times ``levels`` levels, i.e. d/dc of ``levels + 1`` levels' taps over ``levels + 1``."""
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


def _fir_apply(w, out, taps, n, win, causal, center, ahead=False):
    """``out`` = the filter ``taps`` (0..n) on window ``win`` around index ``center`` (causal: tap k reads
    ``win[center - k]``, ``ahead``: ``win[center + k]``; bidirectional: ``win[center - k] + win[center + k]``)."""
    w(f"{out} = {taps}0 * {win}{center}")
    for k in range(1, n + 1):
        pair = f"{win}{center + k if ahead else center - k}" if causal else f"({win}{center - k} + {win}{center + k})"
        w(f"{out} = tl.fma({taps}{k}, {pair}, {out})")


# End programs (no padding mask) run the same filters on the walls as an extension of the input, exact for these
# linear stencils. Bidirectional (zero-flux walls): the even reflection about each end (row -1-r, row 2L-1-r), which
# the 3-point stencil keeps symmetric, giving the wall's flux-form update at the end rows (one reflection is exact
# for L >= S; farther rows meet zero taps and are clamped into the sequence). Causal: zeros before the first row
# (zeros past the last for its anti-causal adjoint). Rows past the end are neither stored nor summed.
WALL_REFLECT, WALL_ZERO = "reflect", "zero"


def _wall_kind(causal: bool, walls: bool):
    """The extension end programs read (None: interior programs read rows as they are)."""
    return (WALL_ZERO if causal else WALL_REFLECT) if walls else None


def _wall_load(ptr, r, stride, wall, vector=False):
    """``tl.load`` of row ``r`` of a stream, as is (``wall`` None) or with the walls' extension (``vector``: ``r`` is
    a column of rows, as in the MMA blocks)."""
    if wall is None:
        return f"tl.load({ptr} + ({r}) * {stride})"
    if wall == WALL_REFLECT:
        mirrored = f"tl.where({r} < 0, -1 - ({r}), tl.where({r} >= L, 2 * L - 1 - ({r}), {r}))"
        return f"tl.load({ptr} + tl.minimum(tl.maximum({mirrored}, 0), L - 1) * {stride})"
    rr = f"({r})" if vector else _rows(r)
    return f"tl.load({ptr} + ({r}) * {stride}, mask=({rr} >= 0) & ({rr} < L), other=0.0)"


def _fir_loop(w, unroll, walls=False):
    """Opens the filter's row loop (row ``t``; the caller closes it). ``walls``: stops at the sequence end. (int32:
    the loop index must have one type in every branch of the kernel, and the walk's is int32.)"""
    bound = "tl.minimum(L - start, T).to(tl.int32)" if walls is True else "T"
    w(f"for j in tl.range(0, {bound}, loop_unroll_factor={unroll}):" if unroll > 1 else f"for j in range(0, {bound}):")
    w.depth += 1
    w("t = start + j")


def _widened(w, value: str) -> str:
    """``value`` (a 16-bit row) as fp32, in the filter source ``w`` (``w.widen``: through ``_widen``)."""
    return f"_widen({value})" if w.widen else f"{value}.to(tl.float32)"


class _Rows:
    """Loads of one stream's consecutive rows from row ``first`` on: ``load(dest, r)`` sets ``dest`` to row ``r``
    (the row after the previous load's) through a stepping pointer ``name`` (``pointers`` and no walls' extension:
    ``kernels_config.FIR_POINTER_STEPS``), or by index (``_wall_load``)."""

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


def _fir_store(w, base, value, wall, pointers, start=False):
    """Stores ``value`` at row ``t`` of the output ``base``: through a pointer ``{base}_at`` that steps a row per
    store where ``_Rows`` steps (``start``: sets it, before the loop), else by index."""
    if pointers and wall is None:
        at = f"{base.lower()}_at"
        w(f"{at} = {base} + (b64 * L + start) * C + cols" if start else f"tl.store({at}, {value})")
        if not start:
            w(f"{at} += C")
    elif not start:
        w(f"tl.store({base} + (b64 * L + t) * C + cols, {value})")


def _fir_next_row(w, pre, rows, lead, D, dest):
    """``dest`` = the prefetched row ``t + lead``; the prefetch (``rows``) advances to row ``t + lead + D``."""
    w(f"{dest} = {_widened(w, f'{pre}f0')}", *(f"{pre}f{k} = {pre}f{k + 1}" for k in range(D - 1)))
    rows.load(f"{pre}f{D - 1}", f"t + {lead + D}")


def _fir_prefetch(w, pre, rows, lead, D):
    """Loads rows ``start + lead .. start + lead + D - 1`` into the prefetch registers."""
    for k in range(D):
        rows.load(f"{pre}f{k}", f"start + {lead + k}")


def _fir_interior(w, kind, c, causal, S, D, unroll, walls=False, pointers=False):
    """The interior branch of a linear scheme's kernel as a banded filter of coefficient ``c``; returns the condition
    under which a program may take it (every row it reads is inside the sequence). ``walls``: the same filter for
    end programs (rows beyond the ends read as the walls' extension)."""
    if kind == "bwd":
        return _fir_backward(w, causal, S, D, unroll, walls, pointers)
    wide = S + 1 if causal else 2 * S + 1
    lead = 0 if causal else S  # newest window row - output row
    wall = _wall_kind(causal, walls)
    _fir_taps(w, "tap", causal, S, c)
    x_rows = _Rows(w, "x_at", "xrow", "sxl", f"start + {lead - wide + 1}", wall, pointers)
    for i in range(wide - 1):
        x_rows.load(f"xw{i}", f"start + {lead - wide + 1 + i}", to_float=True)
    _fir_prefetch(w, "x", x_rows, lead, D)
    _fir_store(w, "Y", None, wall, pointers, start=True)
    _fir_loop(w, unroll, walls)
    _fir_next_row(w, "x", x_rows, lead, D, f"xw{wide - 1}")
    _fir_apply(w, "yv", "tap", S, "xw", causal, S)
    _fir_store(w, "Y", "yv.to(Y.dtype.element_ty)", wall, pointers)
    w(*(f"xw{i} = xw{i + 1}" for i in range(wide - 1)))
    w.depth -= 1
    return f"(start + {lead - wide + 1} >= 0) & (start + T + {lead + D} <= L)"


def _fir_backward(w, causal, S, D, unroll, walls=False, pointers=False):
    """The backward's interior as filters on g only, with the walk's split of the coefficient gradient: with
    ``u = (M^T)^(S-1) g`` (one filter of S-1 levels), the input gradient is ``u + a L^T u`` and the coefficient's
    factor ``L^T u``, paired with x at the output row. ``u`` is kept at rows t-1, t, t+1 (causal: t, t+1).
    ``walls``: see ``_fir_interior`` (x is read at output rows only: it needs rows that exist, no extension)."""
    wall = _wall_kind(causal, walls)
    x_wall = WALL_REFLECT if walls else None  # the prefetch's rows past the end: any row of the sequence
    k = S - 1
    width = k + 1 if causal else 2 * k + 1  # g rows of one u row
    first = 0 if causal else -S  # the first g row a program reads (that of u at row start-1, bidirectional)
    n_u = 2 if causal else 3
    if k:
        _fir_taps(w, "gtap", causal, k, "a")

    def u_row(dest):  # u at the row whose g window ``gw`` holds (the causal adjoint's taps point ahead)
        if not k:
            w(f"{dest} = gw0")
        else:
            _fir_apply(w, dest, "gtap", k, "gw", causal, 0 if causal else k, ahead=True)

    g_rows = _Rows(w, "g_at", "grow", "sgl", f"start + {first}", wall, pointers)
    for i in range(width - 1):
        g_rows.load(f"gw{i}", f"start + {first + i}", to_float=True)
    for j in range(n_u - 1):  # u at the rows before the first output row's newest (bidirectional: start-1, start)
        g_rows.load(f"gw{width - 1}", f"start + {first + width - 1 + j}", to_float=True)
        u_row(f"u{j}")
        w(*(f"gw{i} = gw{i + 1}" for i in range(width - 1)))
    _fir_prefetch(w, "g", g_rows, S, D)  # u at row t+1 needs g up to row t+S (the rows above end at row S-1)
    x_rows = _Rows(w, "x_at", "xrow", "sxl", "start", x_wall, pointers)
    _fir_prefetch(w, "x", x_rows, 0, D)
    _fir_store(w, "DX", None, wall, pointers, start=True)
    _fir_loop(w, unroll, walls)
    _fir_next_row(w, "g", g_rows, S, D, f"gw{width - 1}")
    u_row(f"u{n_u - 1}")
    _fir_next_row(w, "x", x_rows, 0, D, "xv")
    if causal:  # lu = (L^T u)_t
        w("lu = u1 - u0", "dxv = tl.fma(a, lu, u0)", "acc = tl.fma(xv, lu, acc)")
    else:  # lu = (L u)_t
        w("lu = tl.fma(-2.0, u1, u0 + u2)", "dxv = tl.fma(a, lu, u1)", "acc = tl.fma(xv, lu, acc)")
    _fir_store(w, "DX", "dxv.to(DX.dtype.element_ty)", wall, pointers)
    w(*(f"gw{i} = gw{i + 1}" for i in range(width - 1)))
    w(*(f"u{i} = u{i + 1}" for i in range(n_u - 1)))
    w.depth -= 1
    return f"(start + {first} >= 0) & (start + T + {S + D} <= L)"


# Interior programs with a scalar coefficient and 16-bit inputs can run the filter on tensor cores: each 16-row
# tile's output is ``W_a X_a + W_b X_b``, ``X_a``, ``X_b`` the input blocks around it (rows t0-8..t0+7, t0+8..t0+23:
# up to 8 steps of halo) and ``W_a``, ``W_b`` [16, 16] pieces of the filter matrix, built once per program. Each
# matrix is split into a 16-bit high part and a 16-bit remainder (two MMAs, fp32 accumulation), keeping ~16 bits of
# each tap against 8 of a bf16 output; the 16-bit inputs are exact operands. Per element: a load, a few MMA
# instructions and a store, against ~2S+1 fp32 operations that made the 8-step register filter instruction-bound.


def _mma_dot(a, b, acc=None):
    """A 16-bit tensor-core product (fp32 accumulation); in the interpreter an exact fp32 product (its bf16
    ``tl.dot`` returns garbage, triton 3.9)."""
    if INTERPRET:
        a, b = f"{a}.to(tl.float32)", f"{b}.to(tl.float32)"
        tail = ', input_precision="ieee"'
    else:
        tail = ""
    return f"tl.dot({a}, {b}{'' if acc is None else ', ' + acc}{tail})"


def _mma_band(w, name, taps, n, side):
    """``{name}{a,b}_{hi,lo}``: the filter ``taps`` (0..n) as [16, 16] matrices on input blocks a and b (``offa``,
    ``offb``: input row - output row), split into 16-bit high and low parts. ``side``: tap k at offsets -k and +k
    ('both'), -k ('past') or +k ('future')."""
    for blk in "ab":
        off = f"off{blk}"
        dist = {"both": f"tl.abs({off})", "past": f"-{off}", "future": off}[side]
        w(f"{name}{blk}d = {dist}", f"{name}{blk} = tl.where({name}{blk}d == 0, {taps}0, 0.0)")
        w(*(f"{name}{blk} = tl.where({name}{blk}d == {k}, {taps}{k}, {name}{blk})" for k in range(1, n + 1)))
        w(f"{name}{blk}_hi = {name}{blk}.to(X.dtype.element_ty)",
          f"{name}{blk}_lo = ({name}{blk} - {name}{blk}_hi.to(tl.float32)).to(X.dtype.element_ty)")


def _mma_apply(w, out, name, a, b):
    """``out = {name}a @ a + {name}b @ b``, each matrix as its two 16-bit parts."""
    w(f"{out} = {_mma_dot(f'{name}a_hi', a)}", f"{out} = {_mma_dot(f'{name}a_lo', a, out)}",
      f"{out} = {_mma_dot(f'{name}b_hi', b, out)}", f"{out} = {_mma_dot(f'{name}b_lo', b, out)}")


def _mma_blocks(w, streams, ahead, dynamic):
    """Opens the MMA tile loop (the caller emits the body, then ``_mma_blocks_end``): at tile ``m`` (rows
    t0..t0+15), ``{pre}b0``, ``{pre}b1`` hold the input blocks around it (block j: rows start-8+16j ..
    start+7+16j; ``shift`` 8: the tile's own rows in ``{pre}b0``) of each stream ``(pre, row pointer, row stride,
    shift, wall)``, the next ``ahead`` blocks in flight. ``dynamic``: a loop the compiler keeps (the backward:
    unrolled, it is 13-17% slower on an H200 at 4 and 8 bidirectional steps), else unrolled (the forward: short
    programs of two tiles are the fastest)."""
    half = MMA_BLOCK // 2
    for pre, ptr, stride, shift, wall in streams:
        w(*(f"{pre}b{i} = {_wall_load(ptr, f'start + {shift - half + MMA_BLOCK * i} + mi', stride, wall, True)}"
            for i in range(ahead + 1)))
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
            w(f"if m + {1 + ahead} <= {blocks}:", f"    {new} = {_wall_load(ptr, f'{row} + mi', stride, wall, True)}",
              "else:", f"    {new} = {pre}b{ahead}")


def _mma_blocks_end(w, streams, ahead):
    for pre, *_ in streams:
        w(*(f"{pre}b{i} = {pre}b{i + 1}" for i in range(ahead + 1)))
    w.depth -= 1


def _mma_interior(w, kind, c, causal, S, ahead=0, walls=False):
    """``_fir_interior`` on tensor cores (the same taps and backward split; ``ahead``: see ``_mma_blocks``;
    ``walls``: tiles past the end are computed, not stored). Returns the condition for an interior program."""
    assert 1 <= S <= MMA_MAX_STEPS
    half = MMA_BLOCK // 2
    wall = _wall_kind(causal, walls)
    store_mask = ", mask=t0 + mi < L" if walls else ""
    w(f"mi = tl.arange(0, {MMA_BLOCK})[:, None]", f"mj = tl.arange(0, {MMA_BLOCK})[None, :]",
      f"offa = mj - mi - {half}", f"offb = mj - mi + {half}", "x2 = xrow[None, :]", "c2 = cols[None, :]")
    _fir_taps(w, "tap", causal, S, c)
    if kind == "fwd":
        _mma_band(w, "wf", "tap", S, "past" if causal else "both")
        streams = [("x", "x2", "sxl", 0, wall)]
        _mma_blocks(w, streams, ahead, dynamic=False)
        _mma_apply(w, "yv", "wf", "xb0", "xb1")
        w(f"tl.store(Y + (b64 * L + t0 + mi) * C + c2, yv.to(Y.dtype.element_ty){store_mask})")
        _mma_blocks_end(w, streams, ahead)
    else:
        # the coefficient's factor L^T (M^T)^(S-1) g (see _fir_backward): S + 1 taps on the input gradient's blocks
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
        # x in the accumulator's layout through an MMA with the identity (exact): loading it in that layout costs each
        # tile a layout conversion (5-10% slower at 4 and 8 steps on the three large shapes)
        w(f"acc2 += {_mma_dot('eye', 'xb0')} * lu")
        _mma_apply(w, "dxv", "wd", "gb0", "gb1")
        w(f"tl.store(DX + (b64 * L + t0 + mi) * C + c2, dxv.to(DX.dtype.element_ty){store_mask})")
        _mma_blocks_end(w, streams, ahead)
        w("acc = tl.sum(acc2, axis=0)")
    return f"(start - {half} >= 0) & (start + T + {half} <= L)"


# The backward's last program sums the coefficient gradient's partial sums FIN_ROWS rows (or FIN_ROWS * BLOCK_C
# scalars) at a time.
FINISH_CONSTEXPRS = {"fwd": (), "bwd": ("FIN_ROWS",)}


@functools.lru_cache(maxsize=None)  # (asked at every launch)
def stream_int_args(kind: str, static_rows: bool) -> Tuple[tuple, tuple]:
    """The streaming kernels' integer parameters: (runtime ints, constexprs before T and BLOCK_C: with
    ``static_rows``, the channels and row strides)."""
    ints = ("L", "C", "sxb", "sxl") + (("sgb", "sgl", "n_tiles", "n_groups") if kind == "bwd" else ())
    statics = tuple(n for n in ints if n in ("C", "sxl", "sgl")) if static_rows else ()
    return tuple(n for n in ints if n not in statics), statics


def stream_args(kind: str, static_rows: bool, t: int, block_c: int, **values) -> Tuple[tuple, tuple]:
    """(ints, constexprs) of a streaming launch from the named integer ``values`` (see ``stream_int_args``)."""
    ints, statics = stream_int_args(kind, static_rows)
    return tuple(values[n] for n in ints), tuple(values[n] for n in statics) + (t, block_c) + \
        tuple(values[n] for n in FINISH_CONSTEXPRS[kind])


def stream_source(spec: StreamKernelSpec) -> str:
    """Source of the streaming kernel ``spec``: the walk, and for the schemes that filter the banded filters."""
    w = _Src(depth=0)
    walk = _stream_head(w, spec)
    # Programs whose rows all lie inside the sequence (no padding mask, whole channel blocks) run a copy of the loop
    # without masks and validity factors, most of the instructions of these issue-bound kernels; the schemes that
    # filter run the banded filter there instead.
    interior_path = not spec.has_mask and spec.even_c
    carry = []
    general = _stream_body(spec, walk, carry, depth=3 if interior_path else 2, interior=False)
    filters = _stream_filters(spec) if interior_path else None
    inner = _stream_body(spec, walk, [], depth=3, interior=True) if interior_path and filters is None else None
    # initialise the loop-carried state (prefetch registers are loaded above)
    w(*(f"{v} = fz" for v in dict.fromkeys(carry) if not re.match(r"^[xgm]f\d+$", v)))
    if filters is not None and spec.walls == 3:
        w.lines += filters[0].lines
    elif filters is not None:
        fir, edge, fir_condition, edge_condition = filters
        w(f"interior = {fir_condition}", "if interior:")
        w.lines += fir.lines
        if spec.walls == 2:  # every other program: no walk in this kernel (it cost the filters registers)
            w("else:")
            w.lines += edge.lines
        elif spec.walls:
            w(f"elif {edge_condition}:")
            w.lines += edge.lines
    elif interior_path:
        lowest = walk.back + max(walk.nvv - 1, spec.steps if spec.kind == "bwd" else 0)  # validity; backward's x rows
        w(f"interior = (start - {lowest} >= 0) & (start - {walk.back} + T + {walk.lag + walk.prefetch} <= L)")
        w("if interior:", "    for j in range(0, n_it):")
        w.lines += inner.lines
    if not interior_path or filters is None or spec.walls < 2:
        if interior_path:
            w("else:")
        w(f"{'    ' if interior_path else ''}for j in range(0, n_it):")
        w.lines += general.lines
    return "\n".join(w.lines) + _coef_grad_store(spec) + "\n"


class _Walk:
    """The walk's geometry: ``back`` (rows it starts before the program's first), ``lag`` (iterations beyond T),
    ``nvv`` (validity lookups), ``prefetch`` and ``srcs``: (prefix, row pointer, row stride, row offset) of each
    input, iteration q reading row q + offset (the backward reads x at its output row, S rows behind g)."""

    def __init__(self, spec: StreamKernelSpec):
        S, bwd = spec.steps, spec.kind == "bwd"
        self.back = 0 if (bwd and spec.causal) else S
        self.lag = self.back + (S if (bwd or not spec.causal) else 0)  # output row = q - lag + back
        self.nvv = 2 if (spec.causal and not bwd) else S + 1
        self.prefetch = min(spec.prefetch, WALK_MAX_PREFETCH)  # (a rolled loop: its prefetch registers move every row)
        self.srcs = [("x", "xrow", "sxl", -S), ("g", "grow", "sgl", 0)] if bwd else [("x", "xrow", "sxl", 0)]


def _stream_head(w, spec: StreamKernelSpec) -> _Walk:
    """The kernel's signature and everything before its loops (ids, rows, clamped coefficients, prefetches, state)."""
    kind, causal, S, walk = spec.kind, spec.causal, spec.steps, _Walk(spec)
    scheme = SCHEMES[spec.pde]
    ints, statics = stream_int_args(kind, spec.static_rows)
    tensors = "X, Y, M, A, Bc, INIT, FIN" if kind == "fwd" else "GY, X, DX, M, A, Bc, DA, DB, WS, CNT"
    params = list(ints) + [f"{n}: tl.constexpr" for n in statics + ("T", "BLOCK_C") + FINISH_CONSTEXPRS[kind]]
    w("@triton.jit", f"def {spec.name}({tensors}, {', '.join(params)}):")
    w.depth = 1
    w("pid_c = tl.program_id(0)", "pid_l = tl.program_id(1)", "b64 = tl.program_id(2).to(tl.int64)",
      "cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)", "cmask = cols < C", "cz = cols.to(tl.int64) * 0")
    if spec.mma or ((kind, causal, spec.a_vec or spec.b_vec) in LAST_TILE_SECOND and spec.fir_unroll > 0
                    and spec.walls < 3):
        # The end programs walk, or run the walls' filter as a rolled loop: either takes longer than an interior
        # tile, so the last one is scheduled second (program 1) rather than last, not to run alone at the end.
        w("n_t = (L + T - 1) // T", "tile = tl.where(pid_l == 0, 0, tl.where(pid_l == 1, n_t - 1, pid_l - 1))",
          "start = tile.to(tl.int64) * T")
    else:
        w("start = pid_l.to(tl.int64) * T")
    w(f"p0 = start - {walk.back}", "fz = tl.zeros([BLOCK_C], dtype=tl.float32)", "xrow = X + b64 * sxb + cols")
    if kind == "bwd":
        w("grow = GY + b64 * sgb + cols")
    if spec.has_mask:
        w("mrow = M + b64 * L")
    bounds = spec.bounds or (None, None)
    _coef_lines(w, "a", "A", spec.a_vec, bounds[0])
    if scheme.uses_beta:
        _coef_lines(w, "b", "Bc", spec.b_vec, bounds[1])
        w("bp = tl.maximum(b, 0.0)", "bm = tl.minimum(b, 0.0)", "ab = a + b")
    if kind == "bwd" and scheme.advection:
        w("a = ab")  # causal advection-diffusion is diffusion with a + b
    w(f"n_it = (tl.minimum(L - start, T) + {walk.lag}).to(tl.int32)")
    for k in range(walk.prefetch):
        for pre, row, stride, off in walk.srcs:
            r = _rows(f"p0 + {k + off}")
            w(f"{pre}f{k} = tl.load({row} + (p0 + {k + off}) * {stride}, mask=cmask & ({r} >= 0) & ({r} < L), "
              f"other=0.0)")
        if spec.has_mask:
            w(f"mf{k} = tl.load(mrow + p0 + {k}, mask=(p0 + {k} >= 0) & (p0 + {k} < L), other=0)")
    for s in range(S if spec.has_init else 0):
        w(f"ini{s} = tl.load(INIT + b64 * {S} * C + {s} * C + cols, mask=cmask, other=0.0)")
    if kind == "bwd":
        w("acc = fz", "end = tl.minimum(start + T, L)")
    return walk


def _stream_filters(spec: StreamKernelSpec):
    """(interior filter, end programs' filter, the conditions for each) of a scheme that filters
    (``PDEScheme.filters``; every backward), or None: the walk's interior copy."""
    kind, causal, S, mma = spec.kind, spec.causal, spec.steps, spec.mma
    tensor_cores = bool(mma) and not spec.a_vec and not spec.b_vec
    filters = kind == "bwd" or SCHEMES[spec.pde].filters(causal)
    if not (filters and (tensor_cores or spec.fir_unroll > 0)):
        return None
    c = "ab" if (kind == "fwd" and causal and SCHEMES[spec.pde].advection) else "a"
    fir, edge = _Src(depth=2), _Src(depth=2)
    fir.widen = edge.widen = bool(spec.a_vec or spec.b_vec)
    fir_condition = None
    if spec.walls == 3:  # one copy of the filter, on the walls' extension, that every program runs
        fir.depth = 1
        _mma_interior(fir, kind, c, causal, S, ahead=mma - 1, walls=True)
    elif tensor_cores:
        fir_condition = _mma_interior(fir, kind, c, causal, S, ahead=mma - 1)
        if spec.walls:
            _mma_interior(edge, kind, c, causal, S, ahead=mma - 1, walls=True)
    else:
        fir_condition = _fir_interior(fir, kind, c, causal, S, spec.prefetch, spec.fir_unroll, pointers=spec.pointers)
        if spec.walls:  # a rolled loop: few programs run it, and a second unrolled copy cost the interior registers
            _fir_interior(edge, kind, c, causal, S, spec.prefetch, 1, walls=True)
    # end programs that may filter: one reflection covers S rows; the causal states' rows walk
    edge_condition = " & ".join(([] if causal else [f"(L >= {S})"])
                                + (["(start + T < L)"] if spec.write_final and causal else [])
                                + ([f"(start >= {S})"] if spec.has_init else [])) or "True"
    return fir, edge, fir_condition, edge_condition


def _coef_grad_store(spec: StreamKernelSpec) -> str:
    """The coefficient gradient (``acc``, times S) finished in the backward: partial sums into ``WS`` (stored, or
    with ``coef_atomic`` added into zeroed rows); the last program to count itself in ``CNT`` (per channel block, or
    one) sums them in a fixed order into ``DA`` (and ``DB``: causal advection uses a + b), zeroes what it read and
    its counter."""
    S = spec.steps
    if spec.kind != "bwd":
        return ""
    w = _Src(depth=1)
    per_channel = spec.a_vec or spec.b_vec
    if per_channel and spec.coef_atomic:  # (relaxed: only the sum is wanted)
        w(f"tl.atomic_add(WS + ((b64 * n_tiles + pid_l) % n_groups) * C + cols, acc * {S}, mask=cmask, sem='relaxed')")
    elif per_channel:
        w(f"tl.store(WS + (b64 * n_tiles + pid_l) * C + cols, acc * {S}, mask=cmask)")
    else:  # one partial sum per program (masked channels hold zeros)
        w(f"tl.store(WS + (b64 * n_tiles + pid_l) * tl.num_programs(0) + pid_c, tl.sum(acc, 0) * {S})")
    if not spec.finish:  # (summed by ``kernels_launch._coef_grad_like``)
        return "\n" + "\n".join(w.lines)
    # Every thread's partial sums precede the count (a CTA barrier, then the counter's acq_rel atomic: the release
    # covers them), and the last program's loads follow it (L2 reads: `.cg`).
    counter, programs = ("CNT + pid_c", "tl.num_programs(1) * tl.num_programs(2)") if per_channel else \
        ("CNT", "tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)")
    w("tl.debug_barrier()", f"if tl.atomic_add({counter}, 1, sem='acq_rel') == {programs} - 1:")
    w.depth = 2
    if per_channel:
        rows = "n_groups" if spec.coef_atomic else "tl.num_programs(1) * tl.num_programs(2)"
        w("total = tl.zeros([FIN_ROWS, BLOCK_C], dtype=tl.float32)", f"for r in range(0, {rows}, FIN_ROWS):",
          "    at = r + tl.arange(0, FIN_ROWS)", "    wp = WS + at[:, None] * C + cols[None, :]",
          f"    wm = (at[:, None] < {rows}) & cmask[None, :]",
          "    total += tl.load(wp, mask=wm, other=0.0, cache_modifier='.cg')")
        if spec.coef_atomic:
            w("    tl.store(wp, tl.zeros([FIN_ROWS, BLOCK_C], dtype=tl.float32), mask=wm)")
        w("grad = tl.sum(total, 0)", "at = cols")
    else:
        w("total = tl.zeros([FIN_ROWS * BLOCK_C], dtype=tl.float32)",
          f"for r in range(0, {programs}, FIN_ROWS * BLOCK_C):", "    at = r + tl.arange(0, FIN_ROWS * BLOCK_C)",
          f"    total += tl.load(WS + at, mask=at < {programs}, other=0.0, cache_modifier='.cg')",
          "grad = tl.sum(total, 0)", "at = cols * 0", "cmask = tl.arange(0, BLOCK_C) == 0")
    w("tl.store(DA + at, grad.to(DA.dtype.element_ty), mask=cmask)")
    if SCHEMES[spec.pde].advection:
        w("tl.store(DB + at, grad.to(DB.dtype.element_ty), mask=cmask)")
    w(f"tl.store({counter}, 0)")
    return "\n" + "\n".join(w.lines)


def _stream_body(spec: StreamKernelSpec, walk: _Walk, carry, depth, interior):
    """The walk's loop body (one row); loop-carried names go to ``carry``. ``interior``: no masks or validity."""
    b = _Src(depth)
    b("q = p0 + j")
    D = walk.prefetch
    for pre, row, stride, off in walk.srcs:
        b(f"{pre}q = {pre}f0", *(f"{pre}f{k} = {pre}f{k + 1}" for k in range(D - 1)))
        if interior:
            b(f"{pre}f{D - 1} = tl.load({row} + (q + {D + off}) * {stride})")
        else:
            rq = _rows(f"q + {D + off}")
            b(f"{pre}f{D - 1} = tl.load({row} + (q + {D + off}) * {stride}, mask=cmask & ({rq} >= 0) & ({rq} < L), "
              f"other=0.0)")
        carry += [f"{pre}f{k}" for k in range(D)]
    if spec.has_mask:
        b("mq = mf0", *(f"mf{k} = mf{k + 1}" for k in range(D - 1)))
        b(f"mf{D - 1} = tl.load(mrow + (q + {D}), mask=(q + {D} >= 0) & (q + {D} < L), other=0)")
        carry += [f"mf{k}" for k in range(D)]
        b("vq = mq.to(tl.float32)")
    elif not interior:
        b("vq = ((q >= 0) & (q < L)).to(tl.float32)")
    if not interior:
        # Validity of rows q-1..q-nvv+1 from the row index (and the mask, an L1-resident reload), not shifted between
        # iterations: the lagged kernels wrong on an H200 (exact in the interpreter) carried a chain of such scalars.
        b("vv0 = vq")
        for k in range(1, walk.nvv):
            if spec.has_mask:
                b(f"vv{k} = tl.load(mrow + (q - {k}), mask=(q - {k} >= 0) & (q - {k} < L), other=0).to(tl.float32)")
            else:
                b(f"vv{k} = ((q - {k} >= 0) & (q - {k} < L)).to(tl.float32)")
    store_mask = f"{_rows('ro')} >= start" if interior else f"cmask & ({_rows('ro')} >= start) & ({_rows('ro')} < L)"
    (_forward_levels if spec.kind == "fwd" else _backward_levels)(b, spec, carry, interior, store_mask)
    return b


def _forward_levels(b, spec: StreamKernelSpec, carry, interior, store_mask):
    """The forward walk's levels at row q and the store of its output row."""
    S, scheme = spec.steps, SCHEMES[spec.pde]
    b("xn0 = xq.to(tl.float32)")
    if spec.causal:
        _causal_levels(b, "x", scheme, 1, S, carry, spec.has_init, interior=interior)
        if spec.write_final and not interior:  # row L-1 is never in an interior program
            b("if q == L - 1:", *(f"    tl.store(FIN + b64 * {S} * C + {s} * C + cols, xn{s} * vq, mask=cmask)"
                                  for s in range(S)))
        b("ro = q")
    else:
        _bidi_levels(b, "x", scheme, 1, S, carry, interior=interior)
        b(f"ro = q - {S}")
    b(f"tl.store(Y + (b64 * L + ro) * C + cols, xn{S}.to(Y.dtype.element_ty), mask={store_mask})")


def _backward_levels(b, spec: StreamKernelSpec, carry, interior, store_mask):
    """The backward walk: dc = S * <L^T (M^T)^(S-1) g, x>; the adjoint walk on g yields the factor at the output row
    ro = q - S as the last level's flux difference, paired with x read at that row (no walk on x)."""
    S = spec.steps
    b("gn0 = gq.to(tl.float32)")
    p, n = f"gp{S - 1}", f"gn{S - 1}"  # level S-1 at rows q-S and q-S+1
    if spec.causal:
        # adjoint (anti-causal): level s at row q-s from g rows q-s (p) and q-s+1 (n)
        for s in range(1, S):
            ps, ns = f"gp{s - 1}", f"gn{s - 1}"
            diff = f"({ns} - {ps})" if interior else f"vv{s} * ({ns} * vv{s - 1} - {ps})"
            b(f"gn{s} = {ps} + a * {diff}", f"{ps} = {ns}")
            carry.append(ps)
        b(f"lu = {n} - {p}" if interior else f"lu = vv{S} * ({n} * vv{S - 1} - {p})")  # (L^T u)_ro
    else:
        _bidi_levels(b, "g", SCHEMES["diffusion"], 1, S - 1, carry, c="a", interior=interior)
        b(f"gF = {n} - {p}" if interior else f"gF = ({n} - {p}) * vv{S} * vv{S - 1}")  # flux ro -> ro+1
        b("lu = gF - gFl", "gFl = gF")  # (L u)_ro, L symmetric
        carry.append("gFl")
    b(f"gn{S} = {p} + a * lu", f"{p} = {n}", f"ro = q - {S}")
    carry.append(p)
    acc_mask = f"{_rows('ro')} >= start" if interior else f"({_rows('ro')} >= start) & ({_rows('ro')} < end)"
    b(f"acc += tl.where({acc_mask}, xq.to(tl.float32) * lu, 0.0)")
    b(f"tl.store(DX + (b64 * L + ro) * C + cols, gn{S}.to(DX.dtype.element_ty), mask={store_mask})")
