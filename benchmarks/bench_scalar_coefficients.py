"""Paired timing of two variants of the streaming kernels with a scalar coefficient. Diffusion, forward and backward
kernels (the backward with the reduction of the coefficient's partial sums), both modes, steps 1, 2, 4, 8
(``--steps``).

``--compare coefficients`` (default): the scalar kept a scalar (what ``cta.triton_cta`` does; the banded filter's
taps are scalars, computed once per program) against the same scalar expanded to one value per channel (the
per-channel kernels, plus the expansion each call).

``--compare mma``: interior tiles on tensor cores (``_mma_interior``, the default for bf16/fp16 inputs with a
scalar coefficient) against the register filter (``CTA_MMA=0``), each with its own launch configuration.

``--compare walls``: the programs at the sequence ends filtering with the walls as an extension of the input (the
default) against walking (``CTA_WALLS=0``), each with the default filters (``--per-channel``: one coefficient per
channel, the register filter, instead of the scalar; the ends then filter at every step count, beyond the default's
``WALLS_MAX_STEPS_PER_CHANNEL``).

``--compare one-copy``: forwards whose every program runs one copy of the filter on the walls' extension
(``WALLS_ONE_COPY``, every entry) against none (interior and end programs in two branches, or ends walking where
``_walls_mode`` says so); ``--per-channel`` as above.

``--compare taps``: the banded filter's taps in closed form (``FIR_CLOSED_FORM_TAPS``, the default) against level
by level; ``--per-channel`` as above (where every program computes them for each of its channels).

``--compare pointers``: the interior filters reading and writing rows through pointers that step one row at a
time (``FIR_POINTER_STEPS`` for every kernel; by default only some take it) against addresses computed from each
row's index; ``--per-channel`` as above.

``--compare rows``: the register filters' row handling, four variants: channels and row strides as constexprs
(``STATIC_ROWS``, constant row offsets) and bf16 rows widened by a shift and a mask (``FIR_WIDEN_ASM``), each on or
off; ``--per-channel`` as above.

``--compare last-tile``: register-filter launches whose end programs walk or run the walls' rolled filter, with the
last row tile run second (``LAST_TILE_SECOND`` for every launch; by default only some take it) against in order;
``--per-channel`` as above.

``--compare taps-table``: per-channel filters loading their taps from a table one small kernel writes first
(``TAPS_TABLE`` for every kernel) against computing them in every program (always per channel).

``--compare configs``: launch configurations, one variant per ``'|'``-separated group of ``--configs`` (each as
``profile_kernels.py --configs`` takes them: ``';'``-separated ``kernel:mode:steps=T,BLOCK_C,num_warps,D,U``; an
empty group is the defaults); ``--per-channel`` as above.

``--compare coef-atomic``: a per-channel coefficient (always, without ``--per-channel``) whose gradient the backward
programs add into a few rows with atomics (``COEF_GRAD_ATOMIC``, the default; ``--spreads``: one variant per value
of ``COEF_GRAD_ATOMIC_SPREAD``, the addresses that share them) against per-program partial sums that a second
kernel reduces. The forwards are the same kernel in every variant (a control of the pairing).

``--compare coef-sum``: that gradient's atomic rows summed by ``_sum_rows_kernel`` (``COEF_GRAD_SUM_KERNEL``, the
default) against torch's ``sum(0)`` (one row, as with 4096 channels or more, needs neither); always per channel.

The variants alternate within each round and every timing is a median of ``triton.testing.do_bench``; the table
gives the median over rounds as a multiple of ``y.copy_(x)`` (timed in every round too), so host or clock drift
between variants cancels.

    python benchmarks/bench_scalar_coefficients.py                 # (1, 16384, 4096) bf16, 3 rounds
    python benchmarks/bench_scalar_coefficients.py --rounds 5 --shape 8x4096x4096
    python benchmarks/bench_scalar_coefficients.py --compare mma
    python benchmarks/bench_scalar_coefficients.py --compare walls --shape 1x4096x4096,8x4096x4096 --rounds 3
    python benchmarks/bench_scalar_coefficients.py --compare one-copy --shape 1x16384x4096,8x4096x4096,1x65536x512
    python benchmarks/bench_scalar_coefficients.py --compare taps --per-channel --shape 1x16384x4096,8x4096x4096
    python benchmarks/bench_scalar_coefficients.py --compare pointers --per-channel --shape 1x16384x4096,8x4096x4096
    python benchmarks/bench_scalar_coefficients.py --compare coef-atomic --shape 1x16384x4096,8x4096x4096,1x65536x512
    python benchmarks/bench_scalar_coefficients.py --compare rows --per-channel --shape 1x16384x4096,1x65536x512
    python benchmarks/bench_scalar_coefficients.py --compare last-tile --per-channel --steps 8
    python benchmarks/bench_scalar_coefficients.py --compare configs --per-channel --steps 8 \
        --configs "|fwd:bidi:8=34,128,2,4,34;bwd:bidi:8=24,128,2,8,24"
    python benchmarks/bench_scalar_coefficients.py --compare coef-atomic --spreads 4096,8192,16384,32768

Writes ``benchmarks/results/scalar_coefficients_<gpu>.json`` (``mma_filter_<gpu>.json``, ``walls_filter_<gpu>.json``,
``walls_filter_per_channel_<gpu>.json``, ``walls_one_copy[_per_channel]_<gpu>.json``,
``fir_taps[_per_channel]_<gpu>.json``, ``fir_pointers[_per_channel]_<gpu>.json``,
``coef_grad_atomic[_spreads]_<gpu>.json``, ``fir_rows[_per_channel]_<gpu>.json``,
``last_tile[_per_channel]_<gpu>.json``, ``stream_configs[_per_channel]_<gpu>.json``,
``taps_table_<gpu>.json``) and prints the table.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from results_io import diffusion_launch, on_gpu, parse_configs, write_results  # noqa: E402  (beside this script)


# Every (kernel, causal, per-channel) launch key, and every (kernel, causal) one: a switch's set that takes them all.
EVERY_FILTER = {(kind, causal, vec) for kind in ("fwd", "bwd") for causal in (False, True) for vec in (False, True)}
EVERY_KERNEL = frozenset((kind, causal) for kind in ("fwd", "bwd") for causal in (False, True))
EVERY_LAUNCH = frozenset((kind, causal, per_channel) for kind, causal in EVERY_KERNEL for per_channel in (False, True))
# --compare choices that --per-channel applies to, and those that always time a per-channel coefficient
PER_CHANNEL_OPTION = ("walls", "one-copy", "taps", "pointers", "rows", "last-tile", "configs")
PER_CHANNEL_ALWAYS = ("coef-atomic", "coef-sum", "taps-table")


def expanded(c, like):
    """The alternative to ``triton_cta._coef_arg`` for a scalar: one value per channel."""
    if c is not None and c.dim() == 0:
        return c.reshape(1).expand(like.shape[-1]).contiguous(), True
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", default="coefficients",
                        choices=("coefficients", "mma", "walls", "one-copy", "taps", "pointers", "coef-atomic", "rows",
                                 "last-tile", "configs", "taps-table", "coef-sum"),
                        help="which pair of variants to time (see above)")
    parser.add_argument("--steps", default="1,2,4,8", help="comma list of step counts")
    parser.add_argument("--shape", default="1x16384x4096", help="BxLxC, or a comma list of them")
    parser.add_argument("--per-channel", action="store_true",
                        help="--compare walls, one-copy, taps, pointers, rows, last-tile, configs: one coefficient "
                             "per channel instead of a scalar")
    parser.add_argument("--spreads", default=None,
                        help="--compare coef-atomic: comma list of COEF_GRAD_ATOMIC_SPREAD values, one variant each "
                             "(default: the module's value)")
    parser.add_argument("--configs", default="",
                        help="--compare configs: '|'-separated variants of ';'-separated "
                             "kernel:mode:steps=T,BLOCK_C,num_warps,D,U entries")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=float, default=15.0, help="do_bench repetition budget per timing")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    if not on_gpu():
        return 1
    from triton.testing import do_bench

    from cta import triton_cta

    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shape.split(",")]
    steps_list = [int(v) for v in args.steps.split(",")]
    kept = triton_cta._coef_arg
    if args.compare == "coefficients":  # the register filter's taps (the tensor-core filter has no per-channel form)
        triton_cta.USE_MMA = False
        variants = {"scalar": ("_coef_arg", kept),
                    "expanded": ("_coef_arg", lambda c, like: expanded(c, like) or kept(c, like))}
        stem = "scalar_coefficients"
    elif args.compare == "mma":
        every_step = {key: 1 for key in triton_cta.MMA_MIN_STEPS}  # both filters at every step count
        variants = {"mma": ("MMA_MIN_STEPS", every_step), "registers": ("USE_MMA", False)}
        stem = "mma_filter"
    elif args.compare == "walls":
        # the ends filter at every step count (by default per-channel launches walk them above
        # WALLS_MAX_STEPS_PER_CHANNEL, 4 or 8 steps depending on the kernel)
        triton_cta.WALLS_MAX_STEPS_PER_CHANNEL = dict.fromkeys(triton_cta.WALLS_MAX_STEPS_PER_CHANNEL,
                                                               triton_cta.MAX_FUSED_STEPS)
        variants = {"walls": ("USE_WALLS", True), "walk": ("USE_WALLS", False)}
        stem = "walls_filter" + ("_per_channel" if args.per_channel else "")
    elif args.compare == "taps":
        variants = {"closed_form": ("FIR_CLOSED_FORM_TAPS", True), "levels": ("FIR_CLOSED_FORM_TAPS", False)}
        stem = "fir_taps" + ("_per_channel" if args.per_channel else "")
    elif args.compare == "pointers":
        variants = {"stepping": ("FIR_POINTER_STEPS", EVERY_FILTER), "indexed": ("FIR_POINTER_STEPS", set())}
        stem = "fir_pointers" + ("_per_channel" if args.per_channel else "")
    elif args.compare == "rows":
        variants = {("static" if static else "strided") + ("_widen" if widen else "_convert"):
                    [("STATIC_ROWS", EVERY_FILTER if static else set()), ("FIR_WIDEN_ASM", widen)]
                    for static in (True, False) for widen in (True, False)}
        stem = "fir_rows" + ("_per_channel" if args.per_channel else "")
    elif args.compare == "configs":
        groups = args.configs.split("|")
        if len(groups) < 2:
            parser.error("--compare configs needs two or more '|'-separated --configs groups")
        variants = {}
        for group in groups:
            entries = parse_configs(group)
            name = "+".join(f"{k}{'c' if c else 'b'}{s}_" + "_".join(map(str, v)) for (k, c, s), v in entries.items())
            variants[name or "defaults"] = ("_STREAM_TUNE", entries)
        stem = "stream_configs" + ("_per_channel" if args.per_channel else "")
    elif args.compare == "taps-table":
        variants = {"table": ("TAPS_TABLE", set(EVERY_KERNEL)), "computed": ("TAPS_TABLE", set())}
        stem = "taps_table"
    elif args.compare == "last-tile":
        variants = {"last_second": ("LAST_TILE_SECOND", EVERY_LAUNCH), "in_order": ("LAST_TILE_SECOND", frozenset())}
        stem = "last_tile" + ("_per_channel" if args.per_channel else "")
    elif args.compare == "coef-atomic":
        if args.spreads:
            variants = {f"atomic_{v}": ("COEF_GRAD_ATOMIC_SPREAD", int(v)) for v in args.spreads.split(",")}
        else:
            variants = {"atomic": ("COEF_GRAD_ATOMIC", True)}
        variants["partial_sums"] = ("COEF_GRAD_ATOMIC", False)
        stem = "coef_grad_atomic" + ("_spreads" if args.spreads else "")
    elif args.compare == "coef-sum":
        variants = {"sum_kernel": ("COEF_GRAD_SUM_KERNEL", True), "torch_sum": ("COEF_GRAD_SUM_KERNEL", False)}
        stem = "coef_grad_sum"
    else:
        every = {(causal, mma) for causal in (False, True) for mma in (False, True)}
        variants = {"one_copy": ("WALLS_ONE_COPY", every), "branches": ("WALLS_ONE_COPY", set())}
        stem = "walls_one_copy" + ("_per_channel" if args.per_channel else "")
    rows, copies_ms = [], []
    for shape in shapes:
        x = torch.randn(shape, device="cuda", dtype=getattr(torch, args.dtype))
        grad = torch.randn_like(x)
        per_channel = args.per_channel and args.compare in PER_CHANNEL_OPTION or args.compare in PER_CHANNEL_ALWAYS
        alpha = torch.full((shape[-1],) if per_channel else (), 0.2, device="cuda")
        y = torch.empty_like(x)
        timings, copies = {}, []
        for _ in range(args.rounds):
            copies.append(do_bench(lambda: y.copy_(x), rep=25, return_mode="median"))
            for name, settings in variants.items():
                settings = [settings] if isinstance(settings, tuple) else settings  # (attribute, value) pairs
                saved = [(attribute, getattr(triton_cta, attribute)) for attribute, _ in settings]
                for attribute, value in settings:
                    setattr(triton_cta, attribute, value)
                try:
                    for steps in steps_list:
                        for causal in (False, True):
                            fwd, bwd = (do_bench(diffusion_launch(kind, x, alpha, grad, steps, causal),
                                                 rep=args.rep_ms, return_mode="median") for kind in ("fwd", "bwd"))
                            timings.setdefault((name, steps, causal), []).append((fwd, bwd))
                finally:
                    for attribute, value in saved:
                        setattr(triton_cta, attribute, value)
        copy_ms = statistics.median(copies)
        copies_ms.append(copy_ms)
        label = "x".join(map(str, shape))
        print(f"{label} {args.dtype}, copy {copy_ms * 1e3:.1f} us; medians of {args.rounds} rounds, x copy")
        columns = [f"{name}_{kind}_x_copy" for kind in ("fwd", "bwd") for name in variants]
        print("| steps | mode | " + " | ".join(c[:-len("_x_copy")].replace("_fwd", " fwd").replace("_bwd", " bwd")
                                              for c in columns) + " |")
        print("|---|---|" + "---|" * len(columns))
        for steps in steps_list:
            for causal in (False, True):
                row = dict(shape=label, steps=steps, causal=causal)
                for name in variants:
                    runs = timings[(name, steps, causal)]
                    row[f"{name}_fwd_x_copy"] = statistics.median(r[0] for r in runs) / copy_ms
                    row[f"{name}_bwd_x_copy"] = statistics.median(r[1] for r in runs) / copy_ms
                rows.append(row)
                print(f"| {steps} | {'causal' if causal else 'bidirectional'} | "
                      + " | ".join(f"{row[c]:.3f}" for c in columns) + " |", flush=True)
        del x, grad, y
    meta_shape = list(shapes[0]) if len(shapes) == 1 else [list(shape) for shape in shapes]
    write_results(args.out, stem, rows, shape=meta_shape, dtype=args.dtype, rounds=args.rounds, variants=list(variants),
                  copy_ms=copies_ms[0] if len(shapes) == 1 else copies_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
