#!/usr/bin/env python
"""Compare the loss curves and throughput of runs of the same config (e.g. 1 process vs
``accelerate launch --num_processes 2``) and write NAME.json / NAME.md / NAME.png (numbers in the .md come from
the .json).

    python examples/compare_runs.py --runs runs/ddp1 runs/ddp2 --labels "1 GPU" "2 GPUs (DDP)" --name ddp_2gpu
"""

import argparse
import json
import math
import os


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="run output dirs holding run_results.json")
    parser.add_argument("--labels", nargs="+", required=True)
    parser.add_argument("--name", default="ddp_2gpu")
    parser.add_argument("--output_dir", default="results")
    parser.add_argument("--command", default="", help="the commands that produced the runs (recorded)")
    args = parser.parse_args(argv)
    runs = []
    for path, label in zip(args.runs, args.labels):
        with open(os.path.join(path, "run_results.json")) as f:
            r = json.load(f)
        runs.append(dict(label=label, world_size=r.get("world_size"), device=r.get("device"),
                         per_device_train_batch_size=r.get("per_device_train_batch_size"),
                         global_steps=r.get("global_steps"), train_runtime=r.get("train_runtime"),
                         train_samples_per_second=r.get("train_samples_per_second"),
                         train_tokens_per_second=r.get("train_tokens_per_second"),
                         final_metric={k: r.get(k) for k in ("test_perplexity", "eval_perplexity", "eval_accuracy")
                                       if r.get(k) is not None},
                         leak_check_passed=(r.get("leak_check") or {}).get("passed"),
                         loss_history=r.get("loss_history", [])))
    base = runs[0]["loss_history"]
    for run in runs[1:]:
        pairs = [(a["loss"], b["loss"]) for a, b in zip(base, run["loss_history"]) if a["step"] == b["step"]]
        diffs = [abs(a - b) for a, b in pairs]
        run["max_abs_loss_diff_vs_first"] = max(diffs) if diffs else None
        run["mean_abs_loss_diff_vs_first"] = sum(diffs) / len(diffs) if diffs else None
        tail = pairs[len(pairs) // 2:]
        run["mean_loss_second_half"] = sum(b for _, b in tail) / len(tail) if tail else None
    if base:
        runs[0]["mean_loss_second_half"] = sum(h["loss"] for h in base[len(base) // 2:]) / len(base[len(base) // 2:])
    data = dict(name=args.name, runs=runs, command=args.command)
    os.makedirs(args.output_dir, exist_ok=True)
    out = os.path.join(args.output_dir, args.name)
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=2)
    lines = [f"# {args.name}: same config, different process counts", "",
             "| run | processes | per-device batch | steps | train s | samples/s | tokens/s | mean loss (2nd half) | "
             "max abs loss diff vs first | final metric |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        fmt = lambda x, d=3: "" if x is None else f"{x:.{d}f}"  # noqa: E731
        lines.append(f"| {r['label']} | {r['world_size']} | {r['per_device_train_batch_size']} | {r['global_steps']} | "
                     f"{fmt(r['train_runtime'], 1)} | {fmt(r['train_samples_per_second'], 1)} | "
                     f"{fmt(r['train_tokens_per_second'], 0)} | {fmt(r['mean_loss_second_half'])} | "
                     f"{fmt(r.get('max_abs_loss_diff_vs_first'))} | "
                     f"{', '.join(f'{k} {v:.3f}' for k, v in r['final_metric'].items())} |")
    lines += ["", f"Devices: {sorted({str(r['device']) for r in runs})}.", "", f"Command: `{args.command}`", ""]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            ax.plot([h["step"] for h in r["loss_history"]], [h["loss"] for h in r["loss_history"]], label=r["label"])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.legend()
        ax.set_title(args.name)
        fig.tight_layout()
        fig.savefig(out + ".png", dpi=120)
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", exc)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
