"""``model.generate()`` of a patched Llama against an unpatched copy: the tables and plots ``generate_<gpu>.*`` of
docs/decoding.md (the decode overhead users see; target: a compiled step <= 4%).

    python benchmarks/bench_generate.py --rounds 50 [--modes compiled,eager] [--batches 1,8]
    python benchmarks/bench_generate.py --replot benchmarks/results/generate_<gpu>.json   # rewrite .md and .png

A random-weight Llama (8 x 4096, bf16) patched after every block (diffusion, 4 steps) and an unpatched copy: per mode
and batch, ``--rounds`` paired rounds of one greedy ``generate()`` (order alternating, a streamer timing the tokens);
overheads: medians of patched / unpatched - 1 [bootstrap 95%]. ``compiled``: static cache, CUDA graphs, plus one
compiled step's kernels and GPU time. Exactness: tests/test_gpu_generation.py. ``--device cpu``: a smoke run. (The
floor and the substituted steps: docs/decoding.md, from the script of commit b7e044a.)
"""

import argparse
import collections
import json
import os
import shlex
import statistics
import sys

from results_io import (RESULTS, TokenClock, bootstrap_median, clocked, device_name, llama_model, plot_rounds, sync,
                        write_result_files)

import torch  # noqa: E402  (after results_io: it puts the repository on the path)
import transformers  # noqa: E402

from cta.patching_cta import patch_model, pde_modules  # noqa: E402
from cta.pde_cta import triton_available  # noqa: E402


def parse_args(argv=None, known=False):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, text in (("layers", 8, None), ("vocab", 32000, None), ("steps", 4, "PDE steps per site"),
                                ("hidden", 4096, "hidden size (heads of 128 channels, MLP 11008/4096 of it)"),
                                ("prompt", 512, "prompt tokens"), ("new-tokens", 256, None),
                                ("rounds", 7, "paired rounds per mode and batch")):
        p.add_argument(f"--{flag}", type=int, default=default, help=text)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--modes", default="compiled", help="'eager' (dynamic cache) and/or 'compiled' (static cache)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--tag", default=None, help="file-name tag (default: the GPU name)")
    p.add_argument("--replot", metavar="JSON", help="only rewrite the .md and .png of a generate_<gpu>.json")
    p.add_argument("--device", default="cuda", help="'cpu': a smoke test of the script (no kernels counted)")
    return p.parse_known_args(argv)[0] if known else p.parse_args(argv)  # (known: an older file's command)


def step_kernels(model, prompt, profiled=4):
    """The CUDA kernels of one compiled decode step: (kernels per step, GPU µs per step, {kernel name: count per
    step}), from ``profiled`` steps after 4 warm-up steps (on the CPU: traced and run, nothing counted)."""
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

        [run(i) for i in range(4)]
        sync(prompt.device)
        if prompt.device.type != "cuda":
            return 0.0, 0.0, {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            [run(i) for i in range(4, 4 + profiled)]
            sync(prompt.device)
    torch.compiler.reset()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    counts = collections.Counter(e.name[:90] for e in kernels)
    return (len(kernels) / profiled, sum(e.device_time for e in kernels) / profiled,
            {name: n / profiled for name, n in counts.most_common()})


def generate_row(models, args, mode, batch, device):
    """One mode and batch: paired rounds of generate() calls (the order alternating); the patched model's overheads
    from its rounds' ``(unpatched, patched)`` call and step times."""
    prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(3)).to(device)
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                  cache_implementation="static" if mode == "compiled" else None)

    @torch.no_grad()
    def call(model):
        clock = TokenClock()
        return clocked(lambda: model.generate(prompt, streamer=clock, **kwargs), device), clock.median_step()

    row = dict(mode=mode, batch=batch, new_tokens=args.new_tokens,
               first_call_s={name: call(model)[0] for name, model in models.items()})
    times = {name: [] for name in models}
    for r in range(args.rounds):
        for name in ("unpatched", "patched") if r % 2 == 0 else ("patched", "unpatched"):
            times[name].append(call(models[name]))
    pairs = list(zip(times["unpatched"], times["patched"]))
    for key, index in (("call", 0), ("step", 1)):
        ratios = [p[index] / u[index] for u, p in pairs]
        row[f"{key}_rounds_s"] = [(u[index], p[index]) for u, p in pairs]
        row[f"{key}_overhead_percent"] = 100.0 * (statistics.median(ratios) - 1.0)
        row[f"{key}_overhead_range_percent"] = [100.0 * (min(ratios) - 1.0), 100.0 * (max(ratios) - 1.0)]
    steps = row["step_rounds_s"]
    row["step_overhead_interval_percent"] = [100.0 * bound for bound in
                                             bootstrap_median([p / u - 1.0 for u, p in steps], resamples=10000)]
    row["unpatched_step_ms"], row["patched_step_ms"] = (1e3 * statistics.median(side) for side in zip(*steps))
    row["us_per_site_and_step"] = 1e6 * statistics.median(p - u for u, p in steps) / len(pde_modules(models["patched"]))
    print(f"[{mode} batch {batch}] step {row['step_overhead_percent']:+.2f}% call {row['call_overhead_percent']:+.2f}%",
          flush=True)
    return row


def markdown(info, args):
    lines = [f"# model.generate(), patched Llama-shaped model vs an unpatched copy ({info['gpu']})", "",
        f"{args.layers} layers x {args.hidden} hidden, {args.dtype}, sdpa; PDE after every block "
        f"({info['pde_sites']} sites): diffusion, {args.steps} steps, backend `{info['backend_used']}`. Greedy, "
        f"{args.new_tokens} new tokens after a {args.prompt}-token prompt. Step: the median time between a call's "
        f"decoded tokens; overheads: median over {args.rounds} paired rounds of patched / unpatched - 1 (the step "
        "overhead's bootstrap 95% interval, then the range over rounds); µs per site: the median of patched - "
        "unpatched step time over the sites. Compiled: `cache_implementation=\"static\"` (torch.compile, CUDA "
        f"graphs); eager: the dynamic cache. transformers {info['transformers']}, torch {info['torch']}.", "",
        "| mode | batch | unpatched ms/step | patched ms/step | decode-step overhead [95% interval] (range) | "
        "call overhead (range) | µs per site |", "|---|---|---|---|---|---|---|"]
    for row in info["rows"]:
        (low, high), (call_low, call_high) = row["step_overhead_range_percent"], row["call_overhead_range_percent"]
        ci_low, ci_high = row["step_overhead_interval_percent"]
        lines.append(f"| {row['mode']} | {row['batch']} | {row['unpatched_step_ms']:.3f} | {row['patched_step_ms']:.3f} | "
                     f"**{row['step_overhead_percent']:+.2f}%** [{ci_low:+.2f}, {ci_high:+.2f}] ({low:+.2f} .. "
                     f"{high:+.2f}) | {row['call_overhead_percent']:+.2f}% ({call_low:+.2f} .. {call_high:+.2f}) | "
                     f"{row['us_per_site_and_step']:.1f} |")
    if info.get("step_kernels"):
        lines += ["", "Kernels of one compiled decode step (`torch.compile(model.forward, fullgraph=True)`, default "
                      "mode, profiled):", "",
                  "| batch | step | kernels per step | GPU µs per step | vs unpatched |", "|---|---|---|---|---|"]
        for batch, kernels in info["step_kernels"].items():
            base = kernels["unpatched"]
            for name, value in kernels.items():
                delta = "" if name == "unpatched" else (
                    f"{value['kernels'] - base['kernels']:+.0f} kernels, "
                    f"{100 * (value['gpu_us'] / max(base['gpu_us'], 1e-9) - 1):+.2f}% GPU time")
                lines.append(f"| {batch} | {name} | {value['kernels']:.0f} | {value['gpu_us']:.0f} | {delta} |")
    return lines


def plot(info: dict, stem: str) -> None:
    """``<stem>.png``: each row's per-round step overheads, its median and 95% interval, and the 4% target."""
    series = {f"{row['mode']}\nbatch {row['batch']}": ([100 * (p / u - 1) for u, p in row["step_rounds_s"]],
                                                       row["step_overhead_percent"], row["step_overhead_interval_percent"])
              for row in info["rows"]}
    plot_rounds(stem + ".png", f"generate(): patched vs unpatched, per round\n{info['gpu']}", series, target=4)


def main(argv=None):
    args = parse_args(argv)
    if args.replot:  # (the markdown and plot of an existing result file, with the options it was run with)
        with open(args.replot) as f:
            info = json.load(f)
        stem = os.path.splitext(args.replot)[0]
        write_result_files(stem, info, markdown(info, parse_args(shlex.split(info["command"])[2:], known=True)))
        return plot(info, stem)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_generate.py times CUDA generation: it needs a GPU (or --device cpu for a smoke test).")
    dtype = getattr(torch, args.dtype)
    models = {"unpatched": llama_model(args.layers, args.hidden, args.vocab, device, dtype, max_positions=4096),
              "patched": llama_model(args.layers, args.hidden, args.vocab, device, dtype, max_positions=4096)}
    patch_model(models["patched"], pde_type="diffusion", pde_steps=args.steps, placement="block_output", init="paper")
    models["patched"].to(device)
    info = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": getattr(sys.modules.get("triton"), "__version__", None),
            "pde_sites": len(pde_modules(models["patched"])),
            "backend_used": "triton" if device.type == "cuda" and triton_available() else "torch",
            "rows": [], "command": "python benchmarks/bench_generate.py " + " ".join(sys.argv[1:])}
    stem = os.path.join(args.out, "generate_" + (args.tag or device_name(device)))
    batches = [int(b) for b in args.batches.split(",")]
    if "compiled" in args.modes.split(","):
        info["step_kernels"] = {}  # {batch: {unpatched / patched: kernels, GPU µs and kernel names per step}}
        for batch in batches:
            prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(4))
            kernels = info["step_kernels"][str(batch)] = {}
            for name, model in models.items():
                count, gpu_us, names = step_kernels(model, prompt.to(device))
                kernels[name] = {"kernels": count, "gpu_us": gpu_us, "names": names}
                print(f"[kernels] batch {batch} {name}: {count:.0f} kernels, {gpu_us:.0f} us GPU per step", flush=True)
    for mode in args.modes.split(","):
        for batch in batches:
            info["rows"].append(generate_row(models, args, mode, batch, device))
            write_result_files(stem, info, markdown(info, args))  # (after every row: a run may be cut short)
    plot(info, stem)


if __name__ == "__main__":
    main()
