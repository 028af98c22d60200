"""Host time of one eager decode step of a PDE site, layer by layer down to the Triton launch (CUDA).

    python benchmarks/decode_launch_cost.py [--batch 1] [--channels 4096] [--calls 2000] [--out benchmarks/results]

Each row calls one thing ``--calls`` times back to back (no synchronisation between calls: the GPU work of each is
a few µs, so the loop measures host time) and reports the median over ``--repeats`` loops of the time per call:

* one torch op on the token (``torch.add(x, 1)``), for scale;
* an empty ``@triton.jit`` kernel with one pointer argument: the floor of a public Triton launch;
* the decode kernel launched through Triton's ``kernel[grid](...)`` with its arguments prepared once (Triton's
  binder, specialisation and launcher alone);
* ``kernels_launch.launch_decode`` (the package's argument handling and that launch);
* ``PDERefinement._decode_step`` (the module's step: dispatch, state check, launch), as a patched model calls it.

Writes ``decode_launch_cost_<gpu>_batch<N>.json`` / ``.md``.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

from results_io import write_result_files  # noqa: E402  (beside this script)

from cta.kernels_launch import DECODE_WARPS, _coef_arg, _decode_launch, launch_decode  # noqa: E402
from cta.pde_cta import PDERefinement  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr):
    pass


def per_call_us(fn, calls, repeats, sync):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
        sync()
    return 1e6 * statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--channels", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("decode_launch_cost.py measures CUDA launches: it needs a GPU (or TRITON_INTERPRET=1 for a "
                         "smoke run on the CPU).")
    device = torch.device("cuda" if on_gpu else "cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    site = PDERefinement(args.channels, pde_type="diffusion", steps=args.steps, causal=True).to(device)
    x = torch.randn(args.batch, 1, args.channels, device=device, dtype=torch.bfloat16)
    state = torch.zeros(args.batch, args.steps, args.channels, device=device)
    mask = torch.ones(args.batch, 9, dtype=torch.long, device=device)[:, -1:]  # an attention mask's last column
    bounds = site.bounds
    launch, consts = _decode_launch("diffusion", args.steps, args.batch, args.channels, True, False, False, bounds)
    y = torch.empty_like(x)
    a, _ = _coef_arg(site.alpha.detach(), x)

    def prepared():
        launch(x, y, state, mask, a, x, args.channels, x.stride(0), state.stride(0), state.stride(1), mask.stride(0),
               *consts, num_warps=DECODE_WARPS)

    rows = {}
    with torch.no_grad():
        cases = [
            ("one torch op (torch.add(x, 1))", lambda: torch.add(x, 1)),
            ("empty Triton kernel, kernel[grid](ptr)", lambda: _empty_kernel[(1,)](x)),
            ("decode kernel, kernel[grid](...) with prepared arguments", prepared),
            ("kernels_launch.launch_decode", lambda: launch_decode(x, state, site.alpha, None, mask, "diffusion",
                                                                   args.steps, bounds)),
            ("PDERefinement._decode_step", lambda: site._decode_step(x, state, mask)),
        ]
        for label, fn in cases:
            rows[label] = per_call_us(fn, args.calls, args.repeats, sync)
            print(f"{rows[label]:8.2f} us  {label}", flush=True)
    gpu = torch.cuda.get_device_name(device) if on_gpu else "cpu_interpreter"
    info = dict(device=gpu, torch=torch.__version__, triton=triton.__version__, batch=args.batch,
                channels=args.channels, steps=args.steps, calls=args.calls, repeats=args.repeats, us_per_call=rows,
                command="python benchmarks/decode_launch_cost.py " + " ".join(sys.argv[1:]))
    stem = os.path.join(args.out, f"decode_launch_cost_{gpu.replace(' ', '_')}_batch{args.batch}")
    lines = [f"# Host time of one eager decode step, down to the launch ({gpu})", "",
             f"Token [{args.batch}, 1, {args.channels}] bf16, state [{args.batch}, {args.steps}, {args.channels}] "
             "fp32, "
             f"diffusion, the mask column of an attention mask; {args.calls} calls back to back, median over "
             f"{args.repeats} loops. torch {info['torch']}, triton {info['triton']}.", "",
             "| call | µs per call |", "|---|---|"]
    lines += [f"| {label} | {us:.2f} |" for label, us in rows.items()]
    write_result_files(stem, info, lines)


if __name__ == "__main__":
    main()
