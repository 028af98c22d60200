"""Where eager ``generate()`` spends a patched model's extra host time: cProfile of one call, unpatched and patched.

    python benchmarks/profile_eager_generate.py [--layers 8] [--hidden 4096] [--tokens 128] [--out benchmarks/results]

The Llama-shaped model of ``bench_patched_model.py --generate`` (random weights, bf16, sdpa), patched with diffusion,
4 steps after every block (``init="paper"``, the default backend: Triton on CUDA). Each model generates once untimed,
once timed, then once under cProfile; writes ``eager_generate_profile_<gpu>.txt`` (the patched call: top functions by
own time, then this package's and Triton's functions by cumulative time) and prints both call times. Under the
profiler every Python call costs more, so read ratios between functions, not absolute times.
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

from bench_patched_model import llama_model  # noqa: E402

from cta.patching_cta import patch_model  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generate() call")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = io.StringIO()
    for patched in (False, True):
        model = llama_model(args.layers, args.hidden, 11008 * args.hidden // 4096, 32000, device, torch.bfloat16)
        model.config._attn_implementation = "sdpa"  # noqa: SLF001 - transformers' documented config field
        if patched:
            patch_model(model, pde_type="diffusion", pde_steps=4, placement="block_output", init="paper")
        model.eval()
        prompt = torch.randint(0, 32000, (1, 512), device=device, generator=None)
        kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                      do_sample=False, pad_token_id=0)
        label = "patched" if patched else "unpatched"
        with torch.no_grad():
            model.generate(prompt, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(prompt, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"{label}: generate() {time.perf_counter() - start:.3f} s for {args.tokens} tokens", flush=True)
            profile = cProfile.Profile()
            profile.enable()
            model.generate(prompt, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            profile.disable()
        if patched:
            stats = pstats.Stats(profile, stream=report)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumtime").print_stats("cta/|triton|hooks", 30)
        del model
    name = torch.cuda.get_device_name(0).replace(" ", "_") if device.type == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"eager_generate_profile_{name}.txt")
    with open(path, "w") as f:
        f.write(report.getvalue())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
