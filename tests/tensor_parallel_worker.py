"""A saved patched Llama loads with ``tp_plan="auto"`` and decodes the same greedy tokens as one device (issue 34, 4).

transformers' tensor-parallel plan (``base_model_tp_plan``: ``layers.*.self_attn.q_proj`` colwise, ...) applies by
weight name, so it only shards a patched model whose names are the base model's. The PDE coefficients (1-element
``cta_*_pde.alpha``/``beta``) are in no plan: they stay plain, replicated tensors, and the ``block_output`` PDE runs
on the layer's full hidden state (after the row-parallel projections' all-reduce).

Run by tests/test_benchmarks.py on 2 GPUs (CPU works too, with gloo), and by hand for the committed record::

    torchrun --nproc_per_node 2 tests/tensor_parallel_worker.py --out results/tensor_parallel_2gpu.json

Rank 0 builds a Llama-shaped model from a config (random weights, fixed seed), patches it (diffusion, 4 steps,
``block_output``, ``init="paper"``), saves it and decodes greedily on one device as the reference; then every rank
loads the folder with ``cta.load_patched(dir, tp_plan="auto")`` and with ``AutoModelForCausalLM.from_pretrained(dir,
tp_plan="auto")`` (after ``import cta``) and decodes the same prompts. Rank 0 writes the JSON (tokens equal, max
logit difference, what was sharded) and the exit status is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cta  # noqa: E402  (registers the patched classes with the Auto classes)
from cta.patching_cta import pde_modules  # noqa: E402

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # older torch
    DTensor = ()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON written by rank 0")
    parser.add_argument("--dir", default=None, help="folder for the saved patched model (default: a temporary one)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--placement", default="block_output",
                        help="comma-separated placements (the issue's check: block_output; `value` runs on each "
                             "rank's shard of the column-parallel v_proj: right for scalar coefficients only)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--atol", type=float, default=None, help="logit tolerance (default: 1e-3 fp32, 5e-2 bf16)")
    return parser.parse_args()


def build_and_save(args, folder):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=512, pad_token_id=0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    cta.patch_model(model, pde_type="diffusion", pde_steps=4, placement=args.placement.split(","), init="paper")
    model.save_pretrained(folder)


def prompts(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # row 1 left-padded: the PDE's padding walls are exercised
    return ids, mask


def decode(model, ids, mask, new_tokens, device):
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        full_mask = torch.cat([mask, torch.ones_like(tokens[:, ids.shape[1]:])], dim=1)
        logits = model(input_ids=tokens, attention_mask=full_mask).logits.float()
    return tokens.cpu(), logits.cpu()


def describe(model):
    """What tensor parallelism did to the model: sharded base weights, and the PDE coefficients' kind."""
    params = dict(model.named_parameters())
    sharded = sorted(n for n, p in params.items() if isinstance(p, DTensor))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    q = params.get(q_name)
    q_local = tuple((q.to_local() if isinstance(q, DTensor) else q).shape) if q is not None else None
    pdes = {name: {"type": type(m.alpha).__name__, "shape": list(m.alpha.shape), "dtensor": isinstance(m.alpha, DTensor)}
            for name, m in pde_modules(model)}
    return {
        "class": type(model).__name__,
        "patched": cta.patching_cta.is_patched(model),
        "base_names_kept": q is not None and not any(".wrapped." in n for n in params),
        "q_proj_local_shape": q_local,
        "sharded_parameters": len(sharded),
        "sharded_examples": sharded[:6],
        "pde_coefficients": pdes,
        "tp_plan": {k: str(v) for k, v in (getattr(model, "tp_plan", None) or {}).items()},
    }


def main():
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    atol = args.atol if args.atol is not None else (1e-3 if dtype == torch.float32 else 5e-2)

    folder = args.dir
    if folder is None:
        folder = [tempfile.mkdtemp(prefix="cta_tp_") if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(folder, src=0)
        folder = folder[0]
    ids, mask = prompts(args.vocab)
    result = {"world_size": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "dtype": args.dtype,
              "model": dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                            vocab=args.vocab),
              "patch": dict(pde_type="diffusion", pde_steps=4, placement=args.placement.split(","), init="paper"),
              "new_tokens": args.new_tokens, "atol": atol}
    if rank == 0:
        build_and_save(args, folder)
        reference = cta.load_patched(folder, dtype=dtype).to(device).eval()
        ref_tokens, ref_logits = decode(reference, ids, mask, args.new_tokens, device)
        result["single_device"] = describe(reference)
        del reference
    if world > 1:
        dist.barrier()

    checks = {}
    loaders = {"cta.load_patched": lambda: cta.load_patched(folder, tp_plan="auto", dtype=dtype),
               "AutoModelForCausalLM": lambda: AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto",
                                                                                    dtype=dtype)}
    if hasattr(transformers, "DistributedConfig"):  # the newer spelling of `tp_plan=` (transformers >= 5.2x)
        loaders["AutoModelForCausalLM(distributed_config)"] = lambda: AutoModelForCausalLM.from_pretrained(
            folder, distributed_config=transformers.DistributedConfig(tp_plan="auto"), dtype=dtype)
    for name, load in loaders.items():
        model = load().eval()
        tokens, logits = decode(model, ids, mask, args.new_tokens, model.device)
        if rank == 0:
            valid = torch.cat([mask, torch.ones_like(tokens[:, ids.shape[1]:])], dim=1).bool()
            same_tokens = torch.equal(tokens, ref_tokens)
            diff = (logits - ref_logits)[valid].abs().max().item() if logits.shape == ref_logits.shape else None
            info = describe(model)
            checks[name] = dict(info, same_greedy_tokens=same_tokens, max_abs_logit_diff=diff,
                                tokens=[" ".join(map(str, row)) for row in tokens.tolist()],
                                passed=bool(same_tokens and diff is not None and diff <= atol and info["patched"]
                                            and info["base_names_kept"] and (world == 1 or info["sharded_parameters"] > 0)))
        del model
    if rank == 0:
        result["reference_tokens"] = [" ".join(map(str, row)) for row in ref_tokens.tolist()]
        result["tensor_parallel"] = checks
        result["passed"] = all(c["passed"] for c in checks.values())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=1)
        Path(args.out).write_text(text + "\n")
        print(json.dumps({k: (v["same_greedy_tokens"], v["max_abs_logit_diff"], v["q_proj_local_shape"],
                              v["sharded_parameters"]) for k, v in checks.items()}), "passed:", result["passed"])
    failed = [not result.get("passed", True)]
    if world > 1:
        dist.broadcast_object_list(failed, src=0)
        dist.destroy_process_group()
    sys.exit(1 if failed[0] else 0)


if __name__ == "__main__":
    main()
