"""Grid search of the streaming kernels' launch configurations (T rows per program, BLOCK_C channels, warps, prefetch
depth D, unroll factor U of the banded filter) for diffusion, per (kernel, causal, steps), on one GPU.

Compiling dominates a grid this size, so worker processes compile every configuration first (they share Triton's
on-disk cache), then the main process times each one alone on the GPU.

    python benchmarks/tune_stream.py --steps 1,2,4 --workers 16 --out benchmarks/results

Writes ``stream_tuning_<gpu>.json`` (every timing, as a multiple of ``y.copy_(x)``, and the best configuration per
key) and prints the best configurations in the form of ``cta.triton_cta._STREAM_DEFAULTS``.

    python benchmarks/tune_stream.py --merge A.json B.json ...   # the best per key across several grids
    python benchmarks/tune_stream.py --from-defaults --steps 1,2,4,8 --t-values base,24 --d-values base,4,8,12
"""

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from results_io import diffusion_launch  # noqa: E402  (beside this script)

TIMING_COLUMNS = ["kind", "causal", "steps", "T", "BLOCK_C", "num_warps", "D", "U", "x_copy"]  # one row per timing


FULL_UNROLL = -1  # "T" in --unroll-values: the unroll factor equal to T (the filter's loop unrolled whole)


def _grid(steps_list, t_values, blocks, d_values, unroll_values, kernels=("fwd", "bwd"), modes=(False, True)):
    for kind, causal, steps in itertools.product(kernels, modes, steps_list):
        for t, (block_c, warps), d, u in itertools.product(t_values, blocks, d_values, unroll_values):
            yield (kind, causal, steps), (t, block_c, warps, d, t if u == FULL_UNROLL else u)


BASE = -2  # "base" in --t-values / --d-values (with --from-defaults): the default configuration's own value


def _grid_from_defaults(steps_list, t_values, d_values, kernels, modes):
    """Per key, the per-channel default's channels and warps with each rows x prefetch depth pair (the loop unrolled
    whole where the default unrolls it whole, else the default's unroll factor)."""
    from cta import triton_cta

    for kind, causal, steps in itertools.product(kernels, modes, steps_list):
        t0, block_c, warps, d0, u0 = triton_cta._default_entry(kind, causal, steps, per_channel=True)
        ts = dict.fromkeys(t0 if t == BASE else t for t in t_values)
        ds = dict.fromkeys(d0 if d == BASE else d for d in d_values)
        for t, d in itertools.product(ts, ds):
            yield (kind, causal, steps), (t, block_c, warps, d, t if u0 == t0 else u0)


def _runner(key, cfg, x, alpha, grad, mma=False):
    from cta import triton_cta

    kind, causal, steps = key
    if mma:  # the tensor-core filter's programs (scalar coefficient): (T, BLOCK_C, num_warps, D, blocks ahead)
        triton_cta.MMA_MIN_STEPS = {k: 1 for k in triton_cta.MMA_MIN_STEPS}  # at every step count, whatever the default
        triton_cta._STREAM_TUNE[(kind + "_mma", causal, steps)] = cfg
    else:
        triton_cta._STREAM_TUNE[key] = cfg
    return diffusion_launch(kind, x, alpha, grad, steps, causal)


def _inputs(shape, dtype, mma=False):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    grad = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    alpha = torch.tensor(0.2, device="cuda") if mma else torch.full((shape[-1],), 0.2, device="cuda")
    return x, alpha, grad


def _compile_worker(args):
    jobs, shape, dtype, mma = args
    x, alpha, grad = _inputs(shape, getattr(torch, dtype), mma)
    failed = []
    for key, cfg in jobs:
        try:
            _runner(key, cfg, x, alpha, grad, mma)()
        except Exception as exc:  # noqa: BLE001  (a configuration that does not compile is skipped)
            failed.append((key, cfg, f"{type(exc).__name__}: {str(exc)[:100]}"))
    torch.cuda.synchronize()
    return failed


def load_best(path):
    """The best configurations of a tuning file: ``{(kind, causal, steps): (x_copy, config)}``."""
    with open(path) as f:
        data = json.load(f)
    best = {}
    for name, entry in data["best"].items():
        kind, causal, steps = name.split()
        best[(kind, causal == "causal=True", int(steps.split("=")[1]))] = (entry["x_copy"], tuple(entry["config"]))
    return best


def merge(paths):
    """The best configuration per key across tuning files (each timing is a multiple of its own run's copy time),
    in the form of ``_STREAM_DEFAULTS``."""
    best = {}
    for path in paths:
        for key, (x_copy, cfg) in load_best(path).items():
            if key not in best or x_copy < best[key][0]:
                best[key] = (x_copy, cfg, os.path.basename(path))
    defaults = {}
    for (kind, causal, steps), (x_copy, cfg, source) in sorted(best.items()):
        print(f"best {(kind, causal, steps)}: {cfg} {x_copy:.3f}x copy ({source})")
        defaults.setdefault((kind, causal), {})[steps] = cfg
    print("_STREAM_DEFAULTS =", defaults)


def main():
    if sys.argv[1:2] == ["--merge"]:
        return merge(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="1,2,4", help="comma list of step counts")
    parser.add_argument("--t-values", default="32,64,128,256", help="rows per program")
    parser.add_argument("--blocks", default="64:1,128:1,256:1,256:2,512:2,512:4,1024:4,1024:8",
                        help="BLOCK_C:num_warps pairs")
    parser.add_argument("--d-values", default="1,2,4", help="prefetch depths")
    parser.add_argument("--unroll-values", default="1,2",
                        help="unroll factors of the banded filter's loop (T: each T's own, the loop unrolled whole)")
    parser.add_argument("--kernels", default="fwd,bwd", help="which kernels to tune (comma list of fwd, bwd)")
    parser.add_argument("--modes", default="bidi,causal", help="which schemes to tune (comma list of bidi, causal)")
    parser.add_argument("--mma", action="store_true",
                        help="tune the tensor-core filter's programs instead (scalar coefficient, 16-bit input; "
                             "T a multiple of 16; --unroll-values are then the input blocks loaded ahead, 0-2)")
    parser.add_argument("--from-defaults", action="store_true",
                        help="instead of the --blocks x --unroll-values grid: per key, the per-channel default's "
                             "BLOCK_C, warps and unrolling with each --t-values x --d-values pair ('base': the "
                             "default's own value; --steps must be tuned step counts)")
    parser.add_argument("--shape", default="1x16384x4096")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workers", type=int, default=16, help="processes compiling the grid")
    parser.add_argument("--rep-ms", type=float, default=5.0, help="do_bench repetition budget per configuration")
    parser.add_argument("--name", default="stream_tuning", help="output file stem (<name>_<gpu>.json)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    from triton.testing import do_bench

    shape = tuple(int(s) for s in args.shape.split("x"))
    ints = lambda text: [BASE if v == "base" else int(v) for v in text.split(",")]  # noqa: E731
    blocks = [tuple(int(v) for v in pair.split(":")) for pair in args.blocks.split(",")]
    modes = {"bidi": False, "causal": True}
    unrolls = [FULL_UNROLL if v == "T" else int(v) for v in args.unroll_values.split(",")]
    kernels, mode_flags = tuple(args.kernels.split(",")), tuple(modes[m] for m in args.modes.split(","))
    if args.from_defaults:
        grid = list(_grid_from_defaults(ints(args.steps), ints(args.t_values), ints(args.d_values), kernels,
                                        mode_flags))
    else:
        grid = list(_grid(ints(args.steps), ints(args.t_values), blocks, ints(args.d_values), unrolls, kernels,
                          mode_flags))
    start = time.time()
    chunks = [grid[i::args.workers] for i in range(args.workers)]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        failed = [f for part in pool.map(_compile_worker, [(c, shape, args.dtype, args.mma) for c in chunks])
                  for f in part]
    print(f"compiled {len(grid)} configurations in {time.time() - start:.0f}s ({len(failed)} failed)", flush=True)
    bad = {(k, c) for k, c, _ in failed}

    x, alpha, grad = _inputs(shape, getattr(torch, args.dtype), args.mma)
    y = torch.empty_like(x)
    copy_ms = do_bench(lambda: y.copy_(x), warmup=5, rep=25, return_mode="median")
    timings, best = [], {}
    for key, cfg in grid:
        if (key, cfg) in bad:
            continue
        ms = do_bench(_runner(key, cfg, x, alpha, grad, args.mma), warmup=2, rep=args.rep_ms, return_mode="median")
        timings.append([key[0], key[1], key[2], *cfg, round(ms / copy_ms, 4)])
        if key not in best or ms < best[key][0]:
            best[key] = (ms, cfg)
    print(f"timed in {time.time() - start:.0f}s; copy {copy_ms * 1e3:.1f} us", flush=True)
    for key, (ms, cfg) in sorted(best.items()):
        print(f"best {key}: {cfg} {ms / copy_ms:.3f}x copy", flush=True)
    defaults = {}
    for (kind, causal, steps), (_, cfg) in sorted(best.items()):
        defaults.setdefault((kind, causal), {})[steps] = cfg
    print("_STREAM_DEFAULTS =", defaults)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}_{gpu}.json"), "w") as f:
        json.dump(dict(meta=dict(gpu=torch.cuda.get_device_name(), shape=list(shape), dtype=args.dtype,
                                 copy_ms=copy_ms, triton=__import__("triton").__version__,
                                 command="python benchmarks/tune_stream.py " + " ".join(sys.argv[1:])),
                       best={f"{k[0]} causal={k[1]} steps={k[2]}": dict(config=list(c), x_copy=ms / copy_ms)
                             for k, (ms, c) in sorted(best.items())},
                       failed=[dict(key=list(k), config=list(c), error=e) for k, c, e in failed],
                       timings_columns=TIMING_COLUMNS, timings=timings), f)


if __name__ == "__main__":
    main()
