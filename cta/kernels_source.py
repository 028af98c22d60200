# coding=utf-8
"""The streaming Triton kernels of the CTA PDE operator, as generated source (one kernel per scheme, step count and
launch options; ``stream_kernel(key)`` builds and caches it).

A program owns ``BLOCK_C`` channels x ``T`` positions (rows) and walks along the sequence one row at a time. Every
pseudo-time level ``s = 1..S`` keeps the few row vectors its stencil still needs in registers, so level ``s`` advances
as soon as level ``s - 1`` has produced its right neighbour: a wavefront through (row, level) space (``S`` rows of lag
for bidirectional stencils, none for causal ones). Each input row is read once, each output row written once, rows
are prefetched ``D`` ahead, and threads never exchange data. The operations are the reference's, in the same order
(flux form, the same walls at sequence ends and padding), so fp32 results match it to rounding. The source is
generated because the number of register vectors carried from row to row depends on ``S``.

* Interior programs of the linear schemes (diffusion; causal advection-diffusion, which is diffusion with ``a + b``)
  do not walk: ``S`` levels of a constant-coefficient stencil are one banded filter (the stencil's ``S``-th power,
  ``2S+1`` or ``S+1`` taps in closed form), applied to a window of rows kept in registers (``_fir_interior``), or,
  for a scalar coefficient and 16-bit inputs, on tensor cores as 16-row MMA tiles (``_mma_interior``). Programs at
  the sequence ends filter too, reading the walls as an extension of the input (``_wall_load``); padding masks,
  partial channel blocks and causal states walk.
* The linear schemes' backward is one streaming pass: the step matrix ``M = I + a L`` is symmetric bidirectionally,
  so ``dx = M^S g`` is the forward walk on ``g`` (causal: the anti-causal adjoint walk), and
  ``dL/da = S <L^T (M^T)^(S-1) g, x>`` pairs the walk's last level with ``x`` read at the output row only. The
  coefficient gradient is summed per program and added with atomics (per channel) or stored per program (scalar).
* Row validity (sequence ends, padding) is recomputed from the row index in every iteration, never carried between
  iterations: a chain of loop-carried validity scalars gave wrong results on an H200 (triton 3.6) while exact in
  the interpreter.

The measurements behind each choice are in ``docs/kernels.md``; the launch configurations in ``kernels_config``.
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
        self.lines = []
        self.depth = depth
        self.widen = False  # the register filters' 16-bit rows widen through ``_widen`` (see ``_widened``)

    def __call__(self, line):
        self.lines.append("    " * self.depth + line)


def _coef_lines(w, name, ptr, vec, bounds):
    if vec:
        w(f"{name} = tl.load({ptr} + cols, mask=cmask, other=0.0).to(tl.float32)")
    else:  # one scalar load, broadcast by the arithmetic
        w(f"{name} = tl.load({ptr}).to(tl.float32)")
    if bounds is not None:  # the module's projection onto the stable bounds, in the kernel (no clamp launch)
        w(f"{name} = tl.minimum(tl.maximum({name}, {float(bounds[0])!r}), {float(bounds[1])!r})")


def _bidi_levels(w, pre, scheme, first, last, carry, c="a", interior=False):
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
        if scheme.wave:
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
            if scheme.advection:
                w(f"{pre}G{s} = ({c} * {pre}d{s} - bp * {p} - bm * {n}){times_e}")
            else:
                w(f"{pre}G{s} = {c} * {pre}d{s}{times_e}")
            w(f"{pre}up{s} = {pre}G{s} - {pre}gl{s}")
            if scheme.reaction:  # the scheme's reaction R(u, b) (``_react``)
                w(f"{pre}up{s} = {pre}up{s} + _react({p}, b)" + ("" if interior else f" * vv{s}"))
            w(f"{pre}gl{s} = {pre}G{s}")
            w(f"{pre}n{s} = {p} + {pre}up{s}")
            carry.append(f"{pre}gl{s}")
        w(f"{p} = {n}")
        carry.append(p)


def _causal_levels(w, pre, scheme, first, last, carry, has_init=False, c="a", interior=False):
    """Causal levels at row q: level s from ``{pre}n{s-1}`` (row q) and ``{pre}p{s-1}`` (row q-1). ``interior``: as
    in :func:`_bidi_levels` (and row 0, where the initial state enters, is never in an interior program)."""
    times_v0 = "" if interior else " * vv0"
    for s in range(first, last + 1):
        p, n = f"{pre}p{s - 1}", f"{pre}n{s - 1}"
        w(f"{pre}left{s} = {p}" + ("" if interior else " * vv1"))
        if has_init and not interior:
            w(f"{pre}left{s} = tl.where(q == 0, ini{s - 1}, {pre}left{s})")
        w(f"{pre}pull{s} = {pre}left{s} - {n}")
        if scheme.wave:
            if s == 1:
                w(f"{pre}nv{s} = {c} * {pre}pull{s}{times_v0}")
            else:
                w(f"{pre}nv{s} = _KEEP * {pre}nv{s - 1} + {c} * {pre}pull{s}{times_v0}")
            w(f"{pre}n{s} = {n} + {pre}nv{s}")
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
    run past the sequence end, and stops there."""
    # (int32: the loop index must have one type in every branch of the kernel, and the walk's is int32)
    bound = "tl.minimum(L - start, T).to(tl.int32)" if walls is True else "T"
    w(f"for j in tl.range(0, {bound}, loop_unroll_factor={unroll}):" if unroll > 1 else f"for j in range(0, {bound}):")
    w.depth += 1
    w("t = start + j")


def _widened(w, value: str) -> str:
    """``value`` (a 16-bit row) as fp32, in the filter source ``w`` (``w.widen``: through ``_widen``)."""
    return f"_widen({value})" if w.widen else f"{value}.to(tl.float32)"


class _Rows:
    """Emits the loads of one stream's consecutive rows, from row ``first`` on: ``load(dest, r)`` sets ``dest`` to
    row ``r`` (which must be the row after the previous load's) through a stepping pointer ``name`` (``pointers``,
    no walls' extension: see ``kernels_config.FIR_POINTER_STEPS``), or by index (``_wall_load``)."""

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


def _fir_store(w, base, value, wall, pointers):
    """Stores ``value`` at row ``t`` of ``base`` (an output's [batch, seq, channels] pointer): through a pointer
    ``{base}_at`` that steps one row per store where ``_Rows`` steps (it is set before the loop, see
    ``_fir_store_start``), else by index."""
    if pointers and wall is None:
        w(f"tl.store({base.lower()}_at, {value})")
        w(f"{base.lower()}_at += C")
    else:
        w(f"tl.store({base} + (b64 * L + t) * C + cols, {value})")


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


def _fir_interior(w, kind, c, causal, S, D, unroll, walls=False, pointers=False):
    """The interior branch of a linear scheme's streaming kernel as a banded filter (see above). Returns the
    condition under which a program may take it (every row it reads lies inside the sequence). ``walls``: the same
    filter for programs at the sequence ends (rows beyond them read as the walls' extension, see ``_wall_load``).
    ``c``: the name of the stencil's coefficient."""
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
    _fir_store_start(w, "Y", wall, pointers)
    _fir_loop(w, unroll, walls)
    _fir_next_row(w, "x", x_rows, lead, D, f"xw{wide - 1}")
    _fir_apply(w, "yv", "tap", S, "xw", causal, S)
    _fir_store(w, "Y", "yv.to(Y.dtype.element_ty)", wall, pointers)
    for i in range(wide - 1):
        w(f"xw{i} = xw{i + 1}")
    w.depth -= 1
    return f"(start + {lead - wide + 1} >= 0) & (start + T + {lead + D} <= L)"


def _fir_backward(w, causal, S, D, unroll, walls=False, pointers=False):
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
        _fir_taps(w, "gtap", causal, k, "a")

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


def _mma_dot(a, b, acc=None):
    """A 16-bit tensor-core product (fp32 accumulation). The interpreter's bf16 ``tl.dot`` returns garbage
    (triton 3.9; its fp16 and fp32 products are right), so there the same operands go through an exact fp32
    product."""
    if INTERPRET:
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


def _mma_interior(w, kind, c, causal, S, ahead=0, walls=False):
    """The interior branch of a linear scheme's streaming kernel as the banded filter on tensor cores (see above;
    the same taps, and in the backward the same per-row split of the coefficient gradient, as ``_fir_interior``).
    ``ahead``: see ``_mma_blocks``. ``walls``: the same for programs at the sequence ends (see ``_wall_load``; tiles
    past the end are computed, not stored). Returns the condition under which an interior program may take it."""
    assert 1 <= S <= MMA_MAX_STEPS
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
def stream_int_args(kind: str, static_rows: bool) -> Tuple[tuple, tuple]:
    """The streaming kernels' integer parameters, in order: (runtime ints, constexprs before T and BLOCK_C). The
    channels ``C`` and the row strides are constexprs with ``static_rows``."""
    ints = ("L", "C", "sxb", "sxl") + (("sgb", "sgl", "n_tiles", "n_groups") if kind == "bwd" else ())
    statics = tuple(n for n in ints if n in ("C", "sxl", "sgl")) if static_rows else ()
    return tuple(n for n in ints if n not in statics), statics


def stream_args(kind: str, static_rows: bool, t: int, block_c: int, **values) -> Tuple[tuple, tuple]:
    """(ints, constexprs) of a streaming launch from the named integer ``values`` (see ``_stream_int_args``)."""
    ints, statics = stream_int_args(kind, static_rows)
    return tuple(values[n] for n in ints), tuple(values[n] for n in statics) + (t, block_c)


def stream_source(spec: StreamKernelSpec) -> str:
    """Source of the streaming kernel ``spec`` (see :class:`StreamKernelSpec`): the walk, and for the schemes that
    filter the banded filters of the interior (and end) programs."""
    w = _Src(depth=0)
    walk = _stream_head(w, spec)
    # Programs whose rows (loads, prefetches and validity lookups) all lie inside the sequence run a copy of the loop
    # with no masks and no validity factors: the kernels are instruction-issue bound, and those are most of the
    # instructions. Needs no padding mask and whole channel blocks.
    interior_path = not spec.has_mask and spec.even_c
    carry = []
    general = _stream_body(spec, walk, carry, depth=3 if interior_path else 2, interior=False)
    # ... and the schemes that filter run the banded filter in their interior programs instead (``fir_unroll`` > 0:
    # its loop's unroll factor; 0: the walk's interior copy).
    filters = _stream_filters(spec) if interior_path else None
    inner = _stream_body(spec, walk, [], depth=3, interior=True) if interior_path and filters is None else None
    seen = set()  # initialise the loop-carried state (prefetch registers are loaded above)
    for v in carry:
        if v not in seen and not re.match(r"^[xgm]f\d+$", v):
            w(f"{v} = fz")
        seen.add(v)
    if filters is not None and spec.walls == 3:
        w.lines += filters[0].lines
    elif filters is not None:
        fir, edge, fir_condition, edge_condition = filters
        w(f"interior = {fir_condition}")
        w("if interior:")
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
        w("if interior:")
        w("    for j in range(0, n_it):")
        w.lines += inner.lines
    if interior_path and not (filters is not None and spec.walls >= 2):
        w("else:")
        w("    for j in range(0, n_it):")
        w.lines += general.lines
    elif not interior_path:
        w("for j in range(0, n_it):")
        w.lines += general.lines
    return "\n".join(w.lines) + _coef_grad_store(spec) + "\n"


class _Walk:
    """What the walk's loop body needs from the kernel's head: ``back`` (rows it starts before the program's first:
    the bidirectional levels' lag; the causal forward needs rows behind, the causal backward's adjoint only rows
    ahead), ``lag`` (iterations beyond T), ``nvv`` (validity lookups), ``prefetch`` and ``srcs``: (prefix, row
    pointer, row stride, row offset) of each input, iteration q reading row q + offset (the backward reads x at its
    output row, S rows behind g)."""

    def __init__(self, spec: StreamKernelSpec):
        S, bwd = spec.steps, spec.kind == "bwd"
        self.back = 0 if (bwd and spec.causal) else S
        self.lag = self.back + (S if (bwd or not spec.causal) else 0)  # output row = q - lag + back
        self.nvv = 2 if (spec.causal and not bwd) else S + 1
        self.prefetch = min(spec.prefetch, WALK_MAX_PREFETCH)  # (a rolled loop: its prefetch registers move every row)
        self.srcs = [("x", "xrow", "sxl", -S), ("g", "grow", "sgl", 0)] if bwd else [("x", "xrow", "sxl", 0)]


def _stream_head(w, spec: StreamKernelSpec) -> _Walk:
    """The kernel's signature and everything before its loops: program ids, rows, coefficients (clamped into
    ``spec.bounds``), prefetched rows, the initial state."""
    kind, causal, S, walk = spec.kind, spec.causal, spec.steps, _Walk(spec)
    scheme = SCHEMES[spec.pde]
    ints, statics = stream_int_args(kind, spec.static_rows)
    tensors = "X, Y, M, A, Bc, INIT, FIN" if kind == "fwd" else "GY, X, DX, M, A, Bc, DA"
    params = list(ints) + [f"{n}: tl.constexpr" for n in statics + ("T", "BLOCK_C")]
    w("@triton.jit")
    w(f"def {spec.name}({tensors}, {', '.join(params)}):")
    w.depth = 1
    for line in ("pid_c = tl.program_id(0)", "pid_l = tl.program_id(1)", "b64 = tl.program_id(2).to(tl.int64)",
                 "cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)", "cmask = cols < C", "cz = cols.to(tl.int64) * 0"):
        w(line)
    if spec.mma or ((kind, causal, spec.a_vec or spec.b_vec) in LAST_TILE_SECOND and spec.fir_unroll > 0
                    and spec.walls < 3):
        # The end programs walk, or run the walls' filter as a rolled loop: either takes longer than an interior
        # tile, so the last one is scheduled second (program 1) rather than last, not to run alone at the end.
        w("n_t = (L + T - 1) // T")
        w("tile = tl.where(pid_l == 0, 0, tl.where(pid_l == 1, n_t - 1, pid_l - 1))")
        w("start = tile.to(tl.int64) * T")
    else:
        w("start = pid_l.to(tl.int64) * T")
    w(f"p0 = start - {walk.back}")
    w("fz = tl.zeros([BLOCK_C], dtype=tl.float32)")
    w("xrow = X + b64 * sxb + cols")
    if kind == "bwd":
        w("grow = GY + b64 * sgb + cols")
    if spec.has_mask:
        w("mrow = M + b64 * L")
    bounds = spec.bounds or (None, None)
    _coef_lines(w, "a", "A", spec.a_vec, bounds[0])
    if scheme.uses_beta:
        _coef_lines(w, "b", "Bc", spec.b_vec, bounds[1])
        w("bp = tl.maximum(b, 0.0)")
        w("bm = tl.minimum(b, 0.0)")
        w("ab = a + b")
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
        w("acc = fz")
        w("end = tl.minimum(start + T, L)")
    return walk


def _stream_filters(spec: StreamKernelSpec):
    """(interior filter source, end programs' filter source, the conditions under which a program takes each) of a
    scheme that filters (``PDEScheme.filters``; the backward always does), or None: the walk's interior copy."""
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
    # which end programs may filter: one reflection covers S rows; the causal final state and the rows an initial
    # state reaches are the walk's
    edge_condition = " & ".join(([] if causal else [f"(L >= {S})"])
                                + (["(start + T < L)"] if spec.write_final and causal else [])
                                + ([f"(start >= {S})"] if spec.has_init else [])) or "True"
    return fir, edge, fir_condition, edge_condition


def _coef_grad_store(spec: StreamKernelSpec) -> str:
    """The backward's store of its coefficient-gradient partial sums (``acc``, times S)."""
    S = spec.steps
    if spec.kind != "bwd":
        return ""
    if (spec.a_vec or spec.b_vec) and spec.coef_atomic:  # summed in place (relaxed: only the sum is wanted)
        return (f"\n    tl.atomic_add(DA + ((b64 * n_tiles + pid_l) % n_groups) * C + cols, acc * {S}, mask=cmask, "
                f"sem='relaxed')")
    if spec.a_vec or spec.b_vec:  # per-channel partial sums (causal advection's coefficient is a + b)
        return f"\n    tl.store(DA + (b64 * n_tiles + pid_l) * C + cols, acc * {S}, mask=cmask)"
    # a scalar coefficient: one partial sum per program (masked channels hold zeros)
    return f"\n    tl.store(DA + (b64 * n_tiles + pid_l) * tl.num_programs(0) + pid_c, tl.sum(acc, 0) * {S})"


def _stream_body(spec: StreamKernelSpec, walk: _Walk, carry, depth, interior):
    """The loop body of :func:`stream_source` (one row), appending the loop-carried names to ``carry``.
    ``interior``: every row touched is inside the sequence (no masks, validity factors left out)."""
    b = _Src(depth)
    b("q = p0 + j")
    D = walk.prefetch
    for pre, row, stride, off in walk.srcs:
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
    if spec.has_mask:
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
            b("if q == L - 1:")
            for s in range(S):
                b(f"    tl.store(FIN + b64 * {S} * C + {s} * C + cols, xn{s} * vq, mask=cmask)")
        b("ro = q")
    else:
        _bidi_levels(b, "x", scheme, 1, S, carry, interior=interior)
        b(f"ro = q - {S}")
    b(f"tl.store(Y + (b64 * L + ro) * C + cols, xn{S}.to(Y.dtype.element_ty), mask={store_mask})")


def _backward_levels(b, spec: StreamKernelSpec, carry, interior, store_mask):
    """The backward walk: dc = S * <g, L M^(S-1) x> = S * <L^T (M^T)^(S-1) g, x> (L and M commute: M = I + a L). The
    adjoint walk on g yields the factor at the output row ro = q - S as the last level's flux difference, paired
    with x read at that row (the x stream lags S rows): no walk on x at all."""
    S = spec.steps
    b("gn0 = gq.to(tl.float32)")
    p, n = f"gp{S - 1}", f"gn{S - 1}"  # level S-1 at rows q-S and q-S+1
    if spec.causal:
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
        _bidi_levels(b, "g", SCHEMES["diffusion"], 1, S - 1, carry, c="a", interior=interior)
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
