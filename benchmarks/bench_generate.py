"""``model.generate()`` of a patched Llama-shaped model against an unpatched copy: the decode overhead users see.

    python benchmarks/bench_generate.py                        # compiled (static cache, CUDA graphs), batch 1 and 8
    python benchmarks/bench_generate.py --modes eager,compiled --rounds 5
    python benchmarks/bench_generate.py --variants auto,identity  # kernels per step of the step and of a bound

A random-weight ``LlamaForCausalLM`` (8 layers x 4096 hidden, bf16, sdpa; seed 0) and an unpatched copy with the
same weights; the patched one has a PDE site after every block (diffusion, 4 steps, ``init="paper"``). For each mode
and batch: one untimed call each (compilation, CUDA-graph capture), then ``--rounds`` paired rounds, each calling
``generate()`` once on each model, the order alternating (greedy, exactly ``--new-tokens`` tokens after a
``--prompt``-token prompt). A streamer records when each token arrives; a call's step time is the median time between
its decoded tokens. The overheads are medians over rounds of patched / unpatched - 1 (of the call's time, and of the
step time), with a bootstrap 95% interval of the step overhead's median and the range over rounds (single calls on a
shared host scatter by about 10%: the interval, not one round, is what compares with a target).

``compiled`` is ``cache_implementation="static"``: transformers compiles the one-token step (``torch.compile``,
its default ``CompileConfig``: fullgraph, ``mode="reduce-overhead"``) and replays it as a CUDA graph. For it the
script also counts the CUDA kernels of one decode step (``torch.compile(model.forward, fullgraph=True)`` through a
``StaticCache``, default mode so that the profiler sees every kernel, at each of ``--batches``), unpatched
and for each of ``--variants`` of the patched step (``auto``: the package's, which a compiled step traces as torch ops
that Inductor fuses into the norm after the site; ``identity``: the token returned unchanged, the hooks alone), with
their summed GPU time per step. Last, it checks that each model's compiled static-cache tokens and logits equal
``use_cache=False`` ones, in float32 (``--check-tokens``).

``--floor`` also times the floor in the same rounds (:func:`subclass_layers`: no hooks, walls or checks, a bound),
counts its kernels and compares it with the package round by round (files ``generate_<gpu>_floor.*``). Writes
``generate_<gpu>.json`` / ``.md`` / ``.png`` (``--tag`` replaces ``<gpu>``) into ``--out``; the plot: each round's
step overhead, the median, its interval, the 4% target (``--replot FILE.json`` rewrites ``.md`` and ``.png``).
"""

import argparse
import collections
import contextlib
import json
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from bench_patched_model import llama_model as patched_model_llama  # noqa: E402
from results_io import TokenClock, bootstrap_median, plot_rounds, write_result_files  # noqa: E402

from cta.patching_cta import patch_model, pde_modules  # noqa: E402
from cta.pde_cache import find_cache  # noqa: E402
from cta.pde_cta import _use_triton  # noqa: E402
from cta.pde_decode import pde_decode_update  # noqa: E402

VARIANTS = {"auto": "the package's step", "torch": "the torch-ops step (eager: instead of the decode kernel)",
            "identity": "the identity (the hooks alone)"}


def _floor_forward(self, *args, **kwargs):
    hidden = super(type(self), self).forward(*args, **kwargs)
    pde, cache = self.cta_block_output_pde, find_cache(kwargs)
    if not torch.compiler.is_compiling():  # (the prefill: stores the states)
        return pde(hidden, None, cache, None)
    states = cache.layers[pde.layer_idx].conv_states
    return pde_decode_update(hidden, [states[i] for i in range(pde.steps)], pde_type=pde.pde_type, steps=pde.steps,
                             alpha=pde.alpha.clamp(*pde.alpha_bounds))


def subclass_layers(model, floor=True):
    """Removes a patched model's hooks and gives each decoder layer a subclass whose forward calls its class's and,
    with ``floor``, refines the output itself from the site's coefficient and the cache's states alone (no walls, no
    checks, no hooks): what any design keeping one state buffer per step must still read, a lower bound."""
    model.model._cta_context.remove_hooks()
    plain = lambda self, *args, **kwargs: super(type(self), self).forward(*args, **kwargs)  # noqa: E731
    for layer in model.model.layers:
        layer.__class__ = type(type(layer).__name__, (type(layer),), {"forward": _floor_forward if floor else plain})
    return model


FLOOR_NOTE = (
    "The floor, timed in the same rounds (`--floor`): a third copy whose decoder layers are subclassed to refine their "
    "output from the site's coefficient and the cache's step buffers alone (no hooks, no padding walls, no checks), a "
    "lower bound of what a design keeping one state buffer per step costs, not an exact model (without walls it parts "
    "from the package where a row is padded).")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (heads of 128 channels, MLP 11008/4096 of it)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=4, help="PDE steps per site")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--modes", default="compiled", help="'eager' (dynamic cache) and/or 'compiled' (static cache)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7, help="paired rounds per mode and batch")
    p.add_argument("--variants", default="auto,identity",
                   help=f"patched steps whose compiled kernels are counted ({', '.join(VARIANTS)}); the first is the "
                        "one generate() times")
    p.add_argument("--check-tokens", type=int, default=32,
                   help="new tokens of the float32 exactness check, run last (compiled static cache vs "
                        "use_cache=False; 0 skips it)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--floor", action="store_true",
                   help="also time the floor in the same rounds: a patched copy whose decoder layers are subclassed "
                        "to refine their output from the coefficient and the cache's step buffers alone (no hooks, "
                        "padding walls or checks: a bound, inexact with padding); files generate_<gpu>_floor.*")
    p.add_argument("--tag", default=None, help="file-name tag (default: the GPU name)")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only rewrite the markdown and the plot (<file>.md, <file>.png) of an existing result file "
                        "generate_<gpu>.json, with the options of the command recorded in it")
    p.add_argument("--device", default="cuda", help="'cpu': a smoke test of the script (no kernels counted)")
    return p.parse_args(argv)


DEVICE = torch.device("cuda")


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def llama_model(layers, hidden, vocab, dtype):
    """bench_patched_model's random-weight Llama-shaped model (seed 0), its MLP 11008/4096 of ``hidden``."""
    intermediate = int(round(11008 * hidden / 4096 / 64)) * 64
    return patched_model_llama(layers, hidden, intermediate, vocab, DEVICE, dtype, max_positions=4096)


@contextlib.contextmanager
def decode_step_variant(name):
    """Within the block, a PDE site's one-token step is ``name`` (:data:`VARIANTS`): ``auto`` the package's;
    ``torch`` its torch-ops path even where the eager decode kernel runs; ``identity`` the token unchanged (prefill
    stays real: it stores the state the continuation check asks for)."""
    if name == "auto":
        yield
        return
    from cta.pde_cta import PDERefinement

    real = PDERefinement._decode_step

    def decode_step(self, hidden_states, state, attention_mask):
        if name == "identity":
            return hidden_states
        backend, self.backend = self.backend, "torch"
        try:
            return real(self, hidden_states, state, attention_mask)
        finally:
            self.backend = backend

    PDERefinement._decode_step = decode_step
    try:
        yield
    finally:
        PDERefinement._decode_step = real


def step_kernels(model, prompt, profiled=4):
    """The CUDA kernels of one compiled decode step: (kernels per step, GPU µs per step, {kernel name: count per
    step}), from ``profiled`` steps after 4 warm-up steps."""
    from transformers import StaticCache

    torch.compiler.reset()
    step = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + 16)
        token = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)

        def run(i):
            position = torch.tensor([prompt.shape[1] + i], device=prompt.device)
            step(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position,
                 position_ids=position[None].expand(prompt.shape[0], 1))

        for i in range(4):
            run(i)
        sync()
        if DEVICE.type != "cuda":  # (a smoke test: traced and run, nothing to count)
            return 0.0, 0.0, {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(4, 4 + profiled):
                run(i)
            sync()
    torch.compiler.reset()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    counts = collections.Counter(e.name[:90] for e in kernels)
    return (len(kernels) / profiled, sum(e.device_time for e in kernels) / profiled,
            {name: n / profiled for name, n in counts.most_common()})


def _overheads(calls, steps, sites) -> dict:
    """The overheads of one compared model from its rounds' ``(unpatched, model)`` call and step times."""
    stats = {}
    for key, pairs in (("call", calls), ("step", steps)):
        ratios = [p / u for u, p in pairs]
        stats[f"{key}_rounds_s"] = pairs
        stats[f"{key}_overhead_percent"] = 100.0 * (statistics.median(ratios) - 1.0)
        stats[f"{key}_overhead_range_percent"] = [100.0 * (min(ratios) - 1.0), 100.0 * (max(ratios) - 1.0)]
    stats["step_overhead_interval_percent"] = [100.0 * bound for bound in
                                               bootstrap_median([p / u - 1.0 for u, p in steps], resamples=10000)]
    stats["unpatched_step_ms"] = 1e3 * statistics.median(u for u, _ in steps)
    stats["patched_step_ms"] = 1e3 * statistics.median(p for _, p in steps)
    stats["us_per_site_and_step"] = 1e6 * statistics.median(p - u for u, p in steps) / sites
    return stats


def generate_rows(models, args, mode, batch):
    """One mode and batch: rounds of generate() calls, one per model of ``models`` (``unpatched``, ``patched`` and
    maybe ``floor``) in an order that rotates between rounds; the patched model's overheads, and the floor's under
    ``floor``."""
    prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    if mode == "compiled":
        kwargs["cache_implementation"] = "static"

    @torch.no_grad()
    def call(model, **extra):
        clock = TokenClock()
        sync()
        start = time.perf_counter()
        tokens = model.generate(prompt, streamer=clock, **{**kwargs, **extra})
        sync()
        return time.perf_counter() - start, clock.median_step(), tokens

    first = {name: call(model) for name, model in models.items()}
    row = dict(mode=mode, batch=batch, new_tokens=args.new_tokens,
               first_call_s={name: value[0] for name, value in first.items()})
    names = list(models)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(call(models[name])[:2])
    sites = len(pde_modules(models["patched"]))
    for name in names[1:]:
        pairs = list(zip(times["unpatched"], times[name]))
        stats = _overheads([(u[0], p[0]) for u, p in pairs], [(u[1], p[1]) for u, p in pairs], sites)
        if name == "patched":
            row.update(stats)
        else:
            row[name] = stats
        print(f"[{mode} batch {batch}] {name}: step {stats['step_overhead_percent']:+.2f}% call "
              f"{stats['call_overhead_percent']:+.2f}%", flush=True)
    return row


@torch.no_grad()
def exactness(patched, unpatched, args):
    """Compiled static-cache ``generate()`` against ``use_cache=False``, in float32 (in bf16, Inductor's fused
    kernels round differently from eager ones: the unpatched model's own compiled tokens part from its eager ones),
    batch 2 with one row left-padded, ``--check-tokens`` new tokens after 64 prompt tokens: per model, whether the
    tokens are equal and the largest logit difference. Converts both models to float32 (run it last)."""
    torch.compiler.reset()  # (float32 compiles anew; the timed rounds' entries would count toward Dynamo's limit)
    prompt = torch.randint(1, args.vocab, (2, 64), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones_like(prompt)
    prompt[1, :9], mask[1, :9] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=args.check_tokens, min_new_tokens=args.check_tokens,
                  do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    rows = {}
    for name, model in (("unpatched", unpatched), ("patched", patched)):
        model.float()
        compiled = model.generate(prompt, cache_implementation="static", **kwargs)
        uncached = model.generate(prompt, use_cache=False, **kwargs)
        difference = (torch.stack(compiled.logits, 1) - torch.stack(uncached.logits, 1)).abs().max()
        rows[name] = {"tokens_equal": bool(torch.equal(compiled.sequences, uncached.sequences)),
                      "max_logit_difference": float(difference)}
        print(f"[exactness] {name}: {rows[name]}", flush=True)
    return rows


TABLE_HEADER = ("| mode | batch | unpatched ms/step | patched ms/step | decode-step overhead [95% interval] (range) | "
                "call overhead (range) | µs per site |", "|---|---|---|---|---|---|---|")


def _table_line(row, stats) -> str:
    (low, high), (call_low, call_high) = stats["step_overhead_range_percent"], stats["call_overhead_range_percent"]
    ci_low, ci_high = stats["step_overhead_interval_percent"]
    return (f"| {row['mode']} | {row['batch']} | {stats['unpatched_step_ms']:.3f} | {stats['patched_step_ms']:.3f} | "
            f"**{stats['step_overhead_percent']:+.2f}%** [{ci_low:+.2f}, {ci_high:+.2f}] ({low:+.2f} .. {high:+.2f}) | "
            f"{stats['call_overhead_percent']:+.2f}% ({call_low:+.2f} .. {call_high:+.2f}) | "
            f"{stats['us_per_site_and_step']:.1f} |")


def _floor_vs_package(row) -> str:
    """The floor's step time against the package's in the same rounds (both were paired with the same unpatched
    call), as a markdown fragment."""
    ratios = [f[1] / p[1] - 1.0 for p, f in zip(row["step_rounds_s"], row["floor"]["step_rounds_s"])]
    low, high = bootstrap_median(ratios, resamples=10000)
    return (f"{row['mode']} batch {row['batch']}: {100 * statistics.median(ratios):+.2f}% "
            f"[{100 * low:+.2f}, {100 * high:+.2f}]")


def markdown(info, args):
    lines = [
        f"# model.generate(), patched Llama-shaped model vs an unpatched copy ({info['gpu']})", "",
        f"{args.layers} layers x {args.hidden} hidden, {args.dtype}, sdpa; PDE after every block "
        f"({info['pde_sites']} sites): diffusion, {args.steps} steps, backend `{info['backend_used']}`. Greedy, "
        f"{args.new_tokens} new tokens after a {args.prompt}-token prompt. Step: the median time between a call's "
        f"decoded tokens; overheads: median over {args.rounds} paired rounds of patched / unpatched - 1 (the step "
        "overhead's bootstrap 95% interval, then the range over rounds); µs per site: the median of patched - "
        "unpatched step time over the sites. Compiled: "
        "`cache_implementation=\"static\"` (torch.compile, CUDA graphs); eager: the dynamic cache. "
        f"transformers {info['transformers']}, torch {info['torch']}.", "",
        *TABLE_HEADER]
    lines += [_table_line(row, row) for row in info["rows"]]
    floors = [row for row in info["rows"] if "floor" in row]
    if floors:
        lines += ["", FLOOR_NOTE, "", *TABLE_HEADER, *(_table_line(row, row["floor"]) for row in floors), "",
                  "The floor against the package, round by round (floor / package step time - 1; median, bootstrap "
                  "95% interval): " + "; ".join(_floor_vs_package(row) for row in floors) + "."]
    exact = info.get("exactness")
    if exact:
        lines += ["", f"Exactness, the same models in float32 (batch 2, one row left-padded, {args.check_tokens} new "
                      "tokens after 64 prompt tokens): compiled static-cache `generate()` against `use_cache=False`: "
                  + "; ".join(f"{name}: tokens equal {value['tokens_equal']}, largest logit difference "
                              f"{value['max_logit_difference']:.1e}" for name, value in exact.items()) + "."]
    per_batch = info.get("step_kernels")
    if per_batch:
        lines += ["", "Kernels of one compiled decode step (`torch.compile(model.forward, fullgraph=True)`, default "
                      "mode, profiled):", "",
                  "| batch | step | kernels per step | GPU µs per step | vs unpatched |", "|---|---|---|---|---|"]
        for batch, kernels in per_batch.items():
            base = kernels["unpatched"]
            for name, value in kernels.items():
                label = {"unpatched": "unpatched", "floor": "the floor"}.get(
                    name, f"patched: {VARIANTS.get(name)} (`{name}`)")
                delta = "" if name == "unpatched" else (
                    f"{value['kernels'] - base['kernels']:+.0f} kernels, "
                    f"{100 * (value['gpu_us'] / max(base['gpu_us'], 1e-9) - 1):+.2f}% GPU time")
                lines.append(f"| {batch} | {label} | {value['kernels']:.0f} | {value['gpu_us']:.0f} | {delta} |")
    return lines


def plot(info: dict, stem: str) -> None:
    """``<stem>.png``: each row's per-round step overheads (and the floor's), its median and 95% interval, and the
    4% target."""
    series = {}
    for row in info["rows"]:
        for name, stats in (("", row), (" floor", row.get("floor"))):
            if stats:
                series[f"{row['mode']}{name}\nbatch {row['batch']}"] = (
                    [100 * (p / u - 1) for u, p in stats["step_rounds_s"]], stats["step_overhead_percent"],
                    stats["step_overhead_interval_percent"])
    plot_rounds(stem + ".png", f"generate(): patched vs unpatched, per round\n{info['gpu']}", series, target=4)


def main():
    global DEVICE
    args = parse_args()
    if args.replot:  # (the markdown and plot of an existing result file, with the options it was run with)
        with open(args.replot) as f:
            info = json.load(f)
        stem = os.path.splitext(args.replot)[0]
        write_result_files(stem, info, markdown(info, parse_args(shlex.split(info["command"])[2:])))
        return plot(info, stem)
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_generate.py times CUDA generation: it needs a GPU (or --device cpu for a smoke test).")
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu"
    def patched_copy():  # (the unpatched model's weights: llama_model is seeded)
        model = llama_model(args.layers, args.hidden, args.vocab, dtype)
        patch_model(model, pde_type="diffusion", pde_steps=args.steps, placement="block_output", init="paper")
        return model.to(DEVICE)

    unpatched, patched = llama_model(args.layers, args.hidden, args.vocab, dtype), patched_copy()
    variants = args.variants.split(",")
    models = {"unpatched": unpatched, "patched": patched}
    if args.floor:
        models["floor"] = subclass_layers(patched_copy())
    info = {"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": getattr(sys.modules.get("triton"), "__version__", None),
            "pde_sites": len(pde_modules(patched)),
            "backend_used": "triton" if _use_triton("auto", torch.zeros(1, 8, device=DEVICE, dtype=dtype)) else "torch",
            "decode_step": variants[0], "rows": [],
            "command": "python benchmarks/bench_generate.py " + " ".join(sys.argv[1:])}
    stem = os.path.join(args.out, "generate_" + (args.tag or gpu.replace(" ", "_") + ("_floor" if args.floor else "")))
    batches = [int(b) for b in args.batches.split(",")]
    if "compiled" in args.modes.split(","):
        info["step_kernels"] = {}  # {batch: {unpatched / variant: kernels, GPU µs and kernel names per step}}
        for batch in batches:
            prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(4))
            kernels = info["step_kernels"][str(batch)] = {}
            for name in ("unpatched", *variants, *(["floor"] if args.floor else [])):
                model = models.get(name, patched)  # (a variant is the patched model with its step substituted)
                with decode_step_variant(name if name in VARIANTS else "auto"):
                    count, gpu_us, names = step_kernels(model, prompt.to(DEVICE))
                kernels[name] = {"kernels": count, "gpu_us": gpu_us, "names": names}
                print(f"[kernels] batch {batch} {name}: {count:.0f} kernels, {gpu_us:.0f} us GPU per step", flush=True)
            write_result_files(stem, info, markdown(info, args))
    with decode_step_variant(variants[0]):
        for mode in args.modes.split(","):
            for batch in batches:
                info["rows"].append(generate_rows(models, args, mode, batch))
                write_result_files(stem, info, markdown(info, args))  # (after every row: a run may be cut short)
    plot(info, stem)
    if args.check_tokens:
        info["exactness"] = exactness(patched, unpatched, args)
        write_result_files(stem, info, markdown(info, args))


if __name__ == "__main__":
    main()
