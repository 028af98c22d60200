"""Where an eager decode step's PDE time goes (CUDA): the findings of docs/decoding.md on eager decoding.

    python benchmarks/decode_profile.py pairs [--batch 1] [--pairs 512] [--rounds 15]   # per-token pairs, by step
    python benchmarks/decode_profile.py launch [--batch 1] [--calls 2000]              # host time down to the launch

``pairs``: the Llama-shaped model of ``bench_patched_model.py`` (8 x 4096, bf16, sdpa; diffusion, 4 steps after every
block, ``init="paper"``) beside an unpatched copy with the same weights. For each variant of the patched model's
one-token step (the package's; plain torch ops, the recurrence; the identity, which leaves the structure alone:
hooks, lookups, module calls): (1) per-token pairs in a plain decode loop (``results_io.paired_decode``: each token
decoded by both models back to back, with the all-ones mask generate() passes), median of patched / unpatched and
its bootstrap 95% interval; (2) ``--rounds`` paired ``generate()`` calls of ``--tokens`` new tokens, median over
rounds of the ratio of the median time between tokens. Writes ``decode_step_pairs_<gpu>_batch<N>.json`` / ``.md``.

``launch``: each row calls one thing ``--calls`` times back to back (no synchronisation between calls: the GPU work
of each is a few µs, so the loop measures host time), the median over ``--repeats`` loops of the time per call: one
torch op on the token (for scale); an empty ``@triton.jit`` kernel (the floor of a public Triton launch); the decode
kernel through ``kernel[grid](...)`` with its arguments prepared once; ``kernels_launch.launch_decode``;
``PDERefinement._decode_step`` as a patched model calls it. Writes ``decode_launch_cost_<gpu>_batch<N>.json`` / ``.md``.

A compiled step's host time is ``compiled_profile.py``'s; its kernels and generate() overheads are
``bench_generate.py``'s.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from bench_generate import decode_step_variant  # noqa: E402
from bench_patched_model import llama_model  # noqa: E402
from results_io import TokenClock, bootstrap_median, paired_decode, run_command, write_result_files  # noqa: E402

from cta.patching_cta import patch_model, pde_modules  # noqa: E402
from cta.pde_cta import PDERefinement  # noqa: E402

VARIANTS = {"package": "the package's step", "torch": "plain torch ops (the recurrence)",
            "identity": "the identity (structure alone)"}


def step_variant(name):
    """Within the block, the patched model's one-token step is :data:`VARIANTS` ``name`` (``bench_generate``'s
    variants: ``identity`` returns the token unchanged)."""
    return decode_step_variant("auto" if name == "package" else name)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_rounds(patched, unpatched, prompt, tokens, rounds, device):
    """``rounds`` paired generate() calls (order alternating): per round, the two calls' median times between
    tokens."""
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, min_new_tokens=tokens,
                  do_sample=False, pad_token_id=0)

    def step_time(model):
        clock = TokenClock()
        sync(device)
        model.generate(prompt, streamer=clock, **kwargs)
        sync(device)
        return clock.median_step()

    with torch.no_grad():
        step_time(unpatched), step_time(patched)
        pairs = []
        for r in range(rounds):
            order = (unpatched, patched) if r % 2 == 0 else (patched, unpatched)
            times = {id(model): step_time(model) for model in order}
            pairs.append((times[id(unpatched)], times[id(patched)]))
    return pairs


def summary(pairs, sites):
    ratios = [p / u for u, p in pairs]
    low, high = bootstrap_median(ratios)
    return dict(pairs=len(pairs), unpatched_us=1e6 * statistics.median(u for u, _ in pairs),
                patched_us=1e6 * statistics.median(p for _, p in pairs),
                overhead_percent=100 * (statistics.median(ratios) - 1),
                overhead_ci95_percent=[100 * (low - 1), 100 * (high - 1)],
                us_per_site=1e6 * statistics.median(p - u for u, p in pairs) / sites)


def run_pairs(argv):
    p = argparse.ArgumentParser(prog="decode_profile.py pairs", description="per-token pairs by substitute step")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--pairs", type=int, default=512, help="per-token pairs per variant (plain loop)")
    p.add_argument("--rounds", type=int, default=15, help="paired generate() calls per variant")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per generate() call and per loop pass")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"a comma list of {sorted(VARIANTS)}")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    intermediate = 11008 * args.hidden // 4096
    unpatched, patched = (llama_model(args.layers, args.hidden, intermediate, 32000, device, dtype) for _ in range(2))
    patch_model(patched, pde_type="diffusion", pde_steps=4, placement="block_output", init="paper")
    sites = len(pde_modules(patched))
    prompt = torch.randint(0, 32000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(5)).to(device)
    rows = []
    for name in args.variants.split(","):
        with step_variant(name):
            loop = paired_decode(patched, unpatched, prompt, args.tokens, args.pairs, device, mask=True)
            calls = generate_rounds(patched, unpatched, prompt, args.tokens, args.rounds, device)
        row = dict(variant=name, loop=summary(loop, sites), generate=summary(calls, sites))
        rows.append(row)
        print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    info = dict(device=gpu, torch=torch.__version__, transformers=transformers.__version__, batch=args.batch,
                model=dict(layers=args.layers, hidden=args.hidden, dtype=str(dtype).replace("torch.", "")),
                sites=sites, rows=rows, command="python benchmarks/decode_profile.py " + " ".join(sys.argv[1:]))
    stem = os.path.join(args.out, f"decode_step_pairs_{gpu.replace(' ', '_')}_batch{args.batch}")
    lines = [f"# One eager decode step: what the PDE sites add, by substitute step ({gpu}, batch {args.batch})", "",
             f"{args.layers} layers x {args.hidden} hidden, {info['model']['dtype']}, sdpa; diffusion, 4 steps "
             f"after every block ({sites} sites). Loop: {args.pairs} per-token pairs against an unpatched copy "
             f"(all-ones mask each step); generate(): {args.rounds} paired calls of {args.tokens} new tokens, the "
             f"ratio of their median times between tokens. Median of patched / unpatched - 1 [bootstrap 95%]. "
             "transformers "
             f"{info['transformers']}, torch {info['torch']}.", "",
             "| one-token step | loop: overhead | loop: µs per site | generate(): overhead | generate(): µs per site |",
             "|---|---|---|---|---|"]
    for row in rows:
        cells = []
        for key in ("loop", "generate"):
            s = row[key]
            low, high = s["overhead_ci95_percent"]
            cells += [f"{s['overhead_percent']:+.2f}% [{low:+.2f}, {high:+.2f}]", f"{s['us_per_site']:.1f}"]
        lines.append(f"| {VARIANTS[row['variant']]} | " + " | ".join(cells) + " |")
    write_result_files(stem, info, lines)


def empty_kernel():
    """An empty ``@triton.jit`` kernel with one pointer argument (Triton imported here: ``pairs`` needs none)."""
    import triton

    @triton.jit
    def _empty_kernel(x_ptr):
        pass

    return _empty_kernel


def per_call_us(fn, calls, repeats, sync, reduce=statistics.median):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
        sync()
    return 1e6 * reduce(times)


def run_launch(argv):
    import triton

    from cta.kernels_config import MAX_FUSED_STEPS
    from cta.kernels_launch import DECODE_WARPS, _coef_arg, _decode_launch, launch_decode

    p = argparse.ArgumentParser(prog="decode_profile.py launch", description="host time down to the launch")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--channels", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("decode_profile.py launch measures CUDA launches: it needs a GPU (or TRITON_INTERPRET=1 for a "
                         "smoke run on the CPU).")
    device = torch.device("cuda" if on_gpu else "cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    site = PDERefinement(args.channels, pde_type="diffusion", steps=args.steps, causal=True).to(device)
    x = torch.randn(args.batch, 1, args.channels, device=device, dtype=torch.bfloat16)
    levels = [torch.zeros(args.batch, 1, args.channels, device=device) for _ in range(args.steps)]  # a cache's
    mask = torch.ones(args.batch, 9, dtype=torch.long, device=device)[:, -1:]  # an attention mask's last column
    bounds = site.bounds
    launch, consts = _decode_launch("diffusion", args.steps, args.batch, args.channels, True, False, False, bounds)
    y = torch.empty_like(x)
    a, _ = _coef_arg(site.alpha.detach(), x)
    pointers = (*levels, *(None,) * (MAX_FUSED_STEPS - args.steps))

    def prepared():
        launch(x, y, mask, a, x, args.channels, x.stride(0), levels[0].stride(0), mask.stride(0), *pointers, *consts,
               num_warps=DECODE_WARPS)

    rows, empty = {}, empty_kernel()
    with torch.no_grad():
        cases = [
            ("one torch op (torch.add(x, 1))", lambda: torch.add(x, 1)),
            ("empty Triton kernel, kernel[grid](ptr)", lambda: empty[(1,)](x)),
            ("decode kernel, kernel[grid](...) with prepared arguments", prepared),
            ("kernels_launch.launch_decode", lambda: launch_decode(x, levels, site.alpha, None, mask, "diffusion",
                                                                   args.steps, bounds)),
            ("PDERefinement._decode_step", lambda: site._decode_step(x, levels, mask)),
        ]
        for label, fn in cases:
            rows[label] = per_call_us(fn, args.calls, args.repeats, sync)
            print(f"{rows[label]:8.2f} us  {label}", flush=True)
    gpu = torch.cuda.get_device_name(device) if on_gpu else "cpu_interpreter"
    info = dict(device=gpu, torch=torch.__version__, triton=triton.__version__, batch=args.batch,
                channels=args.channels, steps=args.steps, calls=args.calls, repeats=args.repeats, us_per_call=rows,
                command="python benchmarks/decode_profile.py " + " ".join(sys.argv[1:]))
    stem = os.path.join(args.out, f"decode_launch_cost_{gpu.replace(' ', '_')}_batch{args.batch}")
    lines = [f"# Host time of one eager decode step, down to the launch ({gpu})", "",
             f"Token [{args.batch}, 1, {args.channels}] bf16, state {args.steps} fp32 buffers "
             f"[{args.batch}, 1, {args.channels}] (a cache's, one per step), "
             f"diffusion, the mask column of an attention mask; {args.calls} calls back to back, median over "
             f"{args.repeats} loops. torch {info['torch']}, triton {info['triton']}.", "",
             "| call | µs per call |", "|---|---|"]
    lines += [f"| {label} | {us:.2f} |" for label, us in rows.items()]
    write_result_files(stem, info, lines)


if __name__ == "__main__":
    run_command(__doc__, {"pairs": run_pairs, "launch": run_launch})
