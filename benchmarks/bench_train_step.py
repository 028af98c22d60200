"""What the PDE sites cost a training step on one GPU: host time per site (forward + backward) and the step of a
Llama-shaped model, patched and native, against transformers' Llama (the README's training line reads the result).

    python benchmarks/bench_train_step.py                      # eager: host per site + 12 x 1024 step
    python benchmarks/bench_train_step.py --compile            # the step under torch.compile

Host time per site: a tiny model (``--site_hidden``, 4 layers, batch 1 x 64 tokens) whose GPU work is negligible,
timed by a CPU clock around ``--calls`` forward + backward calls and one synchronisation; per site = (the model with
its PDE sites - the same model without) / sites. The step: forward + backward + ``zero_grad`` of each model on
``--batch`` x ``--seq`` tokens, bf16 weights, the models in turn in each of ``--rounds`` rounds (paired: the
overhead is the median of the per-round ratios), and peak memory. GPU kernel time of the PDE: ``torch.profiler``
over 3 steps.

``torchrun --nproc_per_node N bench_train_step.py --context_parallel [--probe]``: torch's ``context_parallel`` (ring
sdpa, head-tail) shards one ``--seq``-token sequence over N GPUs, the patched sites told by ``cta.shard_sequences``;
a 0.95B Llama shape (16 x 2048, no GQA: torch 2.11's ring sdpa rejects it), both models resident; torch CP alone (no
FSDP2, no gradient synchronisation: the same for both), rank 0's times and peak. ``--probe``: first the longest
8192 x 2^k tokens one GPU trains (patched, unsharded), then N times that length, sharded, timed.
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys

import torch

from results_io import clocked, sync

import cta  # noqa: E402  (after results_io: it puts the repository on the path)
from cta import CTAConfig, CTAForCausalLM  # noqa: E402

PDE = dict(pde_type="diffusion", steps=4, placement="block_output")


def build_models(hidden, layers, vocab, device, dtype, compile_models=False, with_native=True):
    """{name: model}: transformers' Llama, that Llama patched, and (``with_native``) native models of 0 and 4 steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 64)
    intermediate = 256 * ((int(hidden * 2.75) + 255) // 256)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                         max_position_embeddings=8192, attn_implementation="sdpa"))
    patched = cta.patch_model(copy.deepcopy(llama), pde_type=PDE["pde_type"], pde_steps=PDE["steps"],
                              placement=PDE["placement"], init="paper")
    native = {}
    for steps in (0, PDE["steps"]) if with_native else ():
        config = CTAConfig.modern_decoder(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          max_position_embeddings=8192, pde_type=PDE["pde_type"], pde_steps=steps,
                                          pde_placement=PDE["placement"], attn_implementation="sdpa")
        native[steps] = CTAForCausalLM(config)
    models = {"llama": llama, "patched": patched, **{f"native_{steps}": model for steps, model in native.items()}}
    for name, model in models.items():
        model.to(device=device, dtype=dtype).train()
        if compile_models:
            model.forward = torch.compile(model.forward)
    return models


def train_step(model, batch):
    batch(model) if callable(batch) else model(**batch).loss.backward()  # (callable: the context-parallel step)
    model.zero_grad(set_to_none=True)


def time_steps(model, batch, steps):
    """Seconds per step of ``steps`` back-to-back steps (synchronised before and after)."""
    return clocked(lambda: [train_step(model, batch) for _ in range(steps)]) / steps


def paired_rounds(models, batch, rounds, steps, warmup=3):
    """({name: [seconds per step, one per round]}, {name: peak GiB of a step}), the models taking turns in a round."""
    memory = {}
    for name, model in models.items():  # warm-up: kernels compiled, caches filled
        torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
        for _ in range(warmup):
            train_step(model, batch)
        memory[name] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            times[name].append(time_steps(model, batch, steps))
    return times, memory


def overhead(times, name, reference):
    """Median and quartiles of the per-round ratio ``name / reference`` - 1, in percent."""
    ratios = sorted(100 * (a / b - 1) for a, b in zip(times[name], times[reference]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median_pct": statistics.median(ratios), "q1_pct": quartiles[0], "q3_pct": quartiles[-1]}


def pde_kernel_ms(model, batch):
    """GPU time per step of the PDE kernels (names containing ``_cta_``), from torch.profiler over 3 steps."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            train_step(model, batch)
        sync()
    return sum(e.self_device_time_total for e in prof.key_averages() if "_cta_" in e.key) / 3 / 1000


def host_per_site(device, dtype, hidden, calls, rounds):
    """Host microseconds per PDE site and forward + backward (see the module notes): the tiny models' difference, and
    the site alone (``site_chain``)."""
    models = build_models(hidden, 4, 512, device, dtype)
    batch = {"input_ids": torch.randint(0, 512, (1, 64), device=device)}
    batch["labels"] = batch["input_ids"]
    times = paired_rounds(models, batch, rounds, calls)[0]
    result = {}
    for name, plain in (("patched", "llama"), (f"native_{PDE['steps']}", "native_0")):
        per_round = [(a - b) / 4 * 1e6 for a, b in zip(times[name], times[plain])]  # (4 sites)
        result[name] = {"host_us_per_site": statistics.median(per_round),
                        "step_us": 1e6 * statistics.median(times[name]),
                        "step_us_without_pde": 1e6 * statistics.median(times[plain])}
    result["site_chain"] = site_chain(device, dtype, hidden, calls, rounds)
    return result


def _minimal_triton_op(device):
    """An autograd.Function that launches one trivial Triton kernel each way: the host time of any Triton op called
    from eager PyTorch, the floor a PDE site stands on (None where Triton cannot run)."""
    if device.type != "cuda":
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(source, target, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(target + offsets, tl.load(source + offsets, mask=offsets < n), mask=offsets < n)

    class MinimalTritonOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = torch.empty_like(x)
            copy_kernel[(1,)](x, y, 16, BLOCK=16)
            return y

        @staticmethod
        def backward(ctx, grad):
            dx = torch.empty_like(grad)
            copy_kernel[(1,)](grad, dx, 16, BLOCK=16)
            return dx

    return MinimalTritonOp.apply


def site_chain(device, dtype, hidden, calls, rounds, sites=8):
    """Host microseconds per forward + backward of ``PDERefinement`` alone (each of ``sites`` modules, chained in one
    graph on a 1 x 64 input: the backward's start is shared), over a ``mul`` in its place; and the same for the
    minimal Triton op (the floor)."""
    torch.manual_seed(0)
    chain_of = {"pde_site": [cta.PDERefinement(hidden, PDE["pde_type"], PDE["steps"], causal=True, alpha=0.1)
                             .to(device, dtype) for _ in range(sites)],
                "minimal_triton_op": [_minimal_triton_op(device)] * sites, "torch_mul": [lambda y: y.mul(1.0)] * sites}
    chain_of = {name: ops for name, ops in chain_of.items() if ops[0] is not None}
    x = torch.randn(1, 64, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def run(ops):
        y = x
        for op in ops:
            y = op(y)
        y.backward(grad)
        x.grad = None
        for op in chain_of["pde_site"]:
            op.alpha.grad = None

    for ops in chain_of.values():  # (warm-up: kernels compiled)
        [run(ops) for _ in range(3)]
    times = {name: [] for name in chain_of}
    for _ in range(rounds):
        for name, ops in chain_of.items():
            times[name].append(clocked(lambda: [run(ops) for _ in range(calls)]) / calls)
    per_site = {name: statistics.median((a - b) / sites * 1e6 for a, b in zip(times[name], times["torch_mul"]))
                for name in chain_of if name != "torch_mul"}
    return {"sites": sites, "over_torch_mul_us": per_site,
            "torch_mul_us": 1e6 * statistics.median(times["torch_mul"]) / sites}


def context_parallel(args, record, device, dtype):
    """The context-parallel mode's models and step (see the module notes); the probe's lengths go to ``record``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as sharded

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # NCCL allocates its buffers outside torch's caching allocator: set them up before the probe fills that cache
    dist.all_reduce(torch.zeros(1, device=device), group=mesh.get_group())
    models = build_models(args.hidden, args.layers, args.vocab, device, dtype, with_native=False)
    for layer in (layer for model in models.values() for layer in model.model.layers):  # accelerate's CP pre-hook
        layer.self_attn.register_forward_pre_hook(  # (ring attention takes no mask: causal)
            lambda module, a, kw: (a, {**kw, "attention_mask": None, "is_causal": True}), with_kwargs=True)

    def batch(length, shard=True):
        def step(model):
            ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
            labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
            buffers = [ids, torch.arange(length, device=device)[None], labels]
            cta.shard_sequences(models["patched"], cta.SequenceSharding("torch", mesh.get_group()) if shard else None)
            with sharded(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)) if shard \
                    else contextlib.nullcontext():
                model(input_ids=ids, position_ids=buffers[1], labels=labels, shift_labels=labels).loss.backward()
        return step

    def fits(length, shard):  # (out of memory on every rank alike: the same shapes, the same allocations)
        try:
            return train_step(models["patched"], batch(length, shard)) or True
        except torch.OutOfMemoryError:
            return models["patched"].zero_grad(set_to_none=True) or torch.cuda.empty_cache() or False

    one = length = args.seq
    if args.probe:  # (unsharded only: an allocation failing inside a ring collective is no OutOfMemoryError)
        one = next(8192 << k for k in range(10) if not fits(16384 << k, False))  # (doubling: a few tries)
        length = one * dist.get_world_size()
        torch.cuda.empty_cache()  # (the probe's cached blocks back to the device, for the collectives' buffers)
        print(f"probe: one GPU trains {one} tokens unsharded; timing {length} over {dist.get_world_size()}", flush=True)
    args.batch, args.seq = 1, length
    record.update(world_size=dist.get_world_size(), seq=length, local_seq=length // dist.get_world_size(),
                  probe={"one_gpu_max_seq": one, "context_parallel_seq": length} if args.probe else None)
    return models, batch(length)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder for train_step_<gpu>[_compiled].json")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds (the models take turns in each)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
    parser.add_argument("--compile", action="store_true", help="each model's forward under torch.compile")
    parser.add_argument("--site_hidden", type=int, default=256, help="width of the host-time model")
    parser.add_argument("--site_calls", type=int, default=50, help="timed forward + backward calls per round")
    parser.add_argument("--skip_site", action="store_true", help="only the training step")
    parser.add_argument("--context_parallel", action="store_true", help="the context-parallel mode (torchrun)")
    parser.add_argument("--probe", action="store_true", help="context parallel: the longest lengths, then time")
    args = parser.parse_args()
    if args.context_parallel:  # its shape and rounds, unless given
        parser.set_defaults(layers=16, hidden=2048, seq=65536, rounds=3, steps=1, warmup=1, skip_site=True)
        args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")
    torch.cuda.set_device(device) if device.type == "cuda" else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    record = {"command": "python " + " ".join(sys.argv), "device": name, "torch": torch.__version__,
              "dtype": str(dtype), "pde": PDE, "compile": args.compile}
    stem = os.path.join(args.out, "train_step_" + name.replace(" ", "_") + ("_compiled" if args.compile else ""))
    os.makedirs(args.out, exist_ok=True)
    if not args.skip_site and not args.compile:
        record["host_per_site"] = host_per_site(device, dtype, args.site_hidden, args.site_calls, args.rounds)
        print(json.dumps(record["host_per_site"], indent=1))
    if args.context_parallel:
        models, batch = context_parallel(args, record, device, dtype)
        stem = os.path.join(args.out, f"train_step_cp{record['world_size']}_{name.replace(' ', '_')}")
    else:
        models = build_models(args.hidden, args.layers, args.vocab, device, dtype, args.compile)
        batch = {"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq), device=device)}
        batch["labels"] = batch["input_ids"]
    times, record["peak_memory_gib"] = paired_rounds(models, batch, args.rounds, args.steps, args.warmup)
    record["shape"] = dict(layers=args.layers, hidden=args.hidden, batch=args.batch, seq=args.seq,
                           parameters=sum(p.numel() for p in models["llama"].parameters()))
    record["step_ms"] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    pairs = {"patched_vs_llama": ("patched", "llama"), "native_0_vs_llama": ("native_0", "llama"),
             f"native_{PDE['steps']}_vs_native_0": (f"native_{PDE['steps']}", "native_0")}
    record["overhead"] = {key: overhead(times, *pair) for key, pair in pairs.items() if pair[0] in times}
    if not args.compile and not args.context_parallel:
        record["pde_kernel_ms_per_step"] = {k: pde_kernel_ms(models[k], batch)
                                            for k in ("patched", f"native_{PDE['steps']}")}
    print(json.dumps(record, indent=1))
    if os.environ.get("RANK", "0") == "0":
        with open(stem + ".json", "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
