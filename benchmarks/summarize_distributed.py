#!/usr/bin/env python
"""Compares the sharded runs of bench_distributed.py with the one-process run: results/distributed.{json,md,png}.

    python benchmarks/summarize_distributed.py [--results_dir results] [--reference distributed_single_1gpu]

Reads every ``<results_dir>/distributed_<engine>_<N><gpu|cpu>.json`` of more than one process and the reference
(one process, same global batch, same seed). For each engine and phase: per-step loss difference against the
reference, PDE coefficients moved, the saved checkpoint reloaded with equal weights, cached == uncached greedy
generation, step time patched vs unpatched (the PDE's overhead) and peak memory per GPU.

Loss tolerance: |loss - reference| <= LOSS_RTOL * reference + LOSS_ATOL at every step. Why 1%: the runs compute in bf16 (unit
roundoff 2**-9 = 0.2%); sharding changes the order of every reduction (gradient reduce-scatter / all-reduce in
bf16, per-shard loss means), and DeepSpeed's bf16 mode keeps the weights themselves in bf16 (the reference and FSDP2
keep fp32 weights under autocast / a bf16 compute policy), so step 0 already differs by a few roundoffs, and AdamW's
normalised updates turn gradient differences in near-zero coordinates into lr-sized weight differences that grow
over the steps. A wrong global batch (a rank's shard missing or counted twice) or a missed gradient reduction moves
the loss by far more than 1% within a few steps (the fixed batch is memorised quickly). Why 0.01 nats on top: a
full fine-tune memorises the batch down to a loss near 0.06, where the same few-roundoff weight differences are a
large fraction of a tiny number (FSDP2: 0.0614 vs 0.0636); a missing shard there costs whole nats.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (results_io, beside this script)
LOSS_RTOL = 0.01
LOSS_ATOL = 0.01
OVERHEAD_TARGET = 0.05
NAME = re.compile(r"distributed_(?P<engine>[a-z0-9]+)_(?P<n>\d+)(?P<unit>gpu|cpu)\.json$")
ENGINE_LABEL = {"fsdp2": "FSDP2", "fsdp1": "FSDP1", "zero3": "DeepSpeed ZeRO-3", "zero2": "DeepSpeed ZeRO-2",
                "ddp": "DDP", "single": "one process"}


def load_runs(results_dir):
    """Every run file by stem. A ``<stem>_overhead.json`` (a short run of the same engine with ``--overhead_rounds``
    and ``--no_save``) lends its paired PDE-overhead fields to the phases of ``<stem>``, naming itself as their
    source."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "distributed_*.json"))):
        match = NAME.search(os.path.basename(path))
        if match:
            with open(path) as f:
                runs[os.path.basename(path)[:-5]] = json.load(f)
    for stem, run in runs.items():
        path = os.path.join(results_dir, stem + "_overhead.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            timing = json.load(f)
        for phase, record in timing["phases"].items():
            if phase in run["phases"] and "paired_step_overhead_median" in record:
                run["phases"][phase].update({k: v for k, v in record.items() if k.startswith("paired_")},
                                            paired_source=os.path.basename(path))
                run["phases"][phase]["paired_step_overhead_ci95"] = paired_overhead_ci(record)
        # The same paired measurement at other per-GPU batches (distributed_gpu.sh overhead with SUFFIX=_<tag>)
        run["overhead_variants"] = [overhead_variant(path) for path in
                                    sorted(glob.glob(os.path.join(results_dir, stem + "_overhead_*.json")))]
    return runs


def overhead_variant(path):
    """A ``<stem>_overhead_<tag>.json`` file's paired overheads by phase, with the tokens per GPU they ran at."""
    with open(path) as f:
        timing = json.load(f)
    phases = {phase: {"median": record["paired_step_overhead_median"], "ci95": paired_overhead_ci(record),
                      "pairs": record["paired_rounds"] - 2, "step_seconds_median": record["step_seconds_median"]}
              for phase, record in timing["phases"].items() if "paired_step_overhead_median" in record}
    return {"source": os.path.basename(path), "per_process_batch": timing["per_process_batch"],
            "seq_len": timing["seq_len"], "device": timing.get("device"),
            "transformers": timing.get("versions", {}).get("transformers"), "phases": phases}


def paired_overhead_ci(record):
    """Bootstrap 95% interval of the median per-pair ratio (on / off - 1) of a paired-rounds record, its first two
    rounds left out as ``bench_distributed`` does: single steps on a shared host scatter by tens of percent, so the
    median of many pairs and its interval are what can be compared with the target."""
    from results_io import bootstrap_median

    ratios = [a / b - 1 for a, b in zip(record["paired_step_seconds_on"], record["paired_step_seconds_off"])][2:]
    return list(bootstrap_median(ratios, resamples=10000))


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
                       loss_step0_rel_diff=rel[0], losses_match=all(d <= LOSS_RTOL * abs(b) + LOSS_ATOL for d, b in zip(diffs, ref["losses"])))
        for key in ("pde_coefficients", "pde_all_moved", "reload_weights_equal", "generate_cached_equals_uncached",
                    "step_overhead_vs_full", "step_overhead_vs_lora", "paired_step_overhead_median",
                    "paired_step_overhead_range", "paired_step_overhead_ci95", "paired_rounds", "paired_source"):
            if key in record:
                row[key] = record[key]
        rows.append(row)
    return rows


def summarize(results_dir, reference_name):
    runs = load_runs(results_dir)
    if reference_name not in runs:
        raise SystemExit(f"--reference: {reference_name}.json is not in {results_dir} (have: {sorted(runs)}).")
    reference = runs[reference_name]
    engines = {name: run for name, run in runs.items() if run["num_processes"] > 1}
    summary = {"loss_rtol": LOSS_RTOL, "loss_atol": LOSS_ATOL, "overhead_target": OVERHEAD_TARGET, "reference": reference_name,
               "reference_device": reference["device"], "mixed_precision": reference["mixed_precision"],
               "device_type": reference["device_type"], "model_shape": reference["model_shape"],
               "global_batch": reference["global_batch"], "seq_len": reference["seq_len"],
               "steps": reference["steps"], "patch": reference["patch"],
               "runs": {name: {"engine": run["engine"], "num_processes": run["num_processes"],
                               "device": run["device"], "versions": run.get("versions", {}), "per_process_batch": run["per_process_batch"],
                               "phases": compare(run, reference),
                               "overhead_variants": run.get("overhead_variants", [])} for name, run in engines.items()},
               "reference_phases": compare(reference, reference)}
    return summary, runs


def fmt_overhead(row):
    """The paired measurement (PDE sites on / off in the same process) where the run made one, else patched /
    unpatched phase (separate processes where each phase ran in its own)."""
    if "paired_step_overhead_median" in row:
        low, high = row.get("paired_step_overhead_ci95", row["paired_step_overhead_range"])
        return (f"{100 * row['paired_step_overhead_median']:+.2f}% [{100 * low:+.1f}, {100 * high:+.1f}] paired "
                f"({row['paired_rounds'] - 2})")
    value = row.get("step_overhead_vs_full", row.get("step_overhead_vs_lora"))
    return "" if value is None else f"{100 * value:+.2f}%"


def yes_no(value):
    return "" if value is None else ("yes" if value else "**no**")


def render_md(summary):
    shape = summary["model_shape"]
    params = next((r for r in summary["reference_phases"] if r["phase"] == "full"), None)
    lines = [
        "# Sharded training vs one process (`benchmarks/bench_distributed.py`)",
        "",
        f"Llama-shaped model: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, intermediate "
        f"{shape['intermediate_size']}, vocab {shape['vocab_size']}, random init (fixed seed); {summary['mixed_precision']} mixed precision; global batch "
        f"{summary['global_batch']} x {summary['seq_len']} tokens (the same at every process count), "
        f"{summary['steps']} steps. Patched: `cta.patch_model(pde_type={summary['patch']['pde_type']!r}, "
        f"pde_steps={summary['patch']['pde_steps']}, placement={summary['patch']['placement']!r}, "
        f"init={summary['patch']['init']!r})`, default (scalar) coefficients. Reference: "
        f"`{summary['reference']}` ({summary['reference_device']}). Loss tolerance: every step within "
        f"{100 * summary['loss_rtol']:.0f}% + {summary['loss_atol']} nats of the reference (for bf16 runs; see the docstring of "
        f"`benchmarks/summarize_distributed.py` for why). Step time: "
        f"median after warm-up. PDE overhead (target <= {100 * summary['overhead_target']:.0f}%): where it says "
        f"*paired*, the median [bootstrap 95% interval] (pairs) over rounds of one step with the PDE sites on / one with them off (`steps = 0`: "
        f"each site still called), in the same process, engine and model (`--overhead_rounds`, the first two rounds "
        f"left out); otherwise patched / unpatched phase - 1.",
        "",
        f"| engine | {summary['device_type'].upper()}s | phase | loss step 0 -> last (reference) | max rel. diff | match | PDE moved | reload equal "
        "| cached == uncached | step s | PDE overhead | peak GiB / GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tables = [("one process (reference)", 1, summary["reference_phases"])]
    tables += [(ENGINE_LABEL.get(r["engine"], r["engine"]), r["num_processes"], r["phases"])
               for r in summary["runs"].values()]
    for label, n, rows in tables:
        for row in rows:
            ref = row.get("reference_losses", row["losses"])
            losses = f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}"
            if n > 1:
                losses += f" ({ref[0]:.4f} -> {ref[-1]:.4f})"
            peak = ", ".join(f"{v:.1f}" for v in row["peak_memory_gib_per_gpu"])
            rel = f"{100 * row['loss_max_rel_diff']:.2f}%" if n > 1 and "loss_max_rel_diff" in row else ""
            lines.append(
                f"| {label} | {n} | {row['phase']} | {losses} | {rel} | {yes_no(row.get('losses_match')) if n > 1 else ''} "
                f"| {yes_no(row.get('pde_all_moved'))} | {yes_no(row.get('reload_weights_equal'))} "
                f"| {yes_no(row.get('generate_cached_equals_uncached'))} | {row['step_seconds_median']:.3f} "
                f"| {fmt_overhead(row)} | {peak} |")
    if params:
        lines += ["", f"Phases: `full` / `full_pde` = full fine-tune unpatched / patched; `lora` / `lora_pde` = LoRA "
                      f"unpatched / LoRA + PDE coefficients (`modules_to_save`); `native` = `cta.CTAForCausalLM` "
                      f"(`CTAConfig.modern_decoder`) of the same shape. Rendered by "
                      f"`python benchmarks/summarize_distributed.py` from `results/distributed_*.json`."]
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
    lines += ["", f"Devices: {devices}.", "",
              "Reading the step times: where `run_arguments` name one phase, each phase ran in its own process "
              "(7 timed steps after 3 warm-up); on these shared hosts the same work moved by tens of percent between "
              "processes (compare the unpatched `full` and `lora` rows of one engine), so a step-time ratio between "
              "two such phases is not a measurement of the PDE: the paired rounds are (their files: `paired_source` in "
              "distributed.json). At 4 x 1024 tokens per GPU a sharded step waits on the host (compare FSDP2's step "
              "time at twice the tokens per GPU, in the table above), so what a site adds there is its host time "
              "(`benchmarks/train_site_time.py`: "
              "[`train_site_time_NVIDIA_H200.json`](../benchmarks/results/train_site_time_NVIDIA_H200.json), "
              "[`..._profile.txt`](../benchmarks/results/train_site_time_NVIDIA_H200_profile.txt)), which the "
              "one-GPU step hides. "
              "DeepSpeed's bf16 mode keeps the weights themselves in bf16 (the reference and FSDP2 keep fp32 weights), "
              "which moves the fast-falling unpatched full fine-tune out of the tolerance band in its middle steps."]
    return "\n".join(lines) + "\n"


def plot(summary, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in ("full_pde", "lora_pde", "native") if any(p in r["phases"] for r in runs.values())]
    fig = plt.figure(figsize=(4.2 * max(len(phases), 2), 7.6))
    grid = fig.add_gridspec(2, len(phases))
    axes = [fig.add_subplot(grid[0, i]) for i in range(len(phases))] + [fig.add_subplot(grid[1, :])]
    reference = runs[summary["reference"]]
    for ax, phase in zip(axes, phases):
        if phase in reference["phases"]:
            ax.plot(reference["phases"][phase]["losses"], "k-", lw=2, label=f"1 {reference['device_type'].upper()}")
        for name in summary["runs"]:
            run = runs[name]
            if phase in run["phases"]:
                ax.plot(run["phases"][phase]["losses"], "--", marker=".",
                        label=f"{ENGINE_LABEL.get(run['engine'], run['engine'])}, {run['num_processes']} "
                              f"{run['device_type'].upper()}s")
        ax.set_title(f"loss: {phase}")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    ax = axes[-1]
    bars = []  # (label, median, (low, high)) of every paired overhead: each run's own batch, then its variants
    for name in [summary["reference"], *summary["runs"]]:
        run = runs[name]
        engine = f"{ENGINE_LABEL.get(run['engine'], run['engine'])}, {run['num_processes']} {run['device_type'].upper()}s"
        for phase in phases:
            record = run["phases"].get(phase, {})
            if "paired_step_overhead_median" in record:
                median = record["paired_step_overhead_median"]
                bars.append((f"{engine}: {phase}, {run['per_process_batch']} x {run['seq_len']} / GPU", median,
                             record.get("paired_step_overhead_ci95", (median, median))))
        for variant in run.get("overhead_variants", []):
            bars += [(f"{engine}: {phase}, {variant['per_process_batch']} x {variant['seq_len']} / GPU", v["median"],
                      v["ci95"]) for phase, v in variant["phases"].items()]
    labels = [label for label, _, _ in bars]
    overheads = [100 * median for _, median, _ in bars]
    errors = [[100 * (median - low) for _, median, (low, _) in bars],
              [100 * (high - median) for _, median, (_, high) in bars]]
    if overheads:
        ax.barh(range(len(labels)), overheads, xerr=errors, capsize=3, color="tab:orange")
        ax.axvline(100 * OVERHEAD_TARGET, color="k", ls=":", label=f"target {100 * OVERHEAD_TARGET:.0f}%")
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("PDE step overhead (%): median of paired steps (sites on / off), bootstrap 95% interval")
        ax.legend(fontsize=7)
    ax.set_title("PDE share of a training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results_dir", default=os.path.join(REPO_ROOT, "results"))
    parser.add_argument("--reference", default="distributed_single_1gpu",
                        help="Stem of the one-process run (default distributed_single_1gpu).")
    parser.add_argument("--output", default="distributed", help="Output stem under --results_dir.")
    args = parser.parse_args(argv)
    summary, runs = summarize(args.results_dir, args.reference)
    stem = os.path.join(args.results_dir, args.output)
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(render_md(summary))
    plot(summary, runs, stem + ".png")
    print(open(stem + ".md").read())
    return summary


if __name__ == "__main__":
    main()
