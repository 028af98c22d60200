"""CPU decode cost of CTA patching: the table ``cpu_decode.md`` of docs/decoding.md (target: a decoded token costs
<= 10% more than unpatched on CPU, torch backend).

    python benchmarks/bench_cpu_decode.py        # ~3 min; a tiny run: --layers 2 --hidden 64 --pairs 8

A random-weight Llama of SmolLM2-135M's size (30 x 576, MLP 1536, vocabulary 49152; fp32, sdpa, one thread) patched
with a PDE site after every block (``init="paper"``, backend ``torch``) decodes greedily beside an unpatched copy with
the same weights, token by token in pairs (``results_io.paired_decode``, with the all-ones mask ``generate()``
passes). Overhead: the median over pairs of patched / unpatched - 1 [bootstrap 95%]; host µs per site: the median
per-token difference over the sites. (The structure's cost and the torch ops' floor, from substituted steps, are
findings in docs/decoding.md: the script of commit b7e044a measured them.) Writes ``cpu_decode.json`` / ``.md`` into ``--out``.
"""

import argparse
import platform
import statistics
import sys

from results_io import RESULTS, bootstrap_median, llama_model, paired_decode, write_result_files

import torch  # noqa: E402  (after results_io: it puts the repository on the path)
import transformers  # noqa: E402

from cta.patching_cta import patch_model, pde_modules  # noqa: E402



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--steps", type=int, default=4, help="PDE steps per site")
    p.add_argument("--pde-types", default="diffusion,reaction_diffusion", help="comma-separated PDE types")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens before decoding")
    p.add_argument("--tokens", type=int, default=200, help="tokens per decoding pass")
    p.add_argument("--pairs", type=int, default=300, help="timed token pairs per row")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=RESULTS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for pde_type in args.pde_types.split(","):
        unpatched, patched = (llama_model(args.layers, args.hidden, args.vocab, "cpu", torch.float32,
                                          intermediate=args.intermediate, max_positions=4096) for _ in range(2))
        patch_model(patched, pde_type=pde_type, pde_steps=args.steps, placement="block_output", init="paper",
                    backend="torch")
        sites = len(pde_modules(patched))
        prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(3))
        pairs = paired_decode(patched, unpatched, prompt, args.tokens, args.pairs, mask=True)
        ratios = [p / u for u, p in pairs]
        low, high = bootstrap_median(ratios)
        rows.append(dict(pde_type=pde_type, sites=sites, pairs=len(pairs),
                         unpatched_step_us=1e6 * statistics.median(u for u, _ in pairs),
                         patched_step_us=1e6 * statistics.median(p for _, p in pairs),
                         overhead_percent=100 * (statistics.median(ratios) - 1),
                         overhead_ci95_percent=[100 * (low - 1), 100 * (high - 1)],
                         host_us_per_site=1e6 * statistics.median(p - u for u, p in pairs) / sites, target_percent=10.0))
        print(rows[-1], flush=True)
    info = dict(cpu=platform.processor() or platform.machine(), threads=args.threads, torch=torch.__version__,
                transformers=transformers.__version__,
                model=dict(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, dtype="float32"),
                patch=dict(placement="block_output", pde_steps=args.steps, init="paper", backend="torch"),
                rows=rows, command="python benchmarks/bench_cpu_decode.py " + " ".join(sys.argv[1:]))
    lines = [f"# CPU decode: patched Llama vs an unpatched copy ({info['cpu']}, {args.threads} thread)", "",
             f"{args.layers} layers x {args.hidden} hidden, fp32, sdpa; PDE after every block, {args.steps} steps, "
             f"`init=\"paper\"`, backend `torch`. Per-token pairs (each token decoded by both models back to back); "
             f"overhead: median of patched / unpatched - 1 [bootstrap 95%]. torch {info['torch']}, transformers "
             f"{info['transformers']}.", "",
             "| PDE type | unpatched µs/token | patched µs/token | overhead | host µs per site | target |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        low, high = row["overhead_ci95_percent"]
        lines.append(f"| {row['pde_type']} | {row['unpatched_step_us']:.0f} | "
                     f"{row['patched_step_us']:.0f} | {row['overhead_percent']:+.1f}% [{low:+.1f}, {high:+.1f}] | "
                     f"{row['host_us_per_site']:.1f} | <= {row['target_percent']:.0f}% |")
    write_result_files(f"{args.out}/cpu_decode", info, lines)


if __name__ == "__main__":
    main()
