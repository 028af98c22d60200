"""What a PDE site adds to one eager decode step, split by substitute steps, in per-token pairs and through generate().

    python benchmarks/decode_step_pairs.py [--pairs 512] [--rounds 15] [--batch 1] [--out benchmarks/results]

The Llama-shaped model of ``bench_patched_model.py`` (8 x 4096, bf16, sdpa; diffusion, 4 steps after every block,
``init="paper"``) beside an unpatched copy with the same weights. For each variant of the patched model's one-token
step (the package's; plain torch ops, ``--eager-decode torch``; the identity, which leaves the structure alone: hooks,
lookups, module calls): (1) per-token pairs in a plain decode loop (``bench_patched_model.paired_decode``: each token
decoded by both models back to back, with the all-ones mask generate() passes), median of patched / unpatched and its
bootstrap 95% interval; (2) ``--rounds`` paired ``generate()`` calls of ``--tokens`` new tokens, median over rounds
of the ratio of the median time between tokens. If the structure costs more through generate() than in the loop,
the difference is generate()'s, not the sites'. Writes ``decode_step_pairs_<gpu>_batch<N>.json`` / ``.md``.
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from bench_patched_model import (  # noqa: E402
    _TokenClock, bootstrap_median, decode_step_variant, llama_model, paired_decode, sync,
)
from results_io import write_result_files  # noqa: E402

from cta.patching_cta import patch_model, pde_modules  # noqa: E402

VARIANTS = {"package": "the package's step", "torch": "plain torch ops (the recurrence)",
            "identity": "the identity (structure alone)"}


def generate_rounds(patched, unpatched, prompt, tokens, rounds, device):
    """``rounds`` paired generate() calls (order alternating): per round, the two calls' median times between
    tokens."""
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, min_new_tokens=tokens,
                  do_sample=False, pad_token_id=0)

    def step_time(model):
        clock = _TokenClock()
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--pairs", type=int, default=512, help="per-token pairs per variant (plain loop)")
    p.add_argument("--rounds", type=int, default=15, help="paired generate() calls per variant")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per generate() call and per loop pass")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"a comma list of {sorted(VARIANTS)}")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    intermediate = 11008 * args.hidden // 4096
    unpatched, patched = (llama_model(args.layers, args.hidden, intermediate, 32000, device, dtype) for _ in range(2))
    for model in (unpatched, patched):
        model.config._attn_implementation = "sdpa"  # noqa: SLF001 - transformers' documented config field
    patch_model(patched, pde_type="diffusion", pde_steps=4, placement="block_output", init="paper")
    sites = len(pde_modules(patched))
    prompt = torch.randint(0, 32000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(5)).to(device)
    rows = []
    for name in args.variants.split(","):
        with decode_step_variant("auto" if name == "package" else name):
            loop = paired_decode(patched, unpatched, prompt, args.tokens, args.pairs, device, mask=True)
            calls = generate_rounds(patched, unpatched, prompt, args.tokens, args.rounds, device)
        row = dict(variant=name, loop=summary(loop, sites), generate=summary(calls, sites))
        rows.append(row)
        print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    info = dict(device=gpu, torch=torch.__version__, transformers=transformers.__version__, batch=args.batch,
                model=dict(layers=args.layers, hidden=args.hidden, dtype=str(dtype).replace("torch.", "")),
                sites=sites, rows=rows, command="python benchmarks/decode_step_pairs.py " + " ".join(sys.argv[1:]))
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


if __name__ == "__main__":
    main()
