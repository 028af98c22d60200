"""A patched Llama-shaped model against unpatched, eager: the tables ``patched_model_<gpu>.md`` (targets: prefill
16k <= 2%, training step <= 5%) and ``cpu_decode.md`` (a decoded token <= 7% more on the CPU) of docs/decoding.md.

    python benchmarks/bench_patched_model.py            # ~5 min on an H100
    python benchmarks/bench_patched_model.py --cpu-decode   # ~10 min on one CPU thread (3 processes per type)
    python benchmarks/bench_patched_model.py --layers 2 --hidden 128 --lengths 64 --device cpu  # a smoke run

A random-weight Llama (8 x 4096, bf16, sdpa) patched in place (diffusion after every block, 4 steps) and unpatched
again in ``--rounds`` paired rounds of prefill at ``--lengths`` and a training step (order alternating; overhead: the
median of patched / unpatched - 1; round 1 reads peak memory). Decode: per-token pairs (``results_io.paired_decode``)
without and with the all-ones mask, a drop in tokens/s [bootstrap 95%]. ``--cpu-decode``: those pairs alone per
``--pde-types`` on SmolLM2-135M's shape (30 x 576, fp32, one thread, ``--backend``), with the host µs per site.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from results_io import RESULTS, bootstrap_median, clocked, device_name, llama_model, paired_decode, write_result_files

import torch  # noqa: E402  (after results_io: it puts the repository on the path)
import transformers  # noqa: E402

from cta.patching_cta import is_patched, patch_model, pde_modules, unpatch_model  # noqa: E402
from cta.pde_cta import cpu_kernel, pde_refine, triton_available  # noqa: E402

TARGETS = {"prefill_16384": 2.0, "train_step": 5.0}  # (the decode targets are generate()'s)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, text in (
            ("layers", 8, "decoder layers"), ("hidden", 4096, "hidden size (heads of 128)"), ("vocab", 32000, ""),
            ("train-length", 4096, "tokens of the training step"), ("rounds", 9, "paired unpatched/patched rounds"),
            ("decode-prefill", 512, "prompt tokens before decoding"), ("decode-tokens", 128, "tokens per decode pass"),
            ("decode-pair-tokens", 1024, "timed per-token pairs"), ("steps", 4, "PDE steps per site"),
            ("threads", 1, "with --cpu-decode: torch threads"), ("processes", 3, "with --cpu-decode: per type")):
        p.add_argument(f"--{flag}", type=int, default=default, help=text or None)
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 11008 * hidden / 4096)")
    p.add_argument("--lengths", default="4096,16384", help="prefill lengths")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--tag", default=None, help="file-name tag (default: the GPU name)")
    p.add_argument("--cpu-decode", action="store_true", help="only CPU decode pairs, for each of --pde-types")
    p.add_argument("--pde-types", default="diffusion,reaction_diffusion", help="with --cpu-decode")
    args = p.parse_args(argv)
    if args.cpu_decode:  # SmolLM2-135M's shape unless given
        p.set_defaults(layers=30, hidden=576, intermediate=1536, vocab=49152, decode_prefill=64, decode_tokens=200,
                       decode_pair_tokens=300, device="cpu", dtype="float32")
        args = p.parse_args(argv)
    return args


def cpu_decode(args, build):
    """Per-token pairs (all-ones mask), patched vs unpatched, per type over ``--processes`` (a heap moves one ~1.5%)."""
    torch.set_num_threads(args.threads)
    if args.processes == 0:  # (one process of the run below: its pairs, as JSON to --out)
        unpatched, patched = build(), patch_model(build(), pde_type=args.pde_types, pde_steps=args.steps,
                                                  placement="block_output", init="paper", backend=args.backend)
        prompt = torch.randint(0, args.vocab, (1, args.decode_prefill), generator=torch.Generator().manual_seed(3))
        pairs = paired_decode(patched, unpatched, prompt, args.decode_tokens, args.decode_pair_tokens, mask=True)
        return json.dump({"sites": len(pde_modules(patched)), "pairs": pairs}, open(args.out, "w"))
    runs, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for pde_type in [t for _ in range(args.processes) for t in args.pde_types.split(",")]:
            out = os.path.join(tmp, f"{pde_type}_{len(runs.get(pde_type, []))}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--pde-types", pde_type,
                            "--processes", "0", "--out", out], check=True, stdout=subprocess.DEVNULL)
            runs.setdefault(pde_type, []).append(json.load(open(out)))
    overhead = lambda pairs: 100 * (statistics.median(p / u for u, p in pairs) - 1)  # noqa: E731
    for pde_type, parts in runs.items():
        pairs, sites = [pair for part in parts for pair in part["pairs"]], parts[0]["sites"]
        rows.append(dict(pde_type=pde_type, sites=sites, pairs=len(pairs),
                         unpatched_step_us=1e6 * statistics.median(u for u, _ in pairs),
                         patched_step_us=1e6 * statistics.median(p for _, p in pairs), overhead_percent=overhead(pairs),
                         overhead_ci95_percent=[100 * (x - 1) for x in bootstrap_median([p / u for u, p in pairs])],
                         process_overheads_percent=[overhead(part["pairs"]) for part in parts],
                         host_us_per_site=1e6 * statistics.median(p - u for u, p in pairs) / sites, target_percent=7.0))
    patch = dict(placement="block_output", pde_steps=args.steps, init="paper", backend=args.backend,  # and what ran:
                 backend_used="cpu kernel" if args.backend == "auto" and cpu_kernel() is not None else "torch")
    info = dict(cpu=platform.processor() or platform.machine(), threads=args.threads, torch=torch.__version__,
                transformers=transformers.__version__, model=dict(layers=args.layers, hidden=args.hidden,
                                                                  intermediate=args.intermediate, dtype="float32"),
                patch=patch, rows=rows, command="python benchmarks/bench_patched_model.py " + " ".join(sys.argv[1:]))
    lines = [f"# CPU decode: patched Llama vs an unpatched copy ({info['cpu']}, {args.threads} thread)", "",
             f"{args.layers} layers x {args.hidden} hidden, fp32, sdpa; PDE after every block, {args.steps} steps, "
             f"`init=\"paper\"`, backend `{args.backend}` ({patch['backend_used']}). Per-token pairs (both decode each "
             f"token back to back) of {args.processes} processes per type; overhead: median of patched / unpatched - 1 "
             f"[bootstrap 95%] (each process's). torch {info['torch']}, transformers {info['transformers']}.", "",
             "| PDE type | unpatched µs/token | patched µs/token | overhead | host µs per site | target |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['pde_type']} | {r['unpatched_step_us']:.0f} | {r['patched_step_us']:.0f} | "
              f"{r['overhead_percent']:+.1f}% [{r['overhead_ci95_percent'][0]:+.1f}, {r['overhead_ci95_percent'][1]:+.1f}]"
              f" ({', '.join(f'{x:+.1f}' for x in r['process_overheads_percent'])}) | {r['host_us_per_site']:.1f} | "
              f"<= {r['target_percent']:.0f}% |" for r in rows]
    write_result_files(os.path.join(args.out, "cpu_decode"), info, lines)


def peak_gib(fn, device):
    """The peak GiB allocated during one call of ``fn`` (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    clocked(fn, device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def workloads(model, args, device):
    """name -> a callable that runs the workload once."""
    gen = torch.Generator().manual_seed(1)
    jobs = {}
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(0, args.vocab, (1, length), generator=gen).to(device)
        jobs[f"prefill_{length}"] = torch.no_grad()(
            lambda ids=ids: model(input_ids=ids, use_cache=True, logits_to_keep=1))
    ids = torch.randint(0, args.vocab, (1, args.train_length), generator=gen).to(device)

    def train_step():
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    jobs["train_step"] = train_step
    return jobs


def main(argv=None):
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    build = lambda: llama_model(args.layers, args.hidden, args.vocab, device, dtype,  # noqa: E731
                                intermediate=args.intermediate, max_positions=max(32768, max(lengths) + 1024))
    if args.cpu_decode:
        return cpu_decode(args, build)
    model = build()
    patch = lambda model: patch_model(model, pde_type="diffusion", pde_steps=args.steps,  # noqa: E731
                                      placement="block_output", init="paper", backend=args.backend).to(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    backend = "triton" if args.backend != "torch" and device.type == "cuda" and triton_available() else "torch"
    info = {"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "model": {"layers": args.layers, "hidden": args.hidden, "intermediate": model.config.intermediate_size,
                      "heads": args.hidden // 128, "vocab": args.vocab, "dtype": args.dtype, "attention": "sdpa",
                      "params": sum(p.numel() for p in model.parameters())},
            "patch": {"placement": "block_output", "pde_type": "diffusion", "pde_steps": args.steps, "init": "paper",
                      "backend_requested": args.backend, "backend_used": backend},
            "command": "python benchmarks/bench_patched_model.py " + " ".join(sys.argv[1:])}
    x = torch.randn(1, max(lengths), args.hidden, device=device, dtype=dtype)  # the copy roof and one site
    y = torch.empty_like(x)
    with torch.no_grad():
        roof = {"shape": list(x.shape), "copy_ms": 1e3 * statistics.median(
            clocked(lambda: y.copy_(x), device) for _ in range(20)), "pde_site_forward_ms": 1e3 * statistics.median(
            clocked(lambda: pde_refine(x, pde_type="diffusion", steps=args.steps, alpha=0.1, causal=True,
                                       backend=args.backend), device) for _ in range(20))}
    info["copy_roof"] = roof
    x = y = None  # (freed)

    jobs, rounds, memory = workloads(model, args, device), {}, {}
    for r in range(args.rounds):
        pair = {}
        for state in ("unpatched", "patched") if r % 2 == 0 else ("patched", "unpatched"):
            if (state == "patched") != is_patched(model):
                patch(model) if state == "patched" else unpatch_model(model)
            for name, job in jobs.items():
                job()  # warm-up (the first call after a patch change fills caches and coefficient buffers)
                if r == 0:
                    memory.setdefault(name, {})[state] = peak_gib(job, device)
                pair.setdefault(name, {})[state] = clocked(job, device)
        for name, value in pair.items():
            rounds.setdefault(name, []).append((value["unpatched"], value["patched"]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {100 * (v['patched'] / v['unpatched'] - 1):+.2f}%" for k, v in pair.items()), flush=True)
    if not is_patched(model):  # (the last round ended unpatched)
        patch(model)
    info["patch"]["pde_sites"] = len(pde_modules(model))
    info["paired_rounds_s"], info["peak_memory_gib"] = rounds, memory
    overhead = {name: 100.0 * (statistics.median(p / u for u, p in pairs) - 1.0) for name, pairs in rounds.items()}
    medians = {name: tuple(statistics.median(side) for side in zip(*pairs)) for name, pairs in rounds.items()}
    unpatched = build()  # (same seed, same weights) decodes beside the patched model, token by token
    prompt = torch.randint(0, args.vocab, (1, args.decode_prefill), generator=torch.Generator().manual_seed(2))
    for key, mask in (("decode_tokens_per_s", False), ("decode_tokens_per_s_masked", True)):
        pairs = paired_decode(model, unpatched, prompt.to(device), args.decode_tokens, args.decode_pair_tokens,
                              mask=mask)
        ratios = [p / u for u, p in pairs]
        info[key.replace("tokens_per_s", "token_pairs_s")] = pairs
        overhead[key] = 100.0 * (1.0 - 1.0 / statistics.median(ratios))  # fewer tokens/s
        info.setdefault("decode_overhead_interval_percent", {})[key] = [
            100.0 * (1.0 - 1.0 / r) for r in bootstrap_median(ratios)]
        medians[key] = tuple(statistics.median(side) for side in zip(*pairs))
    info["overhead_percent"], info["paired_medians_s"], info["targets_percent"] = overhead, medians, TARGETS
    lines = [
        f"# Patched Llama-shaped model vs unpatched ({gpu})", "",
        f"{args.layers} layers x {args.hidden} hidden ({info['model']['params'] / 1e9:.2f}B params, {args.dtype}, "
        f"sdpa), PDE after every block: diffusion, {args.steps} steps, backend `{backend}`. Overheads: median over "
        f"{args.rounds} paired rounds (each times every workload unpatched and patched, the patch removed and "
        "re-applied in between) of patched / unpatched; times: the medians of those rounds. Decode: median over "
        f"{len(pairs)} per-token pairs (an unpatched copy of the model decodes beside the patched one, each token "
        "timed by itself, synchronised, the order alternating) of patched / unpatched per-token time, without an "
        "attention mask and with the all-ones mask generate() passes at every step, as a drop in tokens/s with a "
        "bootstrap 95% interval.", "",
        "| measurement | unpatched | patched | overhead | target |", "|---|---|---|---|---|"]
    for key, value in overhead.items():
        unpatched_s, patched_s = medians[key]
        if key.startswith("decode"):
            low, high = info["decode_overhead_interval_percent"][key]
            masked = ", all-ones attention mask each step" if key.endswith("masked") else ""
            lines.append(f"| decode tokens/s (batch 1, after {args.decode_prefill}-token prefill{masked}) | "
                         f"{1 / unpatched_s:.1f} | {1 / patched_s:.1f} | {value:+.2f}% [{low:+.2f}, {high:+.2f}] | |")
            continue
        name = f"prefill {key.split('_')[1]} tokens (ms)" if key.startswith("prefill") else \
            f"training step fwd+bwd {args.train_length} tokens (ms)"
        target = f"<= {TARGETS[key]:.0f}%" if key in TARGETS else ""
        lines.append(f"| {name} | {1e3 * unpatched_s:.2f} | {1e3 * patched_s:.2f} | {value:+.2f}% | {target} |")
    for key in (f"prefill_{lengths[-1]}", "train_step"):
        if device.type == "cuda":
            mu, mp = memory[key]["unpatched"], memory[key]["patched"]
            lines.append(f"| peak memory {key} (GiB) | {mu:.2f} | {mp:.2f} | {100 * (mp / mu - 1):+.2f}% | |")
    lines += ["", f"Copy roof of one {roof['shape']} hidden state: {roof['copy_ms']:.3f} ms; one PDE site forward: "
                  f"{roof['pde_site_forward_ms']:.3f} ms."]
    write_result_files(os.path.join(args.out, f"patched_model_{args.tag or device_name(device)}"), info, lines)


if __name__ == "__main__":
    main()
