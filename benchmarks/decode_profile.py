"""Where a decode step's PDE time goes (CUDA; Dynamo's share on the CPU): the findings of docs/decoding.md.

    python benchmarks/decode_profile.py pairs [--batch 1] [--pairs 512] [--rounds 15]   # per-token pairs, by step
    python benchmarks/decode_profile.py launch [--batch 1] [--calls 2000]              # host time down to the launch
    python benchmarks/decode_profile.py compiled-host [--rounds 15]                     # a compiled step's host time
    python benchmarks/decode_profile.py dynamo-host [--loops 15]                        # ... Dynamo's part, by piece

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

``compiled-host``: the host time a patched model adds to a compiled decode step (``generate()`` with a static
cache, CUDA graphs) of a small model whose GPU time is negligible: unpatched, patched with 1 and 4 steps per site,
and 4 steps with the step replaced by the identity (the hooks and cache lookups alone), in rounds that time every
row; then one profiled call per row for Dynamo's guard evaluation per step. Writes ``compiled_host_<gpu>.json`` /
``.md``.

``dynamo-host`` (CPU): what Dynamo itself does per call of a compiled decode step (``torch.compile(model.forward,
fullgraph=True)`` through a ``StaticCache``, a backend that returns the graph's first outputs, so a call is guard
evaluation, input gathering and the replay of side effects), for the patched model taken apart: its classes and cache
alone (hooks removed), the base model's hooks alone, the layer hooks as no-ops, both, the site without its PDE
(``PDERefinement.forward`` returning the token), the full site with 1 and 4 steps; each with and without guard
evaluation (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``), the least over ``--loops`` loops, the median
over ``--processes`` fresh processes. Writes ``dynamo_host_cpu.json`` / ``.md``.

The compiled decode step's kernels and generate() overheads are ``bench_generate.py``'s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from bench_generate import TokenClock, decode_step_variant  # noqa: E402
from bench_patched_model import llama_model  # noqa: E402
from results_io import bootstrap_median, paired_decode, write_result_files  # noqa: E402

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


def run_compiled_host(argv):
    p = argparse.ArgumentParser(prog="decode_profile.py compiled-host",
                                description="the host time a patched model adds to a compiled decode step")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256, help="small: the GPU time of a step is negligible")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generate() call")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile.py compiled-host times CUDA-graph decode steps: it needs a GPU.")
    device = torch.device("cuda")
    unpatched = llama_model(args.layers, args.hidden, 2 * args.hidden, 256, device, torch.bfloat16)
    models = {"unpatched": unpatched}
    for steps in (1, 4):
        models[f"{steps} step{'s' if steps > 1 else ''}"] = patched = llama_model(
            args.layers, args.hidden, 2 * args.hidden, 256, device, torch.bfloat16)
        patch_model(patched, pde_type="diffusion", pde_steps=steps, placement="block_output", init="paper")
        patched.to(device)
    prompt = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3)).to(device)

    def step_time(model, tokens):
        clock = TokenClock()
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, pad_token_id=0, cache_implementation="static",
                           streamer=clock)
        return clock.median_step()

    cases = {**{name: (model, "package") for name, model in models.items()},
             "4 steps, the identity step": (models["4 steps"], "identity")}
    for model, variant in cases.values():  # compiled, CUDA graphs recorded
        with step_variant(variant):
            step_time(model, 8), step_time(model, 8)
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (model, variant) in cases.items():
            with step_variant(variant):
                times[name].append(step_time(model, args.tokens))
    rows = {name: {"step_us": 1e6 * statistics.median(values),
                   "added_us": 1e6 * statistics.median(v - u for v, u in zip(values, times["unpatched"]))}
            for name, values in times.items()}
    for name, (model, variant) in cases.items():  # Dynamo's guard evaluation per step (the profiler's own event)
        with step_variant(variant), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step_time(model, args.tokens)
        lookups = [e for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]
        rows[name]["guard_us"] = sum(e.cpu_time_total for e in lookups) / max(len(lookups), 1)
    gpu = torch.cuda.get_device_name(device)
    info = dict(device=gpu, torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
                hidden=args.hidden, tokens=args.tokens, rounds=args.rounds, rows=rows, step_seconds=times,
                command="python benchmarks/decode_profile.py compiled-host " + " ".join(argv))
    lines = [f"# Host time a patched model adds to a compiled decode step ({gpu})", "",
             f"A small Llama ({args.layers} layers x {args.hidden} hidden, bf16: the GPU time of a step is "
             "negligible, so the step time is host time), `generate(cache_implementation=\"static\")` (compiled, "
             f"CUDA graphs), batch 1, {args.tokens} new tokens; PDE after every block (diffusion). Step: the median "
             f"time between decoded tokens, median over {args.rounds} rounds (each times every row); added: the "
             f"median over rounds of the row's step minus the unpatched step; guards: the profiler's \"TorchDynamo "
             "Cache Lookup\" per compiled call (guard evaluation), one profiled call per row. transformers "
             f"{info['transformers']}, torch {info['torch']}.", "",
             "| model | µs per step | added µs per step | guard evaluation µs per step |", "|---|---|---|---|"]
    lines += [f"| {name} | {row['step_us']:.1f} | {row['added_us']:+.1f} | {row['guard_us']:.1f} |"
              for name, row in rows.items()]
    write_result_files(os.path.join(args.out, f"compiled_host_{gpu.replace(' ', '_')}"), info, lines)


def run_dynamo_host(argv):
    p = argparse.ArgumentParser(prog="decode_profile.py dynamo-host",
                                description="Dynamo's host time per compiled decode step, piece by piece (CPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--calls", type=int, default=500, help="calls per loop")
    p.add_argument("--loops", type=int, default=15, help="loops per row (the least is kept)")
    p.add_argument("--processes", type=int, default=3,
                   help="fresh processes per row (the median is kept: guard evaluation's time moves with where a "
                        "process put the guarded objects, by up to 20 µs between processes)")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # (one row, in a fresh process: prints its JSON)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    from transformers import StaticCache

    from cta import patching_hooks

    def call_us(steps, variant):
        model = llama_model(args.layers, args.hidden, 2 * args.hidden, 256, torch.device("cpu"), torch.float32)
        if steps:
            patch_model(model, pde_type="diffusion", pde_steps=steps, placement="block_output", init="paper")
            context = model.model._cta_context  # (PatchContext: the base hooks' handles, the sites with theirs)
            for handle in context.handles if variant in ("classes", "layer no-op") else ():
                handle.remove()
            for site in context.site_hooks if variant in ("classes", "base") else ():
                site.remove()
        prompt = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3))
        cache = StaticCache(config=model.config, max_cache_len=64)
        outputs = {}

        def backend(graph, inputs):  # the graph runs once; every later call returns its outputs
            outputs["value"] = graph(*inputs)
            return lambda *_: outputs["value"]

        rows = {}
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
            step = torch.compile(model.forward, fullgraph=True, backend=backend)
            kwargs = dict(input_ids=prompt[:, :1], past_key_values=cache, use_cache=True,
                          position_ids=torch.tensor([[32]]))
            for skip in (False, True):
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
                    rows["without guards" if skip else "with guards"] = per_call_us(
                        lambda: step(**kwargs), args.calls, args.loops, lambda: None, reduce=min)
        torch.compiler.reset()
        return rows

    cases = {"unpatched": (0, None), "patched classes and cache, no hooks": (4, "classes"),
             "the base model's hooks alone": (4, "base"), "the layer hooks as no-ops alone": (4, "layer no-op"),
             "both hooks, the layer hooks as no-ops": (4, "no-op"), "the site without its PDE": (4, "no PDE"),
             "the full site, 1 step": (1, None), "the full site, 4 steps": (4, None)}
    if args.only is not None:  # (a fresh process of its own: the substitutes below die with it)
        steps, variant = cases[args.only]
        if variant in ("layer no-op", "no-op"):
            patching_hooks.LayerSite.after = lambda self, module, args, kwargs, output: output
        if variant == "no PDE":
            PDERefinement.forward = lambda self, hidden_states, *rest, **kw: hidden_states
        print("ROW " + json.dumps(call_us(steps, variant)), flush=True)
        return
    rows, options = {}, ["--layers", str(args.layers), "--hidden", str(args.hidden), "--calls", str(args.calls),
                         "--loops", str(args.loops)]
    for name in cases:
        runs = []
        for _ in range(args.processes):
            command = [sys.executable, os.path.abspath(__file__), "dynamo-host", "--only", name, *options]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(output.split("ROW ", 1)[1]))
        rows[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        rows[name]["processes"] = runs
        print(f"{name}: {rows[name]['with guards']:.1f} / {rows[name]['without guards']:.1f} us", flush=True)
    base = rows["unpatched"]
    info = dict(torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
                hidden=args.hidden, calls=args.calls, loops=args.loops, us_per_call=rows,
                command="python benchmarks/decode_profile.py dynamo-host " + " ".join(argv))
    lines = ["# Dynamo's host time per call of a compiled decode step, piece by piece (CPU)", "",
             f"A Llama of {args.layers} layers x {args.hidden} hidden (fp32, CPU), `torch.compile(model.forward, "
             "fullgraph=True)` through a StaticCache with a backend that returns the graph's outputs, so a call is "
             "Dynamo's own work: guard evaluation, gathering the graph's inputs, replaying side effects (no CUDA-graph "
             "wrapper, no kernels). PDE after every block (diffusion). µs per call: the least over "
             f"{args.loops} loops of {args.calls} calls in one process, the median over {args.processes} fresh "
             "processes (guard evaluation's time moves between processes by up to 20 µs). "
             f"transformers {info['transformers']}, torch {info['torch']}.",
             "", "| model | µs per call | added | without guard evaluation | added |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['with guards']:.1f} | {row['with guards'] - base['with guards']:+.1f} | "
                     f"{row['without guards']:.1f} | {row['without guards'] - base['without guards']:+.1f} |")
    write_result_files(os.path.join(args.out, "dynamo_host_cpu"), info, lines)


COMMANDS = {"pairs": run_pairs, "launch": run_launch, "compiled-host": run_compiled_host,
            "dynamo-host": run_dynamo_host}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
