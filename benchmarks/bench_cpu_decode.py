"""CPU decode cost of CTA patching (SPEC §6: a decoded token costs <= 10% more than unpatched on CPU, torch backend).

A random-weight Llama of SmolLM2-135M's size (the spec's model: 30 layers x 576 hidden, MLP 1536, vocabulary 49152;
hidden // 128 heads as the model-level benchmarks build them; fp32, sdpa, one thread) decodes greedily, patched with a
PDE site after every block (``init="paper"``, 4 steps, backend ``torch``) beside an unpatched copy with the same
weights; every token is decoded by one model and then the other, back to back, each step timed by itself
(``bench_patched_model.paired_decode``, an all-ones attention mask with each step as ``generate()`` passes). The
overhead is the median over token pairs of patched / unpatched - 1 (a bootstrap 95% interval beside it); the host
time per site is the median per-token difference divided by the number of PDE sites.

    python benchmarks/bench_cpu_decode.py                          # diffusion and reaction-diffusion (~3 min)
    python benchmarks/bench_cpu_decode.py --layers 8 --hidden 64 --intermediate 172 --vocab 512  # a tiny Llama:
                                                                   # the site against the least layer time
    python benchmarks/bench_cpu_decode.py --pde-types wave --pairs 1000
    python benchmarks/bench_cpu_decode.py --bounds                 # + the structure's cost and the ops' floor

Writes ``benchmarks/results/cpu_decode.json`` / ``.md``.
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from bench_patched_model import llama_model  # noqa: E402
from results_io import bootstrap_median, paired_decode  # noqa: E402

from cta.patching_cta import patch_model, pde_modules  # noqa: E402
from cta.pde_cta import PDERefinement  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
STEP_LABEL = {"real": "the package's", "identity": "identity (structure only)",
              "floor": "floor: cat + mm + state write"}


@contextlib.contextmanager
def substitute_decode_step(mode: str):
    """Within the block, a PDE site's one-token step is replaced (prefill stays real: it stores the state the
    continuation check asks for): ``identity`` returns the token (what remains is the structure: hooks, lookups,
    module calls); ``floor`` runs the fewest eager torch ops a linear scheme's update with scalar coefficients needs
    (one concatenation, one matrix product, the writes of the state's per-step buffers; the decode map formed once and
    never re-checked; batch 1), a lower bound of any eager torch implementation of the step."""
    from cta.pde_cache import cached_pde_levels
    from cta.pde_decode import causal_decode_map

    real = PDERefinement.forward
    maps = {}

    def substitute(self, h, attention_mask=None, cache=None, *args, **kwargs):
        if h.shape[1] != 1:
            return real(self, h, attention_mask, cache, *args, **kwargs)
        if mode == "identity":
            return h
        stored = cached_pde_levels(cache, self.layer_idx, self.state_idx, self.steps)  # [1, 1, channels, 1] each
        if self not in maps:
            alpha, beta = self.coefficients()
            maps[self] = causal_decode_map(self.pde_type, self.steps, alpha.detach(), beta, stored[0].dtype)[..., 0]
        levels = torch.mm(maps[self], torch.cat([h[0], *(level[0, :, :, 0] for level in stored)]))
        for buffer, level in zip(stored, levels):
            buffer[0, 0, :, 0].copy_(level)
        return levels[-1:].unsqueeze(0)

    PDERefinement.forward = substitute
    try:
        yield
    finally:
        PDERefinement.forward = real


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--steps", type=int, default=4, help="PDE steps per site")
    p.add_argument("--pde-types", default="diffusion,reaction_diffusion", help="comma-separated PDE types")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens before decoding")
    p.add_argument("--tokens", type=int, default=200, help="tokens per decoding pass")
    p.add_argument("--pairs", type=int, default=300, help="timed token pairs per PDE type")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bounds", action="store_true",
                   help="also time diffusion with the one-token step replaced by the identity (the structure's "
                        "cost alone) and by the fewest torch ops of a linear update (the floor of any eager torch "
                        "step; substitute_decode_step)")
    p.add_argument("--out", default=RESULTS)
    return p.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    rows = []
    cases = [(t, None) for t in args.pde_types.split(",")]
    if args.bounds:
        cases += [("diffusion", "identity"), ("diffusion", "floor")]
    for pde_type, substitute in cases:
        build = lambda: llama_model(args.layers, args.hidden, args.intermediate, args.vocab, device,  # noqa: E731
                                    torch.float32, max_positions=4096)
        unpatched, patched = build(), build()
        for model in (unpatched, patched):
            model.config._attn_implementation = "sdpa"
        patch_model(patched, pde_type=pde_type, pde_steps=args.steps, placement="block_output", init="paper",
                    backend="torch")
        sites = len(pde_modules(patched))
        prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(3))
        with substitute_decode_step(substitute) if substitute else contextlib.nullcontext():
            pairs = paired_decode(patched, unpatched, prompt, args.tokens, args.pairs, device, mask=True)
        ratios = [p / u for u, p in pairs]
        low, high = bootstrap_median(ratios)
        unpatched_s = statistics.median(u for u, _ in pairs)
        row = dict(pde_type=pde_type, step=substitute or "real", sites=sites, pairs=len(pairs), unpatched_step_us=1e6 * unpatched_s,
                   patched_step_us=1e6 * statistics.median(p for _, p in pairs),
                   overhead_percent=100 * (statistics.median(ratios) - 1),
                   overhead_ci95_percent=[100 * (low - 1), 100 * (high - 1)],
                   host_us_per_site=1e6 * statistics.median(p - u for u, p in pairs) / sites, target_percent=10.0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    info = dict(cpu=platform.processor() or platform.machine(), threads=args.threads, torch=torch.__version__,
                transformers=transformers.__version__, model=dict(layers=args.layers, hidden=args.hidden,
                                                                  intermediate=args.intermediate, dtype="float32"),
                patch=dict(placement="block_output", pde_steps=args.steps, init="paper", backend="torch"),
                rows=rows, command="python benchmarks/bench_cpu_decode.py " + " ".join(sys.argv[1:]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_decode.json"), "w") as f:
        json.dump(info, f, indent=1)
    lines = [f"# CPU decode: patched Llama vs an unpatched copy ({info['cpu']}, {args.threads} thread)", "",
             f"{args.layers} layers x {args.hidden} hidden, fp32, sdpa; PDE after every block, {args.steps} steps, "
             f"`init=\"paper\"`, backend `torch`. Per-token pairs (each token decoded by both models back to back); "
             f"overhead: median of patched / unpatched - 1 [bootstrap 95%]. torch {info['torch']}, transformers "
             f"{info['transformers']}.", "",
             "| PDE type | one-token step | unpatched µs/token | patched µs/token | overhead | host µs per site | target |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        low, high = row["overhead_ci95_percent"]
        lines.append(f"| {row['pde_type']} | {STEP_LABEL[row['step']]} | {row['unpatched_step_us']:.0f} | {row['patched_step_us']:.0f} | "
                     f"{row['overhead_percent']:+.1f}% [{low:+.1f}, {high:+.1f}] | {row['host_us_per_site']:.1f} | "
                     f"<= {row['target_percent']:.0f}% |")
    lines += ["", f"Reproduce: `{info['command']}`", ""]
    with open(os.path.join(args.out, "cpu_decode.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
