"""A patched Llama-shaped model against unpatched, eager: the table ``patched_model_<gpu>.md`` of
docs/decoding.md (targets: prefill 16k <= 2%, training step <= 5%).

    python benchmarks/bench_patched_model.py            # ~5 min on an H100
    python benchmarks/bench_patched_model.py --layers 2 --hidden 128 --lengths 64 --device cpu  # a smoke run

A random-weight Llama (8 x 4096, bf16, sdpa; seed 0) measured unpatched, then patched in place (diffusion after every
block, 4 steps, ``init="paper"``): prefill at 4k and 16k tokens, a training step (forward + backward at 4k tokens),
greedy decode tokens/s after a 512-token prefill, and peak memory. The overheads come from
``--rounds`` paired rounds (every workload timed unpatched and patched, the patch removed and re-applied in between,
the order alternating; the median of patched / unpatched - 1): the host drifts over a run, pairing keeps it out of
the ratio. Decode comes from per-token pairs (``--decode-pair-tokens``: an unpatched copy decodes beside the patched
model, each token timed by itself), without an attention mask and with the all-ones mask ``generate()`` passes, with
bootstrap 95% intervals. ``generate()`` itself is ``bench_generate.py``'s. Writes ``patched_model_<gpu>.json`` /
``.md``.
"""

import argparse
import json
import os
import statistics
import sys
import time

from results_io import (RESULTS, bootstrap_median, device_name, llama_model, paired_decode, sync,
                        write_result_files)

import torch  # noqa: E402  (after results_io: it puts the repository on the path)
import transformers  # noqa: E402

from cta.patching_cta import is_patched, patch_model, pde_modules, unpatch_model  # noqa: E402
from cta.pde_cta import pde_refine, triton_available  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="decoder layers")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (heads = hidden / 128)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 11008 * hidden / 4096)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--lengths", default="4096,16384", help="prefill lengths")
    p.add_argument("--train-length", type=int, default=4096, help="tokens of the training step")
    p.add_argument("--decode-prefill", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-pair-tokens", type=int, default=1024,
                   help="tokens of the per-token paired decode (the decode overhead; 0: from the paired rounds)")
    p.add_argument("--steps", type=int, default=4, help="PDE steps per site")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9, help="paired unpatched/patched rounds for the overheads")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--tag", default=None, help="file-name tag (default: the GPU name)")
    return p.parse_args(argv)


def timed(job, repeats, warmup):
    """Medians of a clocked job (a callable that runs once and returns its seconds, see :func:`_clocked`)."""
    for _ in range(warmup):
        job()
    times = [job() for _ in range(repeats)]
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "runs_ms": [1e3 * t for t in times]}


def peak(fn, device):
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return {"peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_over_weights_gib": (torch.cuda.max_memory_allocated(device) - base) / 2**30}


def workloads(model, args, device):
    """name -> a callable that runs the workload once and returns its seconds (CUDA synchronised wall clock)."""
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    jobs = {}
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
        jobs[f"prefill_{length}"] = _clocked(
            torch.no_grad()(lambda ids=ids: model(input_ids=ids, use_cache=True, logits_to_keep=1)), device)
    ids = torch.randint(0, vocab, (1, args.train_length), generator=gen).to(device)

    def train_step():
        model.train()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    jobs["train_step"] = _clocked(train_step, device)
    prompt = torch.randint(0, vocab, (1, args.decode_prefill), generator=gen).to(device)

    @torch.no_grad()
    def decode():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync(device)
        start = time.perf_counter()
        for _ in range(args.decode_tokens):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        sync(device)
        return time.perf_counter() - start

    jobs["decode"] = decode
    return jobs


def _clocked(fn, device):
    def run():
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start
    return run


def patch(model, args, device):
    """The benchmark's patch, in place: diffusion after every block, paper coefficients."""
    patch_model(model, pde_type="diffusion", pde_steps=args.steps, placement="block_output", init="paper",
                backend=args.backend)
    model.to(device)


def paired_rounds(model, args, device):
    """Per workload, the (unpatched, patched) seconds of each round (see the module docstring); the order within a
    round alternates, so the model changes state once per round. Leaves the model patched."""
    jobs = workloads(model, args, device)  # the model is patched and unpatched in place: the same jobs serve both
    times = {}
    for r in range(args.rounds):
        order = ("unpatched", "patched") if r % 2 == 0 else ("patched", "unpatched")
        pair = {}
        for state in order:
            if state == "patched" and not is_patched(model):
                patch(model, args, device)
            elif state == "unpatched" and is_patched(model):
                unpatch_model(model)
            for name, job in jobs.items():
                job()  # warm-up (the first call after a patch change fills caches and coefficient buffers)
                pair.setdefault(name, {})[state] = job()
        for name, value in pair.items():
            times.setdefault(name, []).append((value["unpatched"], value["patched"]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {100 * (v['patched'] / v['unpatched'] - 1):+.2f}%" for k, v in pair.items()), flush=True)
    if not is_patched(model):
        patch(model, args, device)
    return times


def measure(model, args, device, label):
    """One pass over the workloads (medians of ``--repeats`` runs; training and decoding: half as many, at least
    3) and their memory peaks."""
    result = {"label": label}
    for name, job in workloads(model, args, device).items():
        timing = timed(job, args.repeats if name.startswith("prefill") else max(3, args.repeats // 2), args.warmup)
        if name == "decode":
            result[name] = {"tokens_per_s": 1e3 * args.decode_tokens / timing["median_ms"],
                            "runs_tokens_per_s": [1e3 * args.decode_tokens / t for t in timing["runs_ms"]]}
            print(f"[{label}] decode: {result[name]['tokens_per_s']:.1f} tok/s", flush=True)
            continue
        result[name] = dict(timing, memory=peak(job, device))
        print(f"[{label}] {name}: {result[name]['median_ms']:.2f} ms", flush=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    device, dtype, hidden = torch.device(args.device), getattr(torch, args.dtype), args.hidden
    lengths = [int(x) for x in args.lengths.split(",")]
    build = lambda: llama_model(args.layers, hidden, args.vocab, device, dtype, intermediate=args.intermediate,  # noqa: E731
                                max_positions=max(32768, max(lengths) + 1024))
    model = build()
    intermediate = model.config.intermediate_size
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = {
        "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
        "model": {"layers": args.layers, "hidden": hidden, "intermediate": intermediate, "heads": hidden // 128,
                  "vocab": args.vocab, "params": sum(p.numel() for p in model.parameters()), "dtype": args.dtype,
                  "attention": "sdpa"},
        "patch": {"placement": "block_output", "pde_type": "diffusion", "pde_steps": args.steps, "init": "paper",
                  "backend_requested": args.backend, "triton_available": triton_available(),
                  "backend_used": "triton" if args.backend != "torch" and device.type == "cuda" and triton_available()
                  else "torch"},
        "repeats": args.repeats,
    }
    print(json.dumps(info, indent=1), flush=True)
    # copy roof and one standalone PDE site on a [1, longest, hidden] hidden state
    x = torch.randn(1, max(lengths), hidden, device=device, dtype=dtype)
    y = torch.empty_like(x)
    roof = {"shape": list(x.shape), "copy": timed(_clocked(lambda: y.copy_(x), device), 20, 3)}
    with torch.no_grad():
        roof["pde_site_forward"] = timed(_clocked(
            lambda: pde_refine(x, pde_type="diffusion", steps=args.steps, alpha=0.1, causal=True,
                               backend=args.backend), device), 20, 3)
    info["copy_roof"] = roof
    del x, y

    info["unpatched"] = measure(model, args, device, "unpatched")
    patch(model, args, device)
    info["patch"]["pde_sites"] = len(pde_modules(model))
    info["patched"] = measure(model, args, device, "patched")
    sequential = {key: 100.0 * (info["patched"][key]["median_ms"] / info["unpatched"][key]["median_ms"] - 1.0)
                  for key in info["unpatched"] if key.startswith("prefill_") or key == "train_step"}
    sequential["decode_tokens_per_s"] = 100.0 * (
        1.0 - info["patched"]["decode"]["tokens_per_s"] / info["unpatched"]["decode"]["tokens_per_s"])
    info["sequential_overhead_percent"] = sequential

    rounds = info["paired_rounds_s"] = paired_rounds(model, args, device)
    overhead, medians = {}, {}
    for key, pairs in rounds.items():
        ratio = statistics.median(p / u for u, p in pairs)
        name = "decode_tokens_per_s" if key == "decode" else key
        # decode is reported as tokens/s: fewer tokens/s is the overhead (1 - u/p of the times)
        overhead[name] = 100.0 * (1.0 - 1.0 / ratio) if key == "decode" else 100.0 * (ratio - 1.0)
        scale = args.decode_tokens if key == "decode" else 1  # decode: seconds per token
        medians[name] = tuple(statistics.median(side) / scale for side in zip(*pairs))
    decode_method = f"paired rounds of {args.decode_tokens}-token runs"
    if args.decode_pair_tokens > 0:
        info["decode_rounds_overhead_percent"] = overhead["decode_tokens_per_s"]
        unpatched = build()  # (same seed, same weights) decodes beside the patched model, token by token
        prompt = torch.randint(0, args.vocab, (1, args.decode_prefill),
                               generator=torch.Generator(device="cpu").manual_seed(2)).to(device)
        for key, mask in (("decode_tokens_per_s", False), ("decode_tokens_per_s_masked", True)):
            pairs = paired_decode(model, unpatched, prompt, args.decode_tokens, args.decode_pair_tokens, mask=mask)
            info[key.replace("tokens_per_s", "token_pairs_s")] = pairs
            ratios = [p / u for u, p in pairs]
            overhead[key] = 100.0 * (1.0 - 1.0 / statistics.median(ratios))
            info.setdefault("decode_overhead_interval_percent", {})[key] = [
                100.0 * (1.0 - 1.0 / r) for r in bootstrap_median(ratios)]
            medians[key] = tuple(statistics.median(side) for side in zip(*pairs))
        del unpatched
        decode_method = f"{len(pairs)} per-token pairs"
    info["decode_overhead_method"] = decode_method
    info["overhead_percent"], info["paired_medians_s"] = overhead, medians
    targets = info["targets_percent"] = {"prefill_16384": 2.0, "train_step": 5.0}  # (decode's are generate()'s)

    info["command"] = "python benchmarks/bench_patched_model.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Patched Llama-shaped model vs unpatched ({gpu})", "",
        f"{args.layers} layers x {hidden} hidden ({info['model']['params'] / 1e9:.2f}B params, {args.dtype}, sdpa), "
        f"PDE after every block: diffusion, {args.steps} steps, backend `{info['patch']['backend_used']}`. "
        f"Overheads: median over {args.rounds} paired rounds (each times every workload unpatched and patched, the "
        f"patch removed and re-applied in between) of patched / unpatched; times: the medians of those rounds. "
        + (f"Decode: median over {decode_method} (an unpatched copy of the model decodes beside the patched one, "
           f"each token timed by itself, synchronised, the order alternating) of patched / unpatched per-token time, "
           f"without an attention mask and with the all-ones mask generate() passes at every step, as a drop in "
           f"tokens/s with a bootstrap 95% interval; "
           f"the paired rounds' {args.decode_tokens}-token runs read {info['decode_rounds_overhead_percent']:+.2f}%. "
           if args.decode_pair_tokens > 0 else "")
        + f"Measured one after the other instead (the first pass, {args.repeats} runs each), the overheads read "
        + ", ".join(f"{k.replace('_', ' ')} {v:+.2f}%" for k, v in sequential.items()) + ".", "",
        "| measurement | unpatched | patched | overhead | target |", "|---|---|---|---|---|"]
    for key, value in overhead.items():
        unpatched_s, patched_s = medians[key]
        value_text = f"{value:+.2f}%"
        if key.startswith("decode_tokens_per_s"):
            masked = ", all-ones attention mask each step" if key.endswith("masked") else ""
            row = (f"decode tokens/s (batch 1, after {args.decode_prefill}-token prefill{masked})",
                   f"{1 / unpatched_s:.1f}", f"{1 / patched_s:.1f}")
            interval = info.get("decode_overhead_interval_percent", {}).get(key)
            if interval:
                value_text = f"{value:+.2f}% [{interval[0]:+.2f}, {interval[1]:+.2f}]"
        else:
            name = f"prefill {key.split('_')[1]} tokens (ms)" if key.startswith("prefill") else \
                f"training step fwd+bwd {args.train_length} tokens (ms)"
            row = (name, f"{1e3 * unpatched_s:.2f}", f"{1e3 * patched_s:.2f}")
        target = f"<= {targets[key]:.0f}%" if key in targets else ""
        lines.append(f"| {row[0]} | {row[1]} | {row[2]} | {value_text} | {target} |")
    for key in (f"prefill_{lengths[-1]}", "train_step"):
        mu, mp = info["unpatched"][key]["memory"], info["patched"][key]["memory"]
        if mu and mp:
            lines.append(f"| peak memory {key} (GiB) | {mu['peak_gib']:.2f} | {mp['peak_gib']:.2f} | "
                         f"{100 * (mp['peak_gib'] / mu['peak_gib'] - 1):+.2f}% | |")
    lines += ["", f"Copy roof of one {roof['shape']} hidden state: {roof['copy']['median_ms']:.3f} ms; one PDE site "
              f"forward: {roof['pde_site_forward']['median_ms']:.3f} ms."]
    write_result_files(os.path.join(args.out, f"patched_model_{args.tag or device_name(device)}"), info, lines)


if __name__ == "__main__":
    main()
