#!/usr/bin/env python
"""Sharded training check for CTA models under the engine an ``accelerate`` config file names (FSDP2, DeepSpeed
ZeRO-3, or none), against a one-process run on the same global batch.

    # the reference: one process, no engine (bf16 autocast)
    accelerate launch --num_processes 1 --mixed_precision bf16 benchmarks/bench_distributed.py
    # 2 GPUs, each engine (the config files ship with the examples)
    accelerate launch --config_file examples/accelerate/fsdp2.yaml benchmarks/bench_distributed.py
    accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml benchmarks/bench_distributed.py
    # the comparison (md + png from the JSON files)
    python benchmarks/summarize_distributed.py
    # CPU (gloo), tiny model: add --cpu to accelerate launch and --size tiny here

A Llama-shaped model (``--size 1b``: hidden 2048, 22 layers, intermediate 5632, vocab 32000 = 1.1B parameters;
random init with ``--seed``, saved once and loaded with ``from_pretrained`` as a user's checkpoint would be, so
``fsdp_cpu_ram_efficient_loading`` / ``zero3_init_flag`` take their real paths) goes through these phases, one after
the other in the same run (each freed before the next):

- ``full``: full fine-tune, unpatched (the timing baseline);
- ``full_pde``: full fine-tune, patched with ``cta.patch_model(pde_type="diffusion", pde_steps=4,
  placement="block_output", init="paper")`` (default scalar coefficients, non-zero so the PDE is active);
- ``lora``: LoRA on the unpatched model (the timing baseline of the next);
- ``lora_pde``: LoRA + PDE coefficients (``cta.CTALoraConfig``: the PDE modules among ``modules_to_save``);
- ``native``: a ``cta.CTAForCausalLM`` (``CTAConfig.modern_decoder``, default coefficients) of the same shape.

Every phase trains ``--steps`` steps on one fixed global batch of ``--global_batch`` sequences (each process gets
``global_batch / num_processes`` of them, so the global batch is the same at any process count) and records the mean
loss of every step, the median step time after ``--warmup`` steps and each GPU's peak memory. For patched phases the
PDE coefficients are read before and after from the gathered full state dict: each must have moved (their parameter
group has weight decay 0, so with AdamW a coefficient moves only if it got a non-zero gradient). ``full_pde`` and
``lora_pde`` then save (a full state dict gathered from the shards; the adapter for LoRA), reload on rank 0
(``cta.load_patched``; the adapter onto a freshly loaded and patched base), check the weights equal what the sharded
run held and that cached greedy generation equals uncached.

Writes ``<results_dir>/distributed_<engine>_<N><gpu|cpu>.json`` (engine: single, ddp, fsdp1, fsdp2, zero2, zero3).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import cta  # noqa: E402
import transformers  # noqa: E402
from cta.patching_cta import pde_parameter_names  # noqa: E402
from distributed_checks import check_coefficients, save_and_reload  # noqa: E402

SIZES = {
    # hidden, layers, heads, kv heads, intermediate, vocab (TinyLlama-1.1B's shape)
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=32000),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256),
}
PHASES = ("full", "full_pde", "lora", "lora_pde", "native")
PATCH = dict(pde_type="diffusion", pde_steps=4, placement="block_output", init="paper")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="1b", help="Model shape (default: 1b, 1.1B parameters).")
    p.add_argument("--phases", default=",".join(PHASES), help=f"Comma list of {PHASES} (default: all).")
    p.add_argument("--steps", type=int, default=12, help="Training steps per phase (default 12).")
    p.add_argument("--warmup", type=int, default=4, help="Steps left out of the step-time median (default 4).")
    p.add_argument("--global_batch", type=int, default=8,
                   help="Sequences per step over all processes; must divide by the process count (default 8).")
    p.add_argument("--seq_len", type=int, default=1024, help="Tokens per sequence (default 1024).")
    p.add_argument("--lr", type=float, default=1e-4, help="Learning rate of full fine-tuning (default 1e-4).")
    p.add_argument("--lora_lr", type=float, default=1e-3, help="Learning rate of the LoRA weights (default 1e-3).")
    p.add_argument("--pde_lr", type=float, default=1e-2, help="Learning rate of the PDE coefficients (default 1e-2).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the model init and the batch (default 0).")
    p.add_argument("--overhead_rounds", type=int, default=0,
                   help="After a phase with PDE sites: this many paired rounds of one training step with the sites "
                        "on and one with them off (steps=0), order alternating, in the same process and engine "
                        "(default 0: none). The first two rounds are warm-up.")
    p.add_argument("--merge", action="store_true",
                   help="Add this run's phases to the result file of the same name (run one phase per process: "
                        "DeepSpeed engines of earlier phases stay in memory and slow the later ones).")
    p.add_argument("--no_save", action="store_true", help="Skip the save / reload / generation checks.")
    p.add_argument("--work_dir", default=None,
                   help="Where the random-init base models and the saved checkpoints go (default: a temp dir; "
                        "about 9 GB at --size 1b).")
    p.add_argument("--results_dir", default=os.path.join(REPO_ROOT, "results"), help="Where the JSON goes.")
    p.add_argument("--name", default=None,
                   help="Result file stem (default distributed_<engine>_<N><gpu|cpu>).")
    args = p.parse_args(argv)
    for phase in args.phases.split(","):
        if phase not in PHASES:
            p.error(f"--phases: {phase!r} is not one of {PHASES}")
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    return args


def engine_name(accelerator) -> str:
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if accelerator.num_processes == 1 and kind != DistributedType.DEEPSPEED and not accelerator.is_fsdp2:
        return "single"
    if kind == DistributedType.FSDP:
        return f"fsdp{accelerator.state.fsdp_plugin.fsdp_version}"
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
        return "ddp"
    return "single"


def llama_config(size):
    return transformers.LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **SIZES[size])


def native_config(size):
    shape = SIZES[size]
    return cta.CTAConfig.modern_decoder(max_position_embeddings=4096, **shape)


def write_bases(accelerator, args, work_dir):
    """Random-init base checkpoints (fp32), written once by rank 0: every phase loads them like a user's model."""
    paths = {"llama": os.path.join(work_dir, "base_llama"), "native": os.path.join(work_dir, "base_native")}
    if accelerator.is_main_process:
        for key, path in paths.items():
            if os.path.exists(os.path.join(path, "config.json")):
                continue
            transformers.set_seed(args.seed)
            if key == "llama":
                model = transformers.LlamaForCausalLM(llama_config(args.size))
            else:
                model = cta.CTAForCausalLM(native_config(args.size))
            model.save_pretrained(path)
            del model
    accelerator.wait_for_everyone()
    return paths


def build(phase, paths, args):
    """The phase's model (fp32, on CPU or ZeRO-3 partitioned) and its AdamW parameter groups."""
    if phase == "native":
        model = cta.CTAForCausalLM.from_pretrained(paths["native"], dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(paths["llama"], dtype=torch.float32)
        if phase.endswith("_pde"):
            cta.patch_model(model, **PATCH)  # after loading, as users patch a pretrained model
    if phase.startswith("lora"):
        from peft import LoraConfig, get_peft_model
        from transformers.integrations import is_deepspeed_zero3_enabled

        # LoRA + PDE: CTALoraConfig records the patch and saves the PDE coefficients with the adapter.
        config = (cta.CTALoraConfig if phase == "lora_pde" else LoraConfig)(
            r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
        # DeepSpeed partitions the trainable parameters of one dtype together: under ZeRO-3 the adapters keep the
        # model's dtype (bf16) like the PDE coefficients instead of PEFT's fp32 upcast; DeepSpeed's optimizer keeps
        # fp32 master copies of all of them.
        model = get_peft_model(model, config, autocast_adapter_dtype=not is_deepspeed_zero3_enabled())
    model.config.use_cache = False
    pde, other = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (pde if "_pde." in name else other).append(param)
    lr = args.lora_lr if phase.startswith("lora") else args.lr
    groups = [g for g in ({"params": other, "lr": lr}, {"params": pde, "lr": args.pde_lr}) if g["params"]]
    return model, torch.optim.AdamW(groups, weight_decay=0.0)


def trainable_pde_names(model):
    """State-dict names of the trained PDE coefficients (inside PEFT: the modules_to_save copies)."""
    names = pde_parameter_names(model)
    return [n for n in names if "original_module" not in n]


def fixed_batch(args, vocab_size):
    generator = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, vocab_size, (args.global_batch, args.seq_len), generator=generator)


def gathered(accelerator, params):
    """DeepSpeed ZeRO-3: the full values of ``params`` inside the block (collective); otherwise a no-op."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(accelerator, *objects):
    accelerator.free_memory(*objects)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_phase(accelerator, phase, paths, args, work_dir):
    from torch.utils.data import DataLoader, TensorDataset

    device = accelerator.device
    gc.collect()  # the previous phase's model is unreachable only once its run_phase returned
    start_gib = 0.0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start_gib = torch.cuda.memory_allocated(device) / 2**30
    transformers.set_seed(args.seed)
    model, optimizer = build(phase, paths, args)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ds_numel: a ZeRO-3 partition
    pde_names = trainable_pde_names(model)
    before = {n: p for n, p in model.named_parameters() if n in set(pde_names)}
    with gathered(accelerator, list(before.values())):  # a native model loaded under zero.Init is partitioned
        # Rank 0 alone: with FSDP's CPU-RAM-efficient loading the other ranks may hold the model on the meta device.
        before = {n: p.detach().float().cpu().clone() for n, p in before.items()} if accelerator.is_main_process else {}
    ids = fixed_batch(args, model.config.vocab_size)
    loader = DataLoader(TensorDataset(ids), batch_size=args.global_batch // accelerator.num_processes)
    plugin = getattr(accelerator.state, "fsdp_plugin", None) if accelerator.is_fsdp2 else None
    if plugin is not None and not os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        # accelerate keeps the layer classes it read from the first model's _no_split_modules; this run's models
        # differ (Llama, then the native CTA decoder), so each is wrapped by its own _no_split_modules.
        plugin.transformer_cls_names_to_wrap = None
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    wrapped = type(model).__name__  # what the engine made of it (FSDP..., DeepSpeedEngine, DistributedDataParallel)
    model.train()
    def train_step():
        for (batch,) in loader:  # one batch per process: the same global batch every step
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed clips inside (gradient_clipping 1.0)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    losses, times = [], []
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        loss = train_step()
        sync(device)
        times.append(time.perf_counter() - start)
        losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                        device=device)
    record = {
        "phase": phase,
        "wrapped_as": wrapped,
        "parameters": n_params,
        "losses": losses,
        "step_seconds": times,
        "step_seconds_median": statistics.median(times[args.warmup:]),
        "peak_memory_gib_per_gpu": [round(v, 3) for v in accelerator.gather(peak).tolist()],
        "allocated_at_start_gib_rank0": round(start_gib, 3),  # left over from earlier phases (should be ~0)
    }
    if pde_names or (phase == "full_pde" and not args.no_save):
        state = accelerator.get_state_dict(model)  # collective: every rank calls it; the full dict is on rank 0
        record.update(check_coefficients(accelerator, state, before, pde_names))
        if not args.no_save and phase in ("full_pde", "lora_pde"):
            record.update(save_and_reload(accelerator, model, state, phase, paths, work_dir, PATCH))
        del state
    if args.overhead_rounds and pde_names:  # after the checks: these steps train on with the sites on and off
        record.update(paired_pde_overhead(accelerator, model, train_step, args.overhead_rounds))
    free(accelerator, model, optimizer, loader)
    accelerator.print(json.dumps({k: v for k, v in record.items() if k != "step_seconds"}))
    return record


def paired_pde_overhead(accelerator, model, train_step, rounds):
    """The PDE's share of a training step, measured in the process, engine and model of the phase: ``rounds`` pairs
    of one step with every PDE site on and one with the sites off (``steps = 0``: each site is still called, so
    hooks, parameter gathering and module order stay the same, and returns its input), the order swapped every
    round. Timings between processes differ by tens of percent on a shared 2-GPU host; within a pair they do not.
    Returns the median and range of the per-pair ratios (the first two pairs left out as warm-up)."""
    from cta.pde_cta import PDERefinement

    sites = [m for m in model.modules() if isinstance(m, PDERefinement)]
    steps = [m.steps for m in sites]
    ratios, on_times, off_times = [], [], []
    for r in range(rounds):
        times = {}
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            for site, s in zip(sites, steps):
                site.steps = s if on else 0
            sync(accelerator.device)
            start = time.perf_counter()
            train_step()
            sync(accelerator.device)
            times[on] = time.perf_counter() - start
        for site, s in zip(sites, steps):
            site.steps = s
        # rank 0's pair; the collectives inside a step keep the ranks in step
        ratios.append(times[True] / times[False])
        on_times.append(times[True])
        off_times.append(times[False])
    kept = ratios[2:] if len(ratios) > 2 else ratios
    return {"paired_rounds": rounds, "paired_pde_sites": len(sites),
            "paired_step_seconds_on": on_times, "paired_step_seconds_off": off_times,
            "paired_step_overhead_median": statistics.median(kept) - 1,
            "paired_step_overhead_range": [min(kept) - 1, max(kept) - 1]}


def main(argv=None):
    from accelerate import Accelerator

    args = parse_args(argv)
    accelerator = Accelerator()
    if args.global_batch % accelerator.num_processes:
        raise ValueError(f"--global_batch ({args.global_batch}) must divide by the number of processes "
                         f"({accelerator.num_processes}).")
    engine = engine_name(accelerator)
    unit = "gpu" if accelerator.device.type == "cuda" else "cpu"
    name = args.name or f"distributed_{engine}_{accelerator.num_processes}{unit}"
    work_dir = args.work_dir or os.path.join(tempfile.gettempdir(), f"bench_distributed_{args.size}_{args.seed}")
    paths = write_bases(accelerator, args, work_dir)
    phases = {}
    for phase in args.phases.split(","):
        phases[phase] = run_phase(accelerator, phase, paths, args, os.path.join(work_dir, name))
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for record in phases.values():
            record["run_arguments"] = " ".join(sys.argv[1:])
        path = os.path.join(args.results_dir, name + ".json")
        if args.merge and os.path.exists(path):
            with open(path) as f:
                phases = {**json.load(f)["phases"], **phases}
        for patched, plain in (("full_pde", "full"), ("lora_pde", "lora")):
            if patched in phases and plain in phases:
                phases[patched]["step_overhead_vs_" + plain] = (
                    phases[patched]["step_seconds_median"] / phases[plain]["step_seconds_median"] - 1)
        result = {
            "name": name, "engine": engine, "num_processes": accelerator.num_processes, "device_type": unit,
            "device": torch.cuda.get_device_name(0) if unit == "gpu" else platform.processor() or "cpu",
            "mixed_precision": accelerator.mixed_precision, "size": args.size, "model_shape": SIZES[args.size],
            "patch": PATCH, "global_batch": args.global_batch,
            "per_process_batch": args.global_batch // accelerator.num_processes, "seq_len": args.seq_len,
            "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "lora_lr": args.lora_lr,
            "pde_lr": args.pde_lr, "seed": args.seed,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "accelerate": __import__("accelerate").__version__, "cta": cta.__version__},
            "command": "accelerate launch ... benchmarks/bench_distributed.py " + " ".join(sys.argv[1:]),
            "phases": phases,
        }
        os.makedirs(args.results_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
