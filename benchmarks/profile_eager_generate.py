"""Where eager ``generate()`` spends a patched model's extra host time: cProfile of one call per model, and the
per-function difference against the unpatched model.

    python benchmarks/profile_eager_generate.py [--layers 8] [--hidden 4096] [--tokens 128] [--out benchmarks/results]

The Llama-shaped model of ``bench_patched_model.py --generate`` (random weights, bf16 on CUDA / fp32 on CPU, sdpa),
unpatched; patched with diffusion, 4 steps after every block (``init="paper"``, the default backend: Triton on
CUDA); and patched with the one-token PDE step replaced by the identity (``bench_patched_model.decode_step_variant``:
what remains is the structure: hooks, lookups, module calls, and whatever generate() does differently for a patched
model). Each model generates once untimed, once timed, then once under cProfile. Writes
``eager_generate_profile_<device>.txt``: the call times, then for each patched variant the functions whose own time
and whose cumulative time grew most over the unpatched call (same function, same call site), with the change in
calls. Under the profiler every Python call costs more: read the ranking and the ratios, not absolute times.
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_patched_model import decode_step_variant, llama_model  # noqa: E402

from cta.patching_cta import patch_model  # noqa: E402


def profiled_generate(model, prompt, kwargs, device, label, report):
    """Generates untimed, timed, then under cProfile; returns the profile's raw stats."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        model.generate(prompt, **kwargs)
        sync()
        start = time.perf_counter()
        model.generate(prompt, **kwargs)
        sync()
        seconds = time.perf_counter() - start
        profile = cProfile.Profile()
        profile.enable()
        model.generate(prompt, **kwargs)
        sync()
        profile.disable()
    line = f"{label}: generate() {seconds:.3f} s for {kwargs['max_new_tokens']} tokens"
    print(line, flush=True)
    report.write(line + "\n")
    return pstats.Stats(profile).stats


def short_name(key):
    path, line, name = key
    return f"{path.split('site-packages/')[-1].split('/work/main/')[-1]}:{line}({name})"


def write_difference(report, label, stats, base, top):
    """The functions whose own / cumulative time grew most from ``base`` to ``stats``."""
    rows = []
    for key, (_, calls, own, cumulative, _) in stats.items():
        _, base_calls, base_own, base_cumulative, _ = base.get(key, (0, 0, 0.0, 0.0, {}))
        rows.append((own - base_own, cumulative - base_cumulative, calls - base_calls, key))
    for title, index in (("own time", 0), ("cumulative time", 1)):
        report.write(f"\n## {label} - unpatched: largest growth in {title} (ms; calls)\n")
        for row in sorted(rows, key=lambda r: r[index], reverse=True)[:top]:
            report.write(f"{1e3 * row[index]:+9.2f} ms  {row[2]:+7d} calls  {short_name(row[3])}\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generate() call")
    p.add_argument("--top", type=int, default=25, help="functions listed per ranking")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = io.StringIO()
    report.write(f"# {' '.join(['python benchmarks/profile_eager_generate.py', *sys.argv[1:]])}\n")
    stats = {}
    for variant in ("unpatched", "patched", "patched, identity step"):
        model = llama_model(args.layers, args.hidden, 11008 * args.hidden // 4096, 32000, device, dtype)
        model.config._attn_implementation = "sdpa"  # noqa: SLF001 - transformers' documented config field
        if variant != "unpatched":
            patch_model(model, pde_type="diffusion", pde_steps=4, placement="block_output", init="paper")
        model.eval()
        prompt = torch.randint(0, 32000, (1, 512), generator=torch.Generator().manual_seed(0)).to(device)
        kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                      do_sample=False, pad_token_id=0)
        with decode_step_variant("identity" if "identity" in variant else "auto"):
            stats[variant] = profiled_generate(model, prompt, kwargs, device, variant, report)
        del model
    for variant in ("patched", "patched, identity step"):
        write_difference(report, variant, stats[variant], stats["unpatched"], args.top)
    name = torch.cuda.get_device_name(0).replace(" ", "_") if device.type == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"eager_generate_profile_{name}.txt")
    with open(path, "w") as f:
        f.write(report.getvalue())
    print(report.getvalue())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
