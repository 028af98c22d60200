"""Host and GPU time of one PDE site in a training step (forward + backward), PDE on vs the same site with
``steps = 0`` (what ``bench_distributed --overhead_rounds`` compares), on one GPU.

    python benchmarks/train_site_time.py [--out DIR]

For the coefficient dtypes a sharded run gives the site (fp32 master weights under autocast; bf16 under FSDP2's
bf16 parameter policy or DeepSpeed's bf16 mode), on a ``[4, 1024, 2048]`` bf16 activation (the per-GPU share of the
2-GPU runs): host time per call = wall time of ``--calls`` forward + backward calls issued without synchronising
(the queue does not fill), GPU time = wall time until they finish, divided by the calls. A cProfile of the PDE-on
calls shows where the host time goes. Writes ``train_site_time_<device>.json`` and ``..._profile.txt`` into --out.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

# CTA_TREE: another checkout's root (compare two versions in one session on the same machine)
sys.path.insert(0, os.environ.get("CTA_TREE") or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cta.pde_cta import PDERefinement  # noqa: E402


def timed(site, x, calls):
    """(host seconds, wall seconds) per forward + backward call."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        site(x).sum().backward()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls, (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.randn(4, 1024, 2048, device=device, dtype=torch.bfloat16, requires_grad=True)
    import cta

    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cta_tree": os.path.dirname(
               os.path.dirname(os.path.abspath(cta.__file__))), "shape": list(x.shape),
               "calls": args.calls, "rounds": args.rounds, "cases": {}}
    for param_dtype in (torch.float32, torch.bfloat16):
        site = PDERefinement(2048, "diffusion", steps=4, causal=True, alpha=0.25).to(device, param_dtype)
        rows = {"on": [], "off": []}
        for _ in range(args.rounds):  # alternating, medians over rounds
            for mode in ("on", "off"):
                site.steps = 4 if mode == "on" else 0
                rows[mode].append(timed(site, x, args.calls))
        site.steps = 4
        case = {mode: {"host_us": 1e6 * statistics.median(h for h, _ in r),
                       "wall_us": 1e6 * statistics.median(w for _, w in r)}
                for mode, r in rows.items()}
        case["added_host_us"] = case["on"]["host_us"] - case["off"]["host_us"]
        case["added_wall_us"] = case["on"]["wall_us"] - case["off"]["wall_us"]
        results["cases"][str(param_dtype).replace("torch.", "")] = case
        print(str(param_dtype), json.dumps(case))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            site(x).sum().backward()
        torch.cuda.synchronize()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        results["cases"][str(param_dtype).replace("torch.", "")]["profile"] = text.getvalue()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "train_site_time_" + results["device"].replace(" ", "_"))
    with open(stem + "_profile.txt", "w") as f:
        for name, case in results["cases"].items():
            f.write(f"## params {name}, {args.calls} forward+backward calls\n{case.pop('profile')}\n")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", stem + ".json")


if __name__ == "__main__":
    main()
