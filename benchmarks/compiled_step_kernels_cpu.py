"""Kernels of one compiled decode step on the CPU (Inductor's C++ backend), unpatched vs patched: whether the PDE
sites fuse into the kernels around them or add kernels of their own. The GPU counterpart, with GPU times, is
``bench_patched_model.py --compiled-step-kernels``; this one needs no GPU and shows the fusion structure.

    python benchmarks/compiled_step_kernels_cpu.py [--layers 2] [--pde-type diffusion] [--out FILE]

A tiny Llama (hidden 64), ``torch.compile(model.forward, fullgraph=True)`` through a ``StaticCache``; each variant
runs in its own process with ``TORCH_LOGS=output_code`` and the kernels its compiled step calls are counted from
Inductor's generated code. Writes ``benchmarks/results/compiled_step_kernels_cpu.txt`` by default.
"""

import argparse
import collections
import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL = re.compile(r"\[__output_code\]\s+(cpp_fused_\w+?)(?:_\d+)?\(")


def child(args):
    """The compiled decode steps of one variant (run with TORCH_LOGS=output_code)."""
    sys.path.insert(0, ROOT)
    import transformers
    from transformers import StaticCache

    from cta.patching_cta import patch_model
    from cta.pde_cache import CACHE_ARGUMENT

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    if args.child == "patched":
        patch_model(model, pde_type=args.pde_type, pde_steps=4, placement="block_output", init="paper")
    prompt = torch.randint(0, 128, (1, 8))
    step = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=24)
        kwargs = {CACHE_ARGUMENT: cache}
        token = model(input_ids=prompt, use_cache=True, **kwargs).logits[:, -1:].argmax(-1)
        position = torch.tensor([8])  # one step: one compiled graph, whose calls are counted
        step(input_ids=token, use_cache=True, cache_position=position, position_ids=position[None],
             attention_mask=torch.ones(1, 9, dtype=torch.long), **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--pde-type", default="diffusion")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compiled_step_kernels_cpu.txt"))
    parser.add_argument("--child", choices=("unpatched", "patched"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    lines = [f"# Kernels of one compiled CPU decode step (tiny Llama, {args.layers} layers x 64, batch 1, "
             f"StaticCache, torch.compile(fullgraph=True); PDE: {args.pde_type}, 4 steps, after every block). "
             f"torch {torch.__version__}. Command: python benchmarks/compiled_step_kernels_cpu.py "
             f"{' '.join(sys.argv[1:])}", ""]
    for variant in ("unpatched", "patched"):
        env = dict(os.environ, TORCH_LOGS="output_code")
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant, "--layers",
                              str(args.layers), "--pde-type", args.pde_type], env=env, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{variant} failed:\n{run.stderr[-3000:]}")
        kernels = collections.Counter(CALL.findall(run.stderr + run.stdout))
        lines.append(f"## {variant}: {sum(kernels.values())} kernel calls per step")
        lines += [f"{count:3d}  {name}" for name, count in sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0]))]
        lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
