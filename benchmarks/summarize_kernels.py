"""The SPEC §6 target cells of a kernel benchmark JSON as a short markdown table (for the README).

    python benchmarks/summarize_kernels.py benchmarks/results/kernels_NVIDIA_H200.json   # writes ..._targets.md
"""

import json
import sys
from pathlib import Path

TARGETS = {"fwd": 1.25, "fwdbwd": 3.0, "saved": 1.1}
LARGE_SHAPES = ([1, 4096, 4096], [1, 16384, 4096], [8, 4096, 4096])


def summarize(path: Path) -> str:
    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = [
        f"Diffusion, {meta['dtype']}, {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']}): time as a multiple "
        "of `y.copy_(x)` of the same tensor, and bytes kept for backward / input bytes. "
        f"Targets: forward <= {TARGETS['fwd']}x, forward+backward <= {TARGETS['fwdbwd']}x, memory <= {TARGETS['saved']}x "
        "(✓ met, ✗ missed). PyTorch reference forward for scale.",
        "",
        "| shape | steps | mode | forward | fwd+bwd | saved | reference fwd |",
        "|---|---|---|---|---|---|---|",
    ]
    met = total = 0
    for row in data["rows"]:
        if row["pde_type"] != "diffusion" or row["shape"] not in LARGE_SHAPES or row["steps"] > 8:
            continue
        cells = []
        for key, value in (("fwd", row["triton_fwd_x_copy"]), ("fwdbwd", row["triton_fwdbwd_x_copy"]),
                           ("saved", row["triton_saved_x"])):
            ok = value <= TARGETS[key]
            met, total = met + ok, total + 1
            cells.append(f"{value:.2f}x {'✓' if ok else '✗'}")
        shape = "x".join(map(str, row["shape"]))
        mode = "causal" if row["causal"] else "bidirectional"
        lines.append(f"| {shape} | {row['steps']} | {mode} | {' | '.join(cells)} | {row['torch_fwd_x_copy']:.1f}x |")
    lines += ["", f"{met} of {total} target cells met. Full sweep (every PDE type, 4 shapes): `{path.name[:-5]}.md`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/kernels_NVIDIA_H200.json")
    target = source.with_name(source.stem + "_targets.md")
    target.write_text(summarize(source))
    print(f"wrote {target}")
