"""Where the time of one cached decode step goes, patched vs unpatched (torch.profiler, CPU-side op totals).

    python benchmarks/profile_decode.py [--layers 8] [--hidden 1024] [--tokens 32] [--device cuda]
"""

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cta


def decode(model, ids, tokens):
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        mask = torch.ones(ids.shape[0], ids.shape[1] + tokens + 1, dtype=torch.long, device=ids.device)
        for i in range(tokens):
            out = model(token, past_key_values=cache, use_cache=True, attention_mask=mask[:, : ids.shape[1] + i + 1])
            token = out.logits[:, -1:].argmax(-1)
    return token


def per_token_ms(model, ids, tokens, device):
    decode(model, ids, 4)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    decode(model, ids, tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / tokens * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                         num_key_value_heads=args.hidden // 128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()
    ids = torch.randint(0, 32000, (1, 128), device=args.device)
    plain = per_token_ms(model, ids, args.tokens, args.device)
    cta.patch_model(model, pde_type="diffusion", pde_steps=args.steps, placement="block_output", init="paper")
    patched = per_token_ms(model, ids, args.tokens, args.device)
    print(f"ms/token: unpatched {plain:.3f}  patched {patched:.3f}  (+{patched - plain:.3f} ms, "
          f"{(patched - plain) / args.layers * 1e3:.0f} us per PDE site)")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decode(model, ids, 8)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
