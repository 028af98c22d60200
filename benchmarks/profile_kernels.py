"""Hardware counters of the streaming kernels (diffusion), through Nsight Compute: where each kernel's time goes.

Runs itself under ``ncu`` (``--clock-control none``: the clocks are left alone), which profiles one launch of each
case's streaming kernel, and writes ``benchmarks/results/kernel_profile_<gpu>.txt``: per case, the launch
configuration, the time, instructions issued per element (and the filter's fp32 adds and multiply-adds among them),
the share of cycles that issued, occupancy, DRAM throughput, and the warp stall reasons (cycles per issued
instruction; the ones above 0.05).

    python benchmarks/profile_kernels.py                                   # per-channel coefficient, 1x16384x4096
    python benchmarks/profile_kernels.py --cases fwd:bidi:8,bwd:causal:8 --shape 8x4096x4096 --scalar

A case is ``kernel:mode:steps`` (kernel ``fwd`` or ``bwd``, mode ``bidi`` or ``causal``).
"""

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from results_io import diffusion_launch, on_gpu, parse_case  # noqa: E402  (beside this script)

METRICS = [
    "gpu__time_duration.sum",
    "smsp__thread_inst_executed.sum",
    "sm__sass_thread_inst_executed_op_ffma_pred_on.sum",
    "sm__sass_thread_inst_executed_op_fadd_pred_on.sum",
    "sm__sass_thread_inst_executed_op_fmul_pred_on.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
]
STALLS = "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="fwd:bidi:8,bwd:bidi:8,fwd:bidi:4,bwd:bidi:4",
                   help="comma list of kernel:mode:steps (kernel fwd|bwd, mode bidi|causal)")
    p.add_argument("--shape", default="1x16384x4096", help="BxLxC")
    p.add_argument("--scalar", action="store_true", help="a scalar coefficient instead of one per channel")
    p.add_argument("--name", default="kernel_profile", help="output file stem (<name>_<gpu>.txt)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--launch-only", action="store_true", help=argparse.SUPPRESS)  # (the run that ncu profiles)
    return p.parse_args()


def _cases(text):
    return [parse_case(case) for case in text.split(",")]


def launch(args):
    """Each case's launch twice (compiles and warms up), then once more between cudaProfilerStart and Stop."""
    shape = tuple(int(v) for v in args.shape.split("x"))
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    alpha = torch.full(() if args.scalar else (shape[-1],), 0.2, device="cuda")
    calls = [diffusion_launch(kind, x, alpha, grad, steps, causal) for kind, causal, steps in _cases(args.cases)]
    for call in calls:
        call()
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _ncu():
    found = shutil.which("ncu")
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for dirpath, _, files in os.walk(root):
            if "ncu" in files:
                return os.path.join(dirpath, "ncu")
    return None


def main():
    args = parse_args()
    if not on_gpu():
        return 1
    if args.launch_only:
        launch(args)
        return 0
    ncu = _ncu()
    if ncu is None:
        print("profile_kernels.py needs Nsight Compute (ncu) on the PATH.")
        return 1
    own = ["--cases", args.cases, "--shape", args.shape]
    own += ["--scalar"] if args.scalar else []
    command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", "regex:_cta_stream",
               "--csv", "--print-units", "base", "--metrics", ",".join(METRICS + [STALLS]),
               sys.executable, os.path.abspath(__file__), "--launch-only", *own]
    done = subprocess.run(command, capture_output=True, text=True)
    table = [line for line in done.stdout.splitlines() if line.startswith('"')]
    if done.returncode != 0 or not table:
        print(done.stdout[-3000:], done.stderr[-3000:])
        return 1
    kernels = {}
    for row in csv.DictReader(io.StringIO("\n".join(table))):
        entry = kernels.setdefault(int(row["ID"]), {"name": row["Kernel Name"], "grid": row["Grid Size"],
                                                    "block": row["Block Size"]})
        try:
            entry[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except ValueError:  # (a metric this GPU does not report)
            entry[row["Metric Name"]] = float("nan")
    shape = tuple(int(v) for v in args.shape.split("x"))
    elements = shape[0] * shape[1] * shape[2]
    gpu = torch.cuda.get_device_name()
    lines = [f"# {gpu}, torch {torch.__version__}, triton {__import__('triton').__version__}; shape {args.shape} "
             f"bfloat16, {'scalar' if args.scalar else 'per-channel'} coefficient",
             "# command: python benchmarks/profile_kernels.py " + " ".join(sys.argv[1:])]
    for (kind, causal, steps), (_, k) in zip(_cases(args.cases), sorted(kernels.items())):
        per_element = lambda metric: k[metric] / elements  # noqa: E731
        lines += [
            f"{kind} {'causal' if causal else 'bidirectional'} {steps} steps: {k['name']} grid {k['grid']} "
            f"block {k['block']}, {k['launch__registers_per_thread']:.0f} registers",
            f"  time {k['gpu__time_duration.sum'] / 1e3:.1f} us; issued "
            f"{per_element('smsp__thread_inst_executed.sum'):.1f} instructions per element "
            f"(fp32 add {per_element('sm__sass_thread_inst_executed_op_fadd_pred_on.sum'):.2f}, "
            f"multiply-add {per_element('sm__sass_thread_inst_executed_op_ffma_pred_on.sum'):.2f}, "
            f"multiply {per_element('sm__sass_thread_inst_executed_op_fmul_pred_on.sum'):.2f})",
            f"  issue active {k['smsp__issue_active.avg.pct_of_peak_sustained_active']:.1f}%, warps active "
            f"{k['sm__warps_active.avg.pct_of_peak_sustained_active']:.1f}% of the peak, DRAM "
            f"{k['dram__throughput.avg.pct_of_peak_sustained_elapsed']:.1f}% of the peak",
            "  stalls (cycles per issued instruction): " + ", ".join(
                f"{name.replace('smsp__average_warps_issue_stalled_', '').replace('_per_issue_active.ratio', '')} "
                f"{value:.2f}" for name, value in sorted(k.items(), key=lambda item: str(item[0]))
                if name.startswith("smsp__average_warps_issue_stalled_") and value > 0.05),
        ]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}_{gpu.replace(' ', '_')}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
