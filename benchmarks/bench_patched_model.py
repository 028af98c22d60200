"""End-to-end overhead of CTA patching on a Llama-shaped model (SPEC §6, model level).

A random-weight ``LlamaForCausalLM`` (default 8 layers x 4096 hidden, 32 heads, SwiGLU 11008, bf16, sdpa attention) is
measured unpatched, then patched in place with ``cta.patch_model(placement="block_output", pde_steps=4,
pde_type="diffusion", init="paper", backend=...)`` (a PDE site after every block) and measured again, in the same
run on the same GPU:

* prefill latency (batch 1, ``use_cache=True``, ``logits_to_keep=1``) at 4k and 16k tokens,
* training step time: forward + backward of the LM loss at 4k tokens (no optimizer: it is the same for both),
* decode tokens/s: greedy, one token at a time through the cache, after a 512-token prefill,
* peak memory of the 16k prefill and of the training step,
* exactness: max |step logits - full-forward logits| of cached decoding (patched and unpatched, bf16 noise floor),
* the copy roof (``y.copy_(x)`` of one [1, 16k, 4096] hidden state) and one standalone PDE site for context.

The overheads come from paired rounds (``--rounds``): each round times every workload once unpatched and once
patched (the patch removed with ``cta.unpatch_model`` and re-applied in place between them, the order alternating), and
an overhead is the median over rounds of patched / unpatched - 1. Decoding and short steps are partly host-bound, and
the host's speed drifts over a run; pairing keeps that drift out of the ratio (measured one after the other, the
decode overhead of one unchanged build read +1.9%, +7.4% and +8.7% in three sessions). A batch-1 decode step is
host-bound and takes milliseconds, and paired rounds of whole decode runs still moved a lot (the nine rounds of one
run read from -29% to +66%); so the decode overhead comes from per-token pairs instead (``--decode-pair-tokens``):
an unpatched copy of the model (same seed, same weights) decodes beside the patched one, and every token is decoded
by each, back to back, each step timed by itself (the rounds' figure stays in the JSON and the table's text). The
first, sequential measurement of each model still gives the memory peaks, the exactness check and its own medians
(in the JSON).

Timings are medians over ``--repeats`` runs after warm-up (CUDA synchronised wall clock). Writes
``benchmarks/results/patched_model_<gpu>.json`` / ``.md`` / ``.png``; the JSON records the PDE backend that ran.

    python benchmarks/bench_patched_model.py                 # the full measurement (~5 min on an H100)
    python benchmarks/bench_patched_model.py --layers 2 --hidden 1024 --lengths 512,1024 --device cpu  # smoke test

``model.generate()`` (eager and compiled) is measured by ``bench_generate.py``.
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

from results_io import bootstrap_median, paired_decode  # noqa: E402  (beside this script)

from cta.patching_cta import is_patched, patch_model, pde_modules, unpatch_model  # noqa: E402
from cta.pde_cta import _use_triton, pde_refine, triton_available  # noqa: E402


def parse_args():
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
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default=None, help="file-name tag (default: the GPU name)")
    return p.parse_args()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    3), their memory peaks, and the exactness of cached decoding."""
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)
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

    # exactness of cached decoding: step logits vs the full forward (48-token prefill + 16 single-token steps)
    with torch.no_grad():
        seq = torch.randint(0, vocab, (1, 64), generator=gen).to(device)
        full = model(input_ids=seq, use_cache=False).logits.float()
        out = model(input_ids=seq[:, :48], use_cache=True)
        steps, cache = [out.logits.float()], out.past_key_values
        for t in range(48, 64):
            out = model(input_ids=seq[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits.float())
        result["cached_vs_full_max_abs_logit_diff"] = float((torch.cat(steps, 1) - full).abs().max())
    return result


def llama_model(layers, hidden, intermediate, vocab, device, dtype, max_positions=32768):
    """The random-weight Llama-shaped model of the model-level benchmarks (heads of 128 channels; seed 0)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=max_positions, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(dtype).eval()


def main():
    args = parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    hidden = args.hidden
    intermediate = args.intermediate or int(round(11008 * hidden / 4096 / 64)) * 64
    model = llama_model(args.layers, hidden, intermediate, args.vocab, device, dtype,
                        max_positions=max(32768, max(int(x) for x in args.lengths.split(",")) + 1024))
    model.config._attn_implementation = "sdpa"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = args.tag or gpu.replace(" ", "_")
    info = {
        "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
        "model": {"layers": args.layers, "hidden": hidden, "intermediate": intermediate, "heads": hidden // 128,
                  "vocab": args.vocab, "params": sum(p.numel() for p in model.parameters()), "dtype": args.dtype,
                  "attention": "sdpa"},
        "patch": {"placement": "block_output", "pde_type": "diffusion", "pde_steps": args.steps, "init": "paper",
                  "backend_requested": args.backend},
        "repeats": args.repeats,
    }
    probe = torch.zeros(1, 8, hidden, device=device, dtype=dtype)
    info["patch"]["triton_available"] = triton_available()
    info["patch"]["backend_used"] = "triton" if _use_triton(args.backend, probe) else "torch"
    print(json.dumps(info, indent=1), flush=True)
    # copy roof and one standalone PDE site on a [1, 16k, hidden] hidden state
    x = torch.randn(1, max(int(v) for v in args.lengths.split(",")), hidden, device=device, dtype=dtype)
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

    sequential = {}
    for key in info["unpatched"]:
        if key.startswith("prefill_") or key == "train_step":
            base, new = info["unpatched"][key]["median_ms"], info["patched"][key]["median_ms"]
            sequential[key] = 100.0 * (new / base - 1.0)
    base, new = info["unpatched"]["decode"]["tokens_per_s"], info["patched"]["decode"]["tokens_per_s"]
    sequential["decode_tokens_per_s"] = 100.0 * (1.0 - new / base)
    info["sequential_overhead_percent"] = sequential

    rounds = paired_rounds(model, args, device)
    info["paired_rounds_s"] = rounds
    overhead, medians = {}, {}
    for key, pairs in rounds.items():
        ratios = [p / u for u, p in pairs]
        name = "decode_tokens_per_s" if key == "decode" else key
        # decode is reported as tokens/s: fewer tokens/s is the overhead (1 - u/p of the times)
        overhead[name] = 100.0 * (1.0 - 1.0 / statistics.median(ratios)) if key == "decode" else \
            100.0 * (statistics.median(ratios) - 1.0)
        scale = args.decode_tokens if key == "decode" else 1  # decode: seconds per token
        medians[name] = tuple(statistics.median(side) / scale for side in zip(*pairs))
    decode_method = f"paired rounds of {args.decode_tokens}-token runs"
    if args.decode_pair_tokens > 0:
        info["decode_rounds_overhead_percent"] = overhead["decode_tokens_per_s"]
        # A second, unpatched copy (same seed, same weights) decodes beside the patched model, token by token.
        unpatched = llama_model(args.layers, hidden, intermediate, args.vocab, device, dtype)
        unpatched.config._attn_implementation = "sdpa"
        prompt = torch.randint(0, args.vocab, (1, args.decode_prefill),
                               generator=torch.Generator(device="cpu").manual_seed(2)).to(device)
        # Without an attention mask, and with the all-ones mask generate() passes at every step (the PDE then
        # reads that step's column as its token mask).
        for key, mask in (("decode_tokens_per_s", False), ("decode_tokens_per_s_masked", True)):
            pairs = paired_decode(model, unpatched, prompt, args.decode_tokens, args.decode_pair_tokens, device,
                                  mask=mask)
            info[key.replace("tokens_per_s", "token_pairs_s")] = pairs
            ratios = [p / u for u, p in pairs]
            overhead[key] = 100.0 * (1.0 - 1.0 / statistics.median(ratios))
            info.setdefault("decode_overhead_interval_percent", {})[key] = [
                100.0 * (1.0 - 1.0 / r) for r in bootstrap_median(ratios)]
            medians[key] = tuple(statistics.median(side) for side in zip(*pairs))
        del unpatched
        decode_method = f"{len(pairs)} per-token pairs"
    info["decode_overhead_method"] = decode_method
    info["overhead_percent"] = overhead
    info["paired_medians_s"] = medians
    # The spec's decode targets are for model.generate() (--generate); these per-token pairs have none.
    targets = {"prefill_16384": 2.0, "train_step": 5.0}
    info["targets_percent"] = targets

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"patched_model_{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    lines = [
        f"# Patched Llama-shaped model vs unpatched ({gpu})",
        "",
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
        + ", ".join(f"{k.replace('_', ' ')} {v:+.2f}%" for k, v in sequential.items()) + ".",
        "",
        "| measurement | unpatched | patched | overhead | target |",
        "|---|---|---|---|---|",
    ]
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
    for key in ("prefill_" + args.lengths.split(",")[-1], "train_step"):
        mu, mp = info["unpatched"][key]["memory"], info["patched"][key]["memory"]
        if mu and mp:
            lines.append(f"| peak memory {key} (GiB) | {mu['peak_gib']:.2f} | {mp['peak_gib']:.2f} | "
                         f"{100 * (mp['peak_gib'] / mu['peak_gib'] - 1):+.2f}% | |")
    lines += [
        "",
        f"Cached decoding vs full forward, max |logit diff| (bf16): unpatched "
        f"{info['unpatched']['cached_vs_full_max_abs_logit_diff']:.3g}, patched "
        f"{info['patched']['cached_vs_full_max_abs_logit_diff']:.3g}.",
        f"Copy roof of one {roof['shape']} hidden state: {roof['copy']['median_ms']:.3f} ms; one PDE site forward: "
        f"{roof['pde_site_forward']['median_ms']:.3f} ms.",
        "",
        "Reproduce: `python benchmarks/bench_patched_model.py`",
    ]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = list(overhead)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        bars = ax.bar(range(len(keys)), [overhead[k] for k in keys],
                      color=["tab:green" if overhead[k] <= targets.get(k, 1e9) else "tab:red" for k in keys])
        for i, k in enumerate(keys):
            if k in targets:
                ax.hlines(targets[k], i - 0.4, i + 0.4, colors="k", linestyles="dashed")
        ax.set_xticks(range(len(keys)), [k.replace("_", " ") for k in keys], rotation=15)
        ax.set_ylabel("overhead vs unpatched (%)")
        ax.bar_label(bars, fmt="%.1f%%")
        ax.set_title(f"CTA patch, {args.layers}x{hidden} Llama, {args.steps} diffusion steps/block ({gpu})", fontsize=9)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
