# coding=utf-8
"""Launch configurations of the Triton PDE kernels: which streaming-kernel variant a launch runs, with how many
rows, channels, warps and prefetched rows per program.

Every entry was chosen on an H200 (triton 3.6, bf16) on the shapes 1x16384x4096, 8x4096x4096 and 1x65536x512, with
its provenance beside it; the runs behind them are in git history (``benchmarks/results/stream_tuning_*``;
``git show 25c3332:docs/kernels.md``). The interpreter takes ``INTERPRETER_CONFIG``: short programs and narrow
channel blocks, so that small test shapes run every branch a long GPU input runs (interior, ends, partial blocks).
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass
from typing import Optional, Tuple

import torch


MAX_FUSED_STEPS = 16  # steps 1..16 run fused; more fall back to the PyTorch reference


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: that is a JITFunction, ~5 us of host time per call outside a kernel


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def tile_config(seq: int, channels: int, causal: bool, steps: int, linear: bool, device: torch.device):
    """(HL, T, BLOCK_L, BLOCK_C, num_warps) of the tile backward (``kernels_jit._pde_bwd_kernel``: wave, reaction,
    bidirectional advection, causal states): left halo, output rows, tile rows, channels, warps. GPU sizes from a
    sweep on an H200 ((1,16384,4096), 4 diffusion steps); larger tiles in the interpreter."""
    hl = steps if causal or linear else 2 * steps
    halo = 2 * hl
    if device.type != "cuda":  # interpreter: fewer, larger numpy programs are faster
        block_l = next_pow2(max(halo + min(seq, 64), 2 * halo + 1, 2))
        block_c = min(next_pow2(channels), 128)
    else:
        block_l = 64
        while block_l < 4 * halo and block_l < 256:
            block_l *= 2
        block_l = max(block_l, next_pow2(halo + 1))  # (so T = BLOCK_L - halo >= 1, as in the interpreter)
        block_c = (128 if causal else 64) if block_l <= 64 else max(16, 4096 // block_l)
        block_c = max(16, min(next_pow2(channels), block_c))
    return hl, block_l - halo, block_l, block_c, 4


# The streaming kernels (``kernels_source``): (T, BLOCK_C, num_warps, D, U) per (kernel, causal) and tuned step
# count: rows and channels per program, warps, prefetch depth, the banded filter's unroll factor. Other step counts
# use the nearest tuned one (ties: the smaller). Scalar coefficient (the models' default):
STREAM_CONFIGS = {
    # the best of a grid of 480 configurations per key, then of unroll factors (4 and 8 steps: with closed-form taps)
    ("fwd", False): {1: (8, 256, 2, 3, 8), 2: (8, 256, 2, 3, 8), 4: (24, 64, 1, 3, 24), 8: (17, 256, 2, 2, 17)},
    ("fwd", True): {1: (8, 256, 2, 3, 8), 2: (8, 128, 1, 3, 16), 4: (8, 256, 2, 3, 8), 8: (18, 256, 2, 2, 18)},
    # tuned for the backward that filters g only (rows 16-24, warps 1-4, prefetch 2-3, unroll 1 or whole)
    ("bwd", False): {1: (16, 256, 4, 3, 16), 2: (16, 128, 2, 3, 16), 4: (16, 128, 2, 2, 16), 8: (24, 128, 2, 3, 24)},
    ("bwd", True): {1: (16, 256, 4, 3, 1), 2: (16, 128, 1, 3, 16), 4: (16, 128, 2, 3, 1), 8: (16, 256, 2, 3, 16)},
}
# Entries that differ for a coefficient per channel (per-channel taps hold more registers; Nsight Compute showed the
# 4-step kernels waiting on loads, hence deeper prefetch):
STREAM_CONFIGS_PER_CHANNEL = {
    # 8 steps: tuned with constant row offsets and filtering ends (17 rows beat 16, 18, 24 and 34)
    ("fwd", False): {4: (24, 64, 1, 8, 24), 8: (17, 256, 2, 4, 17)},
    ("fwd", True): {1: (8, 256, 2, 8, 8), 4: (8, 256, 2, 8, 8), 8: (24, 256, 2, 12, 24)},
    ("bwd", False): {1: (24, 256, 4, 8, 24), 2: (24, 128, 2, 8, 24), 4: (24, 128, 2, 8, 24), 8: (24, 128, 2, 8, 24)},
    ("bwd", True): {1: (24, 256, 4, 12, 1), 2: (24, 128, 1, 12, 24), 8: (24, 128, 2, 6, 24)},
}
# The walk (padding masks, some sequence ends) keeps at most this prefetch depth: its loop is not unrolled, so every
# prefetch register moves once per row (the depths above were measured on the filters' unrolled loops).
WALK_MAX_PREFETCH = 3

# Interior programs with a scalar coefficient and 16-bit inputs run the banded filter on tensor cores (16-row MMA
# tiles) from MMA_MIN_STEPS[(kind, causal)] to MMA_MAX_STEPS steps (None: never). Paired against the register
# filter: the forward wins from 3 steps (1.11 vs 1.40x copy at 8 bidirectional steps), the bidirectional backward
# from 7 (1.97 vs 2.38x at 8), the causal backward never.
MMA_BLOCK = 16  # rows of one MMA tile; the input blocks sit half a tile either side, which bounds the steps
MMA_MAX_STEPS = MMA_BLOCK // 2
MMA_MIN_STEPS = {("fwd", False): 3, ("fwd", True): 3, ("bwd", False): 7, ("bwd", True): None}
# (T, BLOCK_C, num_warps, D, A) of its programs; A: input blocks loaded ahead. Bidirectional: the best of one grid
# at 8 steps on all three shapes (forward 1.05 / 1.04 / 1.08x copy, backward 1.75 / 1.73 / 1.88x); causal forward:
# the best at 4 and 8 steps on 1x16384x4096.
MMA_CONFIGS = {("fwd", False): (32, 256, 4, 2, 2), ("fwd", True): (32, 128, 4, 2, 1),
               ("bwd", False): (256, 128, 2, 2, 1), ("bwd", True): (128, 128, 4, 2, 1)}

# The interpreter's configuration of every launch (register filter, tensor-core filter): see the module docstring.
INTERPRETER_CONFIG = (16, 16, 1, 2, 2)
INTERPRETER_MMA_CONFIG = (32, 16, 1, 2, 1)

# The most steps at which per-channel launches filter their sequence ends, per (kernel, causal); above, the ends walk
# (there the ends' copy of the per-channel filter slows the interior programs by more than walking costs).
WALLS_MAX_STEPS_PER_CHANNEL = {("fwd", False): 8, ("fwd", True): 8, ("bwd", False): 8, ("bwd", True): 4}

# Register-filter launches, keyed (kernel, causal, per-channel), whose end programs take longer than an interior tile
# run the last row tile second, not last (8-step causal backward 1.61 vs 1.71x copy); the tensor-core filter's
# launches always do.
LAST_TILE_SECOND = frozenset({("bwd", True, True), ("bwd", False, True), ("fwd", True, True)})

# Register-filter launches, keyed (kernel, causal, per-channel), whose interior filters step their row pointers one
# row per load instead of computing each row's address (8-step per-channel bidirectional forward 1.36 vs 1.39x copy).
FIR_POINTER_STEPS = frozenset({("fwd", False, True), ("fwd", True, True), ("bwd", False, True)})

# Register-filter launches, keyed likewise, that take the channels and row strides as constexprs, so that unrolled
# rows load at constant offsets from one pointer (8-step per-channel bidirectional forward 1.28 vs 1.34x copy). One
# compiled kernel per channel count and row stride.
STATIC_ROWS = frozenset({("fwd", False, True), ("bwd", False, True), ("bwd", True, True)})

# A per-channel coefficient's gradient: each backward program adds its partial sums with atomics into one of a few
# [channels] rows, so that about this many addresses share the atomics (1.53-2.06x copy against 1.68-2.52x for
# per-program partial sums); a fixed order under torch.use_deterministic_algorithms(True).
COEF_GRAD_ATOMIC_SPREAD = 4096


# The backward's last program finishes the coefficient gradient (one launch, host time) up to this many elements;
# beyond, where the GPU time dominates, a second kernel sums the partial sums: at 1x16384x4096, 8x4096x4096 and
# 1x65536x512 (4 and 8 steps, per channel, H200) the in-kernel finish costs 4-11% of the forward+backward's GPU time.
FINISH_MAX_ELEMENTS = 1 << 24


def coef_grad_groups(channels: int, programs: int) -> int:
    """Rows of the atomics' [rows, channels] sum: a power of two giving about ``COEF_GRAD_ATOMIC_SPREAD``
    addresses, or one row per program where there are fewer programs."""
    return max(1, min(next_pow2(cdiv(COEF_GRAD_ATOMIC_SPREAD, channels)), programs))


def fit_program(seq: int, channels: int, t: int, block_c: int) -> Tuple[int, int]:
    """(T, BLOCK_C) fitted to the input: rows doubled until the grid's second axis fits (65535), channels within
    [16, the next power of two of ``channels``]."""
    while cdiv(seq, t) > 65535:
        t *= 2
    return t, max(16, min(block_c, next_pow2(channels)))


def stream_entry(kind: str, causal: bool, steps: int, per_channel: bool) -> tuple:
    """The GPU (T, BLOCK_C, num_warps, D, U) of a register-filter launch: the entry of the nearest tuned step count,
    ``STREAM_CONFIGS_PER_CHANNEL``'s over ``STREAM_CONFIGS``' for a ``per_channel`` coefficient."""
    table = STREAM_CONFIGS[(kind, bool(causal))]
    tuned = min(table, key=lambda tuned: (abs(tuned - steps), tuned))
    overrides = STREAM_CONFIGS_PER_CHANNEL.get((kind, bool(causal)), {}) if per_channel else {}
    return overrides.get(tuned, table[tuned])


def stream_plan(seq: int, channels: int, dtype: torch.dtype, on_gpu: bool, kind: str, steps: int, causal: bool,
                per_channel: bool, has_mask: bool, linear: bool) -> Tuple[int, int, int, int, int, int]:
    """(T, BLOCK_C, num_warps, D, U, mma) of one streaming launch on ``[batch, seq, channels]`` inputs of ``dtype``
    (on a GPU, else in the interpreter): the tensor-core filter's programs where it applies and the channels fill whole
    blocks of them (``mma`` = 1 + blocks loaded ahead), the register filter's otherwise (``mma`` = 0)."""
    first = MMA_MIN_STEPS.get((kind, bool(causal)))
    if (linear and not per_channel and not has_mask and first is not None and first <= steps <= MMA_MAX_STEPS
            and dtype in (torch.bfloat16, torch.float16)):
        cfg = MMA_CONFIGS[(kind, bool(causal))] if on_gpu else INTERPRETER_MMA_CONFIG
        t, block_c = fit_program(seq, channels, *cfg[:2])
        if channels % block_c == 0 and t % MMA_BLOCK == 0:
            return t, block_c, cfg[2], cfg[3], 0, 1 + cfg[4]
    cfg = stream_entry(kind, causal, steps, per_channel) if on_gpu else INTERPRETER_CONFIG
    t, block_c = fit_program(seq, channels, *cfg[:2])
    return t, block_c, cfg[2], cfg[3], cfg[4], 0


def walls_mode(kind: str, seq: int, steps: int, causal: bool, has_init: bool, write_final: bool,
               per_channel: bool, mma: bool) -> int:
    """How end programs run (``StreamKernelSpec.walls``): 0 walk, 1 filter the walls' extension where it applies (not
    where a causal state reaches) and walk elsewhere, 2 filter (no walk in the kernel), 3 as 2 with one copy of the
    filter that every program runs (the bidirectional tensor-core forward: 1.11 vs 1.15x copy at 8 steps)."""
    if per_channel and steps > WALLS_MAX_STEPS_PER_CHANNEL[(kind, bool(causal))]:
        return 0
    if not causal and seq < steps:  # one reflection covers S rows: no program of this launch can filter its ends
        return 0
    if has_init or (causal and write_final):  # the programs the state reaches walk, the others filter
        return 1
    return 3 if (kind == "fwd" and not causal and mma) else 2


def static_rows(kind: str, causal: bool, per_channel: bool, unroll: int, mma: int) -> bool:
    return unroll > 0 and not mma and (kind, bool(causal), bool(per_channel)) in STATIC_ROWS


@dataclass(frozen=True)
class StreamKernelSpec:
    """One generated streaming kernel. ``kind`` 'fwd': ``Y = scheme^S(X)`` (+ causal final state); 'bwd' (schemes
    that filter, no initial state): ``DX = adjoint^S(GY)`` and partial sums of ``dL/dc`` in ``DA``. ``steps`` = S,
    ``prefetch`` = D; ``has_mask`` (padding), ``a_vec`` / ``b_vec`` (per-channel coefficients), ``has_init`` /
    ``write_final`` (causal states), ``even_c`` (whole channel blocks). ``fir_unroll``: the banded filter's unroll
    factor (0: interior programs walk). ``mma`` > 0: interior programs filter on tensor cores, ``mma - 1`` blocks
    ahead. ``walls``: see ``walls_mode``. ``coef_atomic``: partial sums added with atomics into
    ``WS[n_groups, channels]`` (``COEF_GRAD_ATOMIC_SPREAD``); ``finish``: the last program sums them
    (``FINISH_MAX_ELEMENTS``). ``pointers``: ``FIR_POINTER_STEPS``; ``static_rows``:
    ``STATIC_ROWS``. ``bounds``: the ``coefficient_bounds`` the coefficients are clamped into as they are loaded (the
    learnable module's projection), or None."""

    kind: str
    pde: str
    causal: bool
    steps: int
    prefetch: int
    has_mask: bool = False
    a_vec: bool = False
    b_vec: bool = False
    has_init: bool = False
    write_final: bool = False
    even_c: bool = False
    fir_unroll: int = 0
    mma: int = 0
    walls: int = 0
    coef_atomic: bool = False
    finish: bool = True
    pointers: bool = False
    static_rows: bool = False
    bounds: Optional[tuple] = None

    @property
    def name(self) -> str:
        values = (int(v) if isinstance(v, bool) else v for v in astuple(self))
        return re.sub(r"\W+", "_", "_cta_stream_" + "_".join(map(str, values)).replace("-", "m"))
