#!/usr/bin/env python
"""Sharded training of CTA models against one process on the same global batch: the table results/distributed.md.

    accelerate launch --num_processes 1 --mixed_precision bf16 benchmarks/bench_distributed.py   # the reference
    accelerate launch --config_file examples/accelerate/fsdp2.yaml benchmarks/bench_distributed.py   # or ZeRO-3's
    python benchmarks/bench_distributed.py --summarize      # results/distributed.{json,md} from the run files
    bash benchmarks/distributed_gpu.sh single|fsdp2|zero3|overhead   # the 2-GPU runs, one process per phase

A Llama-shaped model (``--size 1b``: TinyLlama-1.1B's shape, random init, loaded with ``from_pretrained``) trains
``--steps`` steps on one global batch split over the processes, per phase: ``full`` / ``full_pde`` (diffusion, 4
steps after every block), ``lora`` / ``lora_pde`` (``cta.CTALoraConfig``), ``native``. Recorded: the loss per step,
the median step time, peak memory, tests/distributed_checks.py's checks and, with ``--overhead_rounds``, the PDE's
share of a step (paired, sites on / at 0 steps). Writes ``distributed_<engine>_<N><gpu|cpu>.json``.
"""

import argparse
import contextlib
import gc
import glob
import json
import os
import platform
import re
import statistics
import sys
import tempfile

from results_io import ROOT, bootstrap_median, clocked

import torch  # noqa: E402  (after results_io: it puts the repository on the path)
import transformers  # noqa: E402

import cta  # noqa: E402
from cta.patching_cta import pde_parameter_names  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests"))
from distributed_checks import check_coefficients, save_and_reload  # noqa: E402  (tests/: the checks a run records)

SIZES = {"1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                    intermediate_size=5632, vocab_size=32000),  # TinyLlama-1.1B's shape
         "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256)}
PHASES = ("full", "full_pde", "lora", "lora_pde", "native")
PATCH = dict(pde_type="diffusion", pde_steps=4, placement="block_output", init="paper")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="1b", help="model shape (default: 1b, 1.1B parameters)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {PHASES} (default: all)")
    for flag, default, text in (  # (numbers: their type is their default's)
            ("steps", 12, "training steps per phase"), ("warmup", 4, "steps left out of the step-time median"),
            ("global_batch", 8, "sequences per step over all processes"), ("seq_len", 1024, "tokens per sequence"),
            ("lr", 1e-4, "learning rate of full fine-tuning"), ("lora_lr", 1e-3, "learning rate of the LoRA weights"),
            ("pde_lr", 1e-2, "learning rate of the PDE coefficients"), ("seed", 0, "seed of the init and the batch"),
            ("overhead_rounds", 0, "paired rounds, PDE sites on / at steps = 0 (notes)")):
        p.add_argument(f"--{flag}", type=type(default), default=default, help=text)
    p.add_argument("--merge", action="store_true", help="add the phases to the result file (one phase per process)")
    p.add_argument("--no_save", action="store_true", help="skip the save / reload / generation checks")
    p.add_argument("--work_dir", default=None, help="base models and checkpoints (default: a temp dir; ~9 GB at 1b)")
    p.add_argument("--results_dir", default=os.path.join(ROOT, "results"), help="where the JSON files are")
    p.add_argument("--name", default=None, help="result file stem (default distributed_<engine>_<N><gpu|cpu>)")
    p.add_argument("--summarize", action="store_true", help="only render <results_dir>/distributed.* from the run files")
    p.add_argument("--reference", default="distributed_single_1gpu", help="stem of the one-process run")
    args = p.parse_args(argv)
    if set(args.phases.split(",")) - set(PHASES):
        p.error(f"--phases: {sorted(set(args.phases.split(',')) - set(PHASES))} not in {PHASES}")
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    return args


def engine_name(accelerator) -> str:
    from accelerate.utils import DistributedType as Kind

    kind, state = accelerator.distributed_type, accelerator.state
    if kind == Kind.FSDP and (accelerator.num_processes > 1 or accelerator.is_fsdp2):
        return f"fsdp{state.fsdp_plugin.fsdp_version}"
    if kind == Kind.DEEPSPEED:
        return f"zero{state.deepspeed_plugin.zero_stage}"
    return "ddp" if accelerator.num_processes > 1 and kind in (Kind.MULTI_GPU, Kind.MULTI_CPU) else "single"


def write_bases(accelerator, args, work_dir):
    """Random-init base checkpoints (fp32), written once by rank 0: every phase loads them like a user's model."""
    paths = {"llama": os.path.join(work_dir, "base_llama"), "native": os.path.join(work_dir, "base_native")}
    if accelerator.is_main_process:
        for key, path in paths.items():
            if not os.path.exists(os.path.join(path, "config.json")):
                transformers.set_seed(args.seed)
                shape = dict(max_position_embeddings=4096, **SIZES[args.size])
                (transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **shape))
                 if key == "llama" else cta.CTAForCausalLM(cta.CTAConfig.modern_decoder(**shape))).save_pretrained(path)
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

        config = (cta.CTALoraConfig if phase == "lora_pde" else LoraConfig)(
            r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
        # ZeRO-3 partitions the trainable parameters of one dtype together: there the adapters keep the model's
        # dtype (bf16) like the PDE coefficients, instead of PEFT's fp32 upcast (DeepSpeed keeps fp32 master copies).
        model = get_peft_model(model, config, autocast_adapter_dtype=not is_deepspeed_zero3_enabled())
    model.config.use_cache = False
    pde = [p for n, p in model.named_parameters() if p.requires_grad and "_pde." in n]
    other = [p for n, p in model.named_parameters() if p.requires_grad and "_pde." not in n]
    lr = args.lora_lr if phase.startswith("lora") else args.lr
    groups = [g for g in ({"params": other, "lr": lr}, {"params": pde, "lr": args.pde_lr}) if g["params"]]
    return model, torch.optim.AdamW(groups, weight_decay=0.0)


def run_phase(accelerator, phase, paths, args, work_dir):
    from torch.utils.data import DataLoader, TensorDataset

    device = accelerator.device
    gc.collect()  # the previous phase's model is unreachable only once its run_phase returned
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    transformers.set_seed(args.seed)
    model, optimizer = build(phase, paths, args)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ds_numel: a ZeRO-3 partition
    pde_names = [n for n in pde_parameter_names(model) if "original_module" not in n]  # (PEFT: the trained copies)
    before = {n: p for n, p in model.named_parameters() if n in set(pde_names)}
    zero3 = accelerator.distributed_type == "DEEPSPEED"  # (ZeRO-3: the full values inside the block, collective)
    with __import__("deepspeed").zero.GatheredParameters(list(before.values())) if zero3 else contextlib.nullcontext():
        # A native model loaded under zero.Init is partitioned.
        # Rank 0 alone: with FSDP's CPU-RAM-efficient loading the other ranks may hold the model on the meta device.
        before = {n: p.detach().float().cpu().clone() for n, p in before.items()} if accelerator.is_main_process else {}
    ids = torch.randint(0, model.config.vocab_size, (args.global_batch, args.seq_len),
                        generator=torch.Generator().manual_seed(args.seed + 1))
    loader = DataLoader(TensorDataset(ids), batch_size=args.global_batch // accelerator.num_processes)
    plugin = getattr(accelerator.state, "fsdp_plugin", None) if accelerator.is_fsdp2 else None
    if plugin is not None and not os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        # accelerate keeps the layer classes of the first model's _no_split_modules; wrap each model by its own.
        plugin.transformer_cls_names_to_wrap = None
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()

    def train_step():
        for (batch,) in loader:  # one batch per process: the same global batch every step
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed clips inside (gradient_clipping 1.0)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def timed_step():
        losses = []
        return clocked(lambda: losses.append(train_step()), device), losses[0]

    losses, times = [], []
    for seconds, loss in (timed_step() for _ in range(args.steps)):
        times.append(seconds)
        losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                        device=device)
    record = {"phase": phase, "wrapped_as": type(model).__name__, "parameters": n_params, "losses": losses,
              "step_seconds": times, "step_seconds_median": statistics.median(times[args.warmup:]),
              "peak_memory_gib_per_gpu": [round(v, 3) for v in accelerator.gather(peak).tolist()],
              "allocated_at_start_gib_rank0": round(start_gib, 3)}  # (left over from earlier phases: ~0)
    if pde_names or (phase == "full_pde" and not args.no_save):
        state = accelerator.get_state_dict(model)  # collective: every rank calls it; the full dict is on rank 0
        record.update(check_coefficients(accelerator, state, before, pde_names))
        if not args.no_save and phase in ("full_pde", "lora_pde"):
            record.update(save_and_reload(accelerator, model, state, phase, paths, work_dir, PATCH))
        del state
    if args.overhead_rounds and pde_names:  # after the checks: these steps train on with the sites on and off
        record.update(paired_pde_overhead(model, timed_step, args.overhead_rounds))
    accelerator.free_memory(model, optimizer, loader)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    accelerator.print(json.dumps({k: v for k, v in record.items() if k != "step_seconds"}))
    return record


def paired_pde_overhead(model, timed_step, rounds):
    """The PDE's share of a training step in the phase's process, engine and model: ``rounds`` pairs of one step with
    the sites on and one with them at ``steps = 0`` (each site still called: hooks, gathering and module order stay),
    the order swapped every round (rank 0's times; the first two pairs are warm-up)."""
    from cta.pde_cta import PDERefinement

    sites = [m for m in model.modules() if isinstance(m, PDERefinement)]
    steps = [m.steps for m in sites]
    on_times, off_times = [], []
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            for site, s in zip(sites, steps):
                site.steps = s if on else 0
            (on_times if on else off_times).append(timed_step()[0])
    for site, s in zip(sites, steps):
        site.steps = s
    kept = [a / b for a, b in zip(on_times, off_times)][2:] or [a / b for a, b in zip(on_times, off_times)]
    return {"paired_rounds": rounds, "paired_pde_sites": len(sites),
            "paired_step_seconds_on": on_times, "paired_step_seconds_off": off_times,
            "paired_step_overhead_median": statistics.median(kept) - 1,
            "paired_step_overhead_range": [min(kept) - 1, max(kept) - 1]}


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:
        return write_summary(args.results_dir, args.reference)
    from accelerate import Accelerator

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
            phases = {**json.loads(open(path).read())["phases"], **phases}
        for patched, plain in (("full_pde", "full"), ("lora_pde", "lora")):
            if patched in phases and plain in phases:
                phases[patched]["step_overhead_vs_" + plain] = (
                    phases[patched]["step_seconds_median"] / phases[plain]["step_seconds_median"] - 1)
        result = dict(name=name, engine=engine, num_processes=accelerator.num_processes, device_type=unit,
            device=torch.cuda.get_device_name(0) if unit == "gpu" else platform.processor() or "cpu",
            mixed_precision=accelerator.mixed_precision, size=args.size, model_shape=SIZES[args.size], patch=PATCH,
            global_batch=args.global_batch, per_process_batch=args.global_batch // accelerator.num_processes,
            seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, lr=args.lr, lora_lr=args.lora_lr,
            pde_lr=args.pde_lr, seed=args.seed,
            versions={"torch": torch.__version__, "transformers": transformers.__version__,
                      "accelerate": __import__("accelerate").__version__, "cta": cta.__version__},
            command="accelerate launch ... benchmarks/bench_distributed.py " + " ".join(sys.argv[1:]), phases=phases)
        os.makedirs(args.results_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    accelerator.end_training()


# --summarize. Loss tolerance: |loss - reference| <= LOSS_RTOL * reference + LOSS_ATOL at every step. 1%: the runs
# compute in bf16 (unit roundoff 0.2%), sharding reorders every reduction and DeepSpeed's bf16 mode keeps the weights in
# bf16, so step 0 differs by a few roundoffs that AdamW's normalised updates grow; a missing shard or reduction moves
# the loss by far more within a few steps (the fixed batch is memorised quickly). 0.01 nats on top: a full fine-tune
# memorises the batch down to ~0.06, where the same differences are a large fraction of a tiny number.
LOSS_RTOL, LOSS_ATOL, OVERHEAD_TARGET = 0.01, 0.01, 0.05
ENGINE_LABEL = {"fsdp2": "FSDP2", "fsdp1": "FSDP1", "zero3": "DeepSpeed ZeRO-3", "zero2": "DeepSpeed ZeRO-2",
                "ddp": "DDP", "single": "one process"}


def _paired_ci(record):
    """Bootstrap 95% interval of the median per-pair ratio (on / off - 1), the first two pairs left out."""
    ratios = [a / b - 1 for a, b in zip(record["paired_step_seconds_on"], record["paired_step_seconds_off"])][2:]
    return list(bootstrap_median(ratios, resamples=10000))


def load_runs(results_dir):
    """Every run file by stem; a ``<stem>_overhead.json`` (a short run with ``--overhead_rounds``) lends its paired
    fields to ``<stem>``'s phases, and ``<stem>_overhead_<tag>.json`` files are the same at other per-GPU batches."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "distributed_*.json"))):
        if re.search(r"distributed_[a-z0-9]+_\d+(gpu|cpu)\.json$", path):
            runs[os.path.basename(path)[:-5]] = json.loads(open(path).read())
    for stem, run in runs.items():
        path = os.path.join(results_dir, stem + "_overhead.json")
        if not os.path.exists(path):
            continue
        timing = json.loads(open(path).read())
        for phase, record in timing["phases"].items():
            if phase in run["phases"] and "paired_step_overhead_median" in record:
                run["phases"][phase].update({k: v for k, v in record.items() if k.startswith("paired_")},
                                            paired_source=os.path.basename(path), paired_step_overhead_ci95=_paired_ci(record))
        run["overhead_variants"] = []
        for path in sorted(glob.glob(os.path.join(results_dir, stem + "_overhead_*.json"))):
            timing = json.loads(open(path).read())
            run["overhead_variants"].append({
                "source": os.path.basename(path), "per_process_batch": timing["per_process_batch"],
                "seq_len": timing["seq_len"], "device": timing.get("device"),
                "transformers": timing.get("versions", {}).get("transformers"),
                "phases": {phase: {"median": r["paired_step_overhead_median"], "ci95": _paired_ci(r),
                                   "pairs": r["paired_rounds"] - 2, "step_seconds_median": r["step_seconds_median"]}
                           for phase, r in timing["phases"].items() if "paired_step_overhead_median" in r}})
    return runs


def compare(run, reference):
    rows = []
    for phase, record in run["phases"].items():
        ref = reference["phases"].get(phase)
        row = {"phase": phase, "losses": record["losses"], "wrapped_as": record.get("wrapped_as"),
               "step_seconds_median": record["step_seconds_median"],
               "peak_memory_gib_per_gpu": record["peak_memory_gib_per_gpu"]}
        if ref:
            diffs = [abs(a - b) for a, b in zip(record["losses"], ref["losses"])]
            rel = [d / abs(b) for d, b in zip(diffs, ref["losses"])]
            row.update(reference_losses=ref["losses"], loss_max_abs_diff=max(diffs), loss_max_rel_diff=max(rel),
                       loss_step0_rel_diff=rel[0],
                       losses_match=all(d <= LOSS_RTOL * abs(b) + LOSS_ATOL for d, b in zip(diffs, ref["losses"])))
        row.update({key: record[key] for key in (
            "pde_coefficients", "pde_all_moved", "reload_weights_equal", "generate_cached_equals_uncached",
            "step_overhead_vs_full", "step_overhead_vs_lora", "paired_step_overhead_median",
            "paired_step_overhead_range", "paired_step_overhead_ci95", "paired_rounds", "paired_source") if key in record})
        rows.append(row)
    return rows


def summarize(results_dir, reference_name):
    runs = load_runs(results_dir)
    if reference_name not in runs:
        raise SystemExit(f"--reference: {reference_name}.json is not in {results_dir} (have: {sorted(runs)}).")
    ref = runs[reference_name]
    return {"loss_rtol": LOSS_RTOL, "loss_atol": LOSS_ATOL, "overhead_target": OVERHEAD_TARGET,
            "reference": reference_name, "reference_device": ref["device"], "mixed_precision": ref["mixed_precision"],
            "device_type": ref["device_type"], "model_shape": ref["model_shape"], "global_batch": ref["global_batch"],
            "seq_len": ref["seq_len"], "steps": ref["steps"], "patch": ref["patch"],
            "runs": {name: {"engine": run["engine"], "num_processes": run["num_processes"], "device": run["device"],
                            "versions": run.get("versions", {}), "per_process_batch": run["per_process_batch"],
                            "phases": compare(run, ref), "overhead_variants": run.get("overhead_variants", [])}
                     for name, run in runs.items() if run["num_processes"] > 1}, "reference_phases": compare(ref, ref)}


def _overhead(row):
    """The paired measurement (sites on / off in one process) where there is one, else patched / unpatched phase."""
    if "paired_step_overhead_median" in row:
        low, high = row.get("paired_step_overhead_ci95", row["paired_step_overhead_range"])
        return (f"{100 * row['paired_step_overhead_median']:+.2f}% [{100 * low:+.1f}, {100 * high:+.1f}] paired "
                f"({row['paired_rounds'] - 2})")
    value = row.get("step_overhead_vs_full", row.get("step_overhead_vs_lora"))
    return "" if value is None else f"{100 * value:+.2f}%"


def render_md(summary):
    yes_no = lambda value: "" if value is None else ("yes" if value else "**no**")  # noqa: E731
    shape, patch = summary["model_shape"], summary["patch"]
    lines = ["# Sharded training vs one process (`benchmarks/bench_distributed.py`)", "",
        f"Llama-shaped model: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, intermediate "
        f"{shape['intermediate_size']}, vocab {shape['vocab_size']}, random init (fixed seed); "
        f"{summary['mixed_precision']} mixed precision; global batch {summary['global_batch']} x {summary['seq_len']} "
        f"tokens (the same at every process count), {summary['steps']} steps. Patched: `cta.patch_model(pde_type="
        f"{patch['pde_type']!r}, pde_steps={patch['pde_steps']}, placement={patch['placement']!r}, "
        f"init={patch['init']!r})`, default (scalar) coefficients. Reference: `{summary['reference']}` "
        f"({summary['reference_device']}). Loss tolerance: every step within {100 * summary['loss_rtol']:.0f}% + "
        f"{summary['loss_atol']} nats of the reference (for bf16 runs; see the comment above `LOSS_RTOL` in "
        f"`benchmarks/bench_distributed.py` for why). Step time: median after warm-up. PDE overhead (target <= "
        f"{100 * summary['overhead_target']:.0f}%): where it says *paired*, the median [bootstrap 95% interval] "
        "(pairs) over rounds of one step with the PDE sites on / one with them off (`steps = 0`: each site still "
        "called), in the same process, engine and model (`--overhead_rounds`, the first two rounds left out); "
        "otherwise patched / unpatched phase - 1.", "",
        f"| engine | {summary['device_type'].upper()}s | phase | loss step 0 -> last (reference) | max rel. diff | "
        "match | PDE moved | reload equal | cached == uncached | step s | PDE overhead | peak GiB / GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    tables = [("one process (reference)", 1, summary["reference_phases"])] + [
        (ENGINE_LABEL.get(r["engine"], r["engine"]), r["num_processes"], r["phases"]) for r in summary["runs"].values()]
    for label, n, rows in tables:
        for row in rows:
            ref = row.get("reference_losses", row["losses"])
            losses = f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}" + (
                f" ({ref[0]:.4f} -> {ref[-1]:.4f})" if n > 1 else "")
            rel = f"{100 * row['loss_max_rel_diff']:.2f}%" if n > 1 and "loss_max_rel_diff" in row else ""
            lines.append(
                f"| {label} | {n} | {row['phase']} | {losses} | {rel} | {yes_no(row.get('losses_match')) if n > 1 else ''} "
                f"| {yes_no(row.get('pde_all_moved'))} | {yes_no(row.get('reload_weights_equal'))} "
                f"| {yes_no(row.get('generate_cached_equals_uncached'))} | {row['step_seconds_median']:.3f} "
                f"| {_overhead(row)} | {', '.join(f'{v:.1f}' for v in row['peak_memory_gib_per_gpu'])} |")
    if any(r["phase"] == "full" for r in summary["reference_phases"]):
        lines += ["", "Phases: `full` / `full_pde` = full fine-tune unpatched / patched; `lora` / `lora_pde` = LoRA "
                      "unpatched / LoRA + PDE coefficients (`modules_to_save`); `native` = `cta.CTAForCausalLM` "
                      "(`CTAConfig.modern_decoder`) of the same shape. Rendered by "
                      "`python benchmarks/bench_distributed.py --summarize` from `results/distributed_*.json`."]
    variants = [(r, v) for r in summary["runs"].values() for v in r["overhead_variants"]]
    if variants:
        lines += ["", "PDE overhead at more tokens per GPU (the same paired measurement, its own process per phase):",
                  "", "| engine | GPUs | phase | tokens per GPU | step s | PDE overhead, paired [95%] (pairs) | source |",
                  "|---|---|---|---|---|---|---|"]
        for run, variant in variants:
            for phase, v in variant["phases"].items():
                low, high = v["ci95"]
                lines.append(f"| {ENGINE_LABEL.get(run['engine'], run['engine'])} | {run['num_processes']} | {phase} "
                             f"| {variant['per_process_batch']} x {variant['seq_len']} | {v['step_seconds_median']:.3f} "
                             f"| {100 * v['median']:+.2f}% [{100 * low:+.1f}, {100 * high:+.1f}] ({v['pairs']}) "
                             f"| `{variant['source']}` ({variant['device']}, transformers {variant['transformers']}) |")
    devices = "; ".join(f"{name}: {run.get('device', '?')}, transformers {run.get('versions', {}).get('transformers', '?')}"
                        for name, run in summary["runs"].items())
    return "\n".join(lines + ["", f"Devices: {devices}.", "", READING]) + "\n"


READING = (
    "Reading the step times: where `run_arguments` name one phase, each phase ran in its own process "
    "(7 timed steps after 3 warm-up); on these shared hosts the same work moved by tens of percent between "
    "processes (compare the unpatched `full` and `lora` rows of one engine), so a step-time ratio between "
    "two such phases is not a measurement of the PDE: the paired rounds are (their files: `paired_source` in "
    "distributed.json). At 4 x 1024 tokens per GPU a sharded step waits on the host (compare FSDP2's step "
    "time at twice the tokens per GPU, in the table above), so what a site adds there is its host time "
    "(`train_site_time.py` of commit b7e044a; now `bench_train_step.py`: "
    "[`train_site_time_NVIDIA_H200.json`](../benchmarks/results/train_site_time_NVIDIA_H200.json), "
    "[`..._profile.txt`](../benchmarks/results/train_site_time_NVIDIA_H200_profile.txt)), which the "
    "one-GPU step hides. "
    "DeepSpeed's bf16 mode keeps the weights themselves in bf16 (the reference and FSDP2 keep fp32 weights), "
    "which moves the fast-falling unpatched full fine-tune out of the tolerance band in its middle steps.")


def write_summary(results_dir, reference):
    """``<results_dir>/distributed.json`` / ``.md``: every multi-process run against the one-process reference."""
    summary = summarize(results_dir, reference)
    with open(os.path.join(results_dir, "distributed.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = render_md(summary)
    with open(os.path.join(results_dir, "distributed.md"), "w") as f:
        f.write(text)
    print(text)
    return summary


if __name__ == "__main__":
    main()
