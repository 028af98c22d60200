"""What the benchmarks share: the check that a GPU is there (kernels compiled, not interpreted), the kernel launch
they time, and the writing of a result's ``.json`` / ``.md`` pair."""

import json
import os
import sys

import torch


def on_gpu() -> bool:
    """True when a CUDA GPU is there (and the kernels will be compiled, not run by Triton's interpreter); otherwise
    prints that the calling script needs one."""
    if not torch.cuda.is_available():
        print(f"{os.path.basename(sys.argv[0])} needs a CUDA GPU.")
        return False
    os.environ.pop("TRITON_INTERPRET", None)
    return True


def parse_case(case: str):
    """``kernel:mode:steps`` (kernel fwd|bwd, mode bidi|causal) as ``(kernel, causal, steps)``."""
    parts = case.split(":")
    if len(parts) != 3 or parts[0] not in ("fwd", "bwd") or parts[1] not in ("bidi", "causal"):
        raise SystemExit(f"{case!r} is not kernel:mode:steps with kernel fwd|bwd and mode bidi|causal")
    return parts[0], parts[1] == "causal", int(parts[2])


def diffusion_launch(kind: str, x, alpha, grad, steps: int, causal: bool):
    """One streaming kernel launch as the benchmarks time it, a call without arguments: diffusion, no padding mask,
    the forward (``kind`` 'fwd', no final state) or the backward ('bwd': the input and alpha gradients, no beta's, as
    eager autograd runs it without a beta)."""
    from cta.kernels_launch import launch_backward, launch_forward

    if kind == "fwd":
        return lambda: launch_forward(x, alpha, None, None, None, "diffusion", steps, causal, False)
    return lambda: launch_backward(grad, x, alpha, None, None, None, "diffusion", steps, causal, need_db=False)


def write_result_files(stem: str, info: dict, lines) -> None:
    """Writes ``info`` to ``<stem>.json`` and the markdown ``lines`` to ``<stem>.md``, ending with the command that
    reproduces them (``info["command"]``), and prints the markdown."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    text = "\n".join([*lines, "", f"Reproduce: `{info['command']}`", ""])
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
