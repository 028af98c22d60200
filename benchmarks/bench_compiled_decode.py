"""Decode speed of a patched Llama-shaped model vs unpatched when the decode step is compiled and replayed as a CUDA
graph (``StaticCache`` + ``torch.compile(mode="reduce-overhead")``), the setting in which host time stops counting.

``bench_patched_model.py`` measures eager decoding, where a batch-1 step is bound by Python and launch time and
every PDE site adds a call per token. Here both models run the same compiled, graph-replayed step; the PDE decode
update is traced as plain tensor operations, which inductor fuses with their neighbours.

    python benchmarks/bench_compiled_decode.py [--layers 8] [--hidden 4096] [--tokens 128]

Writes ``benchmarks/results/compiled_decode_<gpu>.json`` and ``.md``.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cta  # noqa: E402
from bench_patched_model import llama_model, sync  # noqa: E402  (same model, same synchronisation)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=4, help="PDE steps per site")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mode", default="reduce-overhead", help="torch.compile mode ('default' runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    return p.parse_args()


def measure(model, prompt, args, label):
    """Greedy decode through a StaticCache with the compiled forward; returns tokens/s runs and the first run's
    logits and fed tokens (for the exactness check)."""
    from transformers import StaticCache

    step = torch.compile(model.forward, mode=args.mode, fullgraph=True)
    max_len = prompt.shape[1] + args.tokens + 1

    @torch.no_grad()
    def run():
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        logits, fed = [], []
        sync(torch.device(args.device))
        start = time.perf_counter()
        for i in range(args.tokens):
            position = torch.tensor([prompt.shape[1] + i], device=prompt.device)
            fed.append(token)
            out = step(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position,
                       position_ids=position[None])
            logits.append(out.logits[:, -1].float().clone())
            token = out.logits[:, -1:].argmax(-1)
        sync(torch.device(args.device))
        return time.perf_counter() - start, torch.cat(logits), torch.cat(fed, 1)

    t0 = time.perf_counter()
    run()  # compile + graph capture
    run()
    print(f"[{label}] compiled and warmed up in {time.perf_counter() - t0:.0f}s", flush=True)
    runs, first = [], None
    for _ in range(args.repeats):
        seconds, logits, fed = run()
        runs.append(args.tokens / seconds)
        first = (logits, fed) if first is None else first
    print(f"[{label}] {statistics.median(runs):.1f} tok/s", flush=True)
    return runs, first


def eager_logits(model, prompt, fed):
    """Eager logits for the same fed tokens (teacher-forced: a near-tie in a random model's greedy choice must not
    turn a rounding difference into a different continuation)."""
    from transformers import StaticCache

    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + fed.shape[1] + 1)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = []
        for i in range(fed.shape[1]):
            position = torch.tensor([prompt.shape[1] + i], device=prompt.device)
            out = model(input_ids=fed[:, i:i + 1], past_key_values=cache, use_cache=True, cache_position=position,
                        position_ids=position[None])
            logits.append(out.logits[:, -1].float())
    return torch.cat(logits)


def main():
    args = parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = llama_model(args.layers, args.hidden, args.intermediate, args.vocab, torch.device(args.device), dtype)
    prompt = torch.randint(0, args.vocab, (1, args.prefill), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(args.device)
    decode_path = "traced reference ops (fused by inductor)"
    result = dict(config=dict(vars(args)), device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  torch=torch.__version__, compiled_decode_path=decode_path)
    for label in ("unpatched", "patched"):
        if label == "patched":
            cta.patch_model(model, pde_type="diffusion", pde_steps=args.steps, placement="block_output",
                            init="paper")
        torch._dynamo.reset()
        runs, (logits, fed) = measure(model, prompt, args, label)
        reference = eager_logits(model, prompt, fed[:, :16])
        diff = (logits[: reference.shape[0]] - reference).abs().max().item()
        result[label] = dict(tokens_per_s=statistics.median(runs), runs_tokens_per_s=runs,
                             max_abs_logit_diff_vs_eager=diff, logit_scale=reference.abs().max().item())
    base, new = result["unpatched"]["tokens_per_s"], result["patched"]["tokens_per_s"]
    result["decode_overhead_pct"] = 100.0 * (1.0 - new / base)
    tag = result["device"].replace(" ", "_")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"compiled_decode_{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# Compiled decoding (StaticCache + torch.compile mode={args.mode!r}), patched vs unpatched ({result['device']})",
        "",
        f"{args.layers} layers x {args.hidden} hidden, {str(dtype).replace('torch.', '')}, batch 1, "
        f"{args.prefill}-token prefill, {args.tokens} greedy tokens; PDE after every block: diffusion, "
        f"{args.steps} steps. Median of {args.repeats} runs. PDE decode step in the compiled graph: {decode_path}.",
        "",
        "| model | decode tokens/s | max abs logit diff vs eager (first 16 tokens, same inputs) | max abs logit |",
        "|---|---|---|---|",
        *(f"| {label} | {result[label]['tokens_per_s']:.1f} | {result[label]['max_abs_logit_diff_vs_eager']:.3g} | "
          f"{result[label]['logit_scale']:.3g} |" for label in ("unpatched", "patched")),
        "",
        f"Decode overhead of the patch: {result['decode_overhead_pct']:+.2f}% (target <= 5%).",
        "",
        "Reproduce: `python benchmarks/bench_compiled_decode.py`",
        "",
    ]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
