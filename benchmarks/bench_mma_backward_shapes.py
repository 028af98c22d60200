"""The tensor-core backward's launch configurations on the three large benchmark shapes, against the register filter,
diffusion with a scalar coefficient (bf16), bidirectional (``--modes bidi,causal`` adds the causal backward). The
tuning grid (``tune_stream.py --mma``) runs on one shape; the best configuration there was not the best on the others,
so ``_MMA_DEFAULTS`` and ``MMA_MIN_STEPS`` of the backward come from this table.

    python benchmarks/bench_mma_backward_shapes.py            # steps 5 and 8, 2 rounds

Every cell: the backward kernel (without the coefficient's final reduction) as a multiple of ``y.copy_(x)``, median
over rounds (each a ``do_bench`` median; the copy is timed in every round). Writes
``benchmarks/results/mma_backward_shapes_<gpu>.json`` and prints the table.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from results_io import diffusion_launch, on_gpu, write_results  # noqa: E402  (beside this script)

SHAPES = ((1, 16384, 4096), (8, 4096, 4096), (1, 65536, 512))
CONFIGS = ((32, 128, 4, 2, 1), (64, 128, 4, 2, 1), (64, 256, 8, 2, 1), (128, 128, 4, 2, 1), (128, 256, 8, 2, 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="5,8", help="comma list of step counts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="bidi", help="comma list of bidi, causal")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    if not on_gpu():
        return 1
    from triton.testing import do_bench

    from cta import triton_cta

    triton_cta.MMA_MIN_STEPS = {key: 1 for key in triton_cta.MMA_MIN_STEPS}
    alpha = torch.tensor(0.2, device="cuda")
    rows = []
    print("| shape | steps | registers | " + " | ".join(str(c) for c in CONFIGS) + " |")
    print("|---|---|---|" + "---|" * len(CONFIGS))
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn_like(x)
        y = torch.empty_like(x)
        for causal, steps in ((m == "causal", int(v)) for m in args.modes.split(",") for v in args.steps.split(",")):
            times = {}
            for _ in range(args.rounds):
                copy_ms = do_bench(lambda: y.copy_(x), rep=20, return_mode="median")
                for cfg in (None, *CONFIGS):
                    triton_cta.USE_MMA = cfg is not None
                    if cfg is not None:
                        triton_cta._STREAM_TUNE[("bwd_mma", causal, steps)] = cfg
                    ms = do_bench(diffusion_launch("bwd", x, alpha, grad, steps, causal), rep=10,
                                  return_mode="median")
                    times.setdefault(cfg, []).append(ms / copy_ms)
            row = dict(shape=list(shape), steps=steps, causal=causal, registers=statistics.median(times[None]),
                       mma={str(cfg): statistics.median(times[cfg]) for cfg in CONFIGS})
            rows.append(row)
            print(f"| {'x'.join(map(str, shape))} | {steps}{' causal' if causal else ''} | {row['registers']:.2f} | "
                  + " | ".join(f"{row['mma'][str(cfg)]:.2f}" for cfg in CONFIGS) + " |", flush=True)
    write_results(args.out, "mma_backward_shapes", rows, rounds=args.rounds,
                  configs="(T, BLOCK_C, num_warps, D, blocks ahead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
