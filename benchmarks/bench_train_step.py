"""What the PDE sites cost a training step on one GPU against transformers' Llama (the README's training line):

    python benchmarks/bench_train_step.py [--compile]   # host time per site + the 12 x 1024 step (eager / compiled)

Host per site: 8 ``PDERefinement`` modules (1 x 64 tokens) chained, forward + backward on a CPU clock over a ``mul``
in their place, beside a trivial Triton op's floor; in the model, the step's host time over its reference's. Paired
``--rounds`` of steps on ``--batch`` x ``--seq`` tokens, bf16: median [quartiles], memory, GPU and PDE kernel time.
"""

import argparse
import contextlib
import copy
import functools
import json
import os
import statistics
import sys
import time

import torch

from results_io import clocked, sync

import cta  # noqa: E402  (after results_io: it puts the repository on the path)
from cta import CTAConfig, CTAForCausalLM, kernels_cpp  # noqa: E402

PDE = dict(pde_type="diffusion", steps=4, placement="block_output")


def build_models(hidden, layers, vocab, device, dtype, compile_models=False, with_native=True):
    """{name: model}: Llama, Llama patched, and (``with_native``) native models of 0 and 4 steps and a gained Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, intermediate = max(1, hidden // 64), 256 * ((int(hidden * 2.75) + 255) // 256)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                         max_position_embeddings=8192, attn_implementation="sdpa"))
    patched = cta.patch_model(copy.deepcopy(llama), pde_type=PDE["pde_type"], pde_steps=PDE["steps"],
                              placement=PDE["placement"], init="paper")
    native = {steps: CTAForCausalLM(CTAConfig.modern_decoder(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=8192, pde_type=PDE["pde_type"], pde_steps=steps,
        pde_placement=PDE["placement"], attn_implementation="sdpa"))
        for steps in ((0, PDE["steps"]) if with_native else ())}
    models = {"llama": llama, "patched": patched, **{f"native_{steps}": model for steps, model in native.items()}}
    if with_native:  # the cheapest site a block can take, a learned gain (one `mul`): the floor of any op in its place
        models["llama_gain"] = gain = copy.deepcopy(llama)
        for layer in gain.model.layers:
            layer.site_gain = torch.nn.Parameter(torch.ones(1))
            layer.register_forward_hook(lambda module, args, output: output * module.site_gain)
    for name, model in models.items():
        model.to(device=device, dtype=dtype).train()
        if compile_models:
            model.forward = torch.compile(model.forward)
    return models


def train_step(model, batch):
    """One step; returns its forward's host seconds, until the loss (0 for the callable, context-parallel, step)."""
    start, loss = time.perf_counter(), None if callable(batch) else model(**batch).loss
    forward = 0.0 if loss is None else time.perf_counter() - start
    batch(model) if loss is None else loss.backward()
    model.zero_grad(set_to_none=True)
    return forward


def paired_rounds(models, batch, rounds, steps, warmup=3):
    """({name: [seconds per step, one per round]}, the same for the host's part (the steps queued, before the closing
    synchronisation) and for its forward's, {name: peak GiB of a step}), the models taking turns in a round."""
    memory = {}
    for name, model in models.items():  # warm-up: kernels compiled, caches filled
        torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
        [train_step(model, batch) for _ in range(warmup)]
        memory[name] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    times, host, forward = ({name: [] for name in models} for _ in range(3))
    for _ in range(rounds):
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            forward[name].append(sum(train_step(model, batch) for _ in range(steps)) / steps)
            host[name].append((time.perf_counter() - start) / steps)
            times[name].append((sync() or time.perf_counter() - start) / steps)
    return times, host, forward, memory


def overhead(times, name, reference):
    """Median and quartiles of the per-round ratio ``name / reference`` - 1, in percent."""
    ratios = sorted(100 * (a / b - 1) for a, b in zip(times[name], times[reference]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median_pct": statistics.median(ratios), "q1_pct": quartiles[0], "q3_pct": quartiles[-1]}


def gpu_profile(model, batch):
    """(GPU ms per step of the PDE kernels (names containing ``_cta_``), GPU-busy ms per step: the union of all kernels'
    intervals), from torch.profiler over 3 steps (CUDA)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        [train_step(model, batch) for _ in range(3)]
        sync()
    pde = sum(e.self_device_time_total for e in prof.key_averages() if "_cta_" in e.key) / 3 / 1000
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                              if e.device_type.name == "CUDA"):
        busy, end = busy + max(0.0, stop - max(start, end)), max(end, stop)  # (the part beyond the union so far)
    return pde, busy / 3 / 1000


def _minimal_triton_op(device):
    """One trivial Triton launch each way in an autograd.Function: an eager op's host-time floor (None off CUDA)."""
    if device.type != "cuda":
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(source, target, BLOCK: tl.constexpr):
        tl.store(target + tl.arange(0, BLOCK), tl.load(source + tl.arange(0, BLOCK)))

    def launch(x):
        copy_kernel[(1,)](x, y := torch.empty_like(x), BLOCK=16)
        return y

    class MinimalTritonOp(torch.autograd.Function):
        forward, backward = staticmethod(lambda ctx, x: launch(x)), staticmethod(lambda ctx, grad: launch(grad))

    return MinimalTritonOp.apply


def site_chain(device, dtype, hidden, calls, rounds, sites=8):
    """Host us per forward + backward of a lone ``PDERefinement`` (``sites`` chained in one graph on a 1 x 64 input)
    over a ``mul`` in its place; also with the C++ launcher off (CUDA), and for the minimal Triton op (the floor)."""
    pde = [cta.PDERefinement(hidden, PDE["pde_type"], PDE["steps"], True).to(device, dtype) for _ in range(sites)]
    chains = {"pde_site": pde, "pde_site_python_launch": pde if device.type == "cuda" else None,
              "minimal_triton_op": _minimal_triton_op(device), "torch_mul": lambda y: y.mul(1.0)}
    chains = {name: ops if isinstance(ops, list) else [ops] * sites for name, ops in chains.items() if ops is not None}
    x = torch.randn(1, 64, hidden, device=device, dtype=dtype, requires_grad=True)

    def run(ops):
        functools.reduce(lambda y, op: op(y), ops, x).sum().backward()
        [setattr(tensor, "grad", None) for tensor in [x] + [site.alpha for site in pde]]

    times = {name: [] for name in chains}
    for _ in range(rounds + 1):  # (paired: the chains take turns; the first round warms up)
        for name, ops in chains.items():
            with kernels_cpp.python_launch() if name == "pde_site_python_launch" else contextlib.nullcontext():
                times[name].append(clocked(lambda: [run(ops) for _ in range(calls)]) / calls)
    mul = times.pop("torch_mul")[1:]
    per_site = {name: statistics.median((a - b) / sites * 1e6 for a, b in zip(t[1:], mul)) for name, t in times.items()}
    return {"sites": sites, "over_torch_mul_us": per_site, "torch_mul_us": 1e6 * statistics.median(mul) / sites}


def context_parallel(args, record, device, dtype):
    """The context-parallel mode's models and step (see the module notes); the probe's lengths go to ``record``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as sharded

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dist.all_reduce(torch.zeros(1, device=device), group=mesh.get_group())  # (NCCL's own buffers before the probe)
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
    args.batch, args.seq = 1, length
    record.update(world_size=dist.get_world_size(), seq=length, local_seq=length // dist.get_world_size(),
                  probe={"one_gpu_max_seq": one, "context_parallel_seq": length} if args.probe else None)
    return models, batch(length)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder for train_step_<gpu>[_compiled][_<shape>][_host_bound: eager, host-bound].json")
    for flag, default in (("layers", 12), ("hidden", 1024), ("vocab", 32000), ("batch", 8), ("seq", 1024)):
        parser.add_argument(f"--{flag}", type=int, default=default, help="the step's model and batch")
    parser.add_argument("--rounds", type=int, default=61, help="paired rounds (host slower than the GPU: use 244)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
    parser.add_argument("--site_hidden", type=int, default=256, help="channels of the host-time sites")
    parser.add_argument("--site_calls", type=int, default=50, help="timed forward + backward calls per round")
    parser.add_argument("--compile", action="store_true", help="each model's forward under torch.compile")
    parser.add_argument("--context_parallel", action="store_true", help="the context-parallel mode (torchrun)")
    parser.add_argument("--probe", action="store_true", help="context parallel: the longest lengths, then time")
    args = parser.parse_args()
    if args.context_parallel:  # its shape and rounds, unless given
        parser.set_defaults(layers=16, hidden=2048, seq=65536, rounds=3, steps=1, warmup=1)
        args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")
    torch.cuda.set_device(device) if device.type == "cuda" else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    record = {"command": "python " + " ".join(sys.argv), "device": name, "torch": torch.__version__,
              "dtype": str(dtype), "pde": PDE, "compile": args.compile}
    shape = (args.layers, args.hidden, args.batch, args.seq)
    stem = os.path.join(args.out, "train_step_" + name.replace(" ", "_") + ("_compiled" if args.compile else "") + (
        "" if shape == (12, 1024, 8, 1024) else "_{}x{}_{}x{}".format(*shape)))
    os.makedirs(args.out, exist_ok=True)
    if not args.compile and not args.context_parallel:
        record["host_per_site"] = site_chain(device, dtype, args.site_hidden, args.site_calls, args.rounds)
    if args.context_parallel:
        models, batch = context_parallel(args, record, device, dtype)
        stem = os.path.join(args.out, f"train_step_cp{record['world_size']}_{name.replace(' ', '_')}")
    else:
        models = build_models(args.hidden, args.layers, args.vocab, device, dtype, args.compile)
        batch = {"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq), device=device)}
        batch["labels"] = batch["input_ids"]
    times, host, forward, record["peak_memory_gib"] = paired_rounds(models, batch, args.rounds, args.steps, args.warmup)
    record["shape"] = dict(layers=args.layers, hidden=args.hidden, batch=args.batch, seq=args.seq,
                           parameters=sum(p.numel() for p in models["llama"].parameters()))
    record["step_ms"], record["host_ms"] = ({n: 1e3 * statistics.median(t[n]) for n in t} for t in [times, host])
    native = f"native_{PDE['steps']}"
    pairs = [("patched", "llama"), ("llama_gain", "llama"), ("patched", "llama_gain"), ("native_0", "llama"),
             (native, "native_0")]
    record["overhead"] = {f"{a}_vs_{b}": overhead(times, a, b) for a, b in pairs if a in times and b in times}
    if not args.compile and not args.context_parallel:  # (a step that waits on its host shows each site's host time)
        sites = sum(isinstance(m, cta.PDERefinement) for m in models["patched"].modules())
        for key, part in (("in_model_host_per_site_us", host), ("in_model_forward_host_per_site_us", forward)):
            record[key] = {a: 1e6 * statistics.median((x - y) / sites for x, y in zip(part[a], part[b]))
                           for a, b in pairs if "native_0" not in a and b != "llama_gain"}
        if device.type == "cuda":
            profiles = {name: gpu_profile(model, batch) for name, model in models.items()}
            record["pde_kernel_ms_per_step"] = {k: profiles[k][0] for k in ("patched", native)}
            record["gpu_busy_ms_per_step"] = {k: v[1] for k, v in profiles.items()}
            stem += "_host_bound" * (record["host_ms"]["llama"] >= record["gpu_busy_ms_per_step"]["llama"])  # (regime)
    print(json.dumps(record, indent=1))
    if os.environ.get("RANK", "0") == "0":
        open(stem + ".json", "w").write(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
