"""What the benchmarks share: the check that a GPU is there (kernels compiled, not interpreted), the kernel launch
they time, the writing of a result's ``.json`` / ``.md`` pair, per-token paired decoding, a ``generate()`` streamer
that times its tokens, the bootstrap interval of a median and the plot of per-round overheads."""

import json
import os
import statistics
import sys
import time

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


class TokenClock:
    """A ``generate()`` streamer (transformers' ``BaseStreamer`` interface) that records when each token arrives
    (generate hands it the tokens on the host, so each arrival follows a synchronisation)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def median_step(self):
        """The median time between decoded tokens (the first two puts are the prompt and the prefill's token)."""
        return statistics.median(b - a for a, b in zip(self.times[1:], self.times[2:]))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bootstrap_median(values, resamples=2000, seed=0):
    """A 95% interval of the median of ``values`` (percentile bootstrap)."""
    import random

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples)]


def paired_decode(patched, unpatched, prompt, tokens, pairs_wanted, device, mask=False):
    """Per-token pairs ``(unpatched_s, patched_s)`` of greedy decoding: both models prefill ``prompt``, then each token
    is decoded by one model and then the other (the order alternating), each step synchronised and timed by itself,
    as ``generate()`` synchronises once per token. Host speed drifts over seconds; two steps a few milliseconds apart
    see the same host. Passes of ``tokens`` tokens from the prompt, after one untimed pass: every cache length then
    has been seen before (sdpa's cuDNN backend builds a plan per new length, which costs tens of milliseconds the
    first time). ``mask``: pass an all-ones attention mask with every step, as ``generate()`` does."""
    passes = 1 + -(-pairs_wanted // tokens)
    ones = torch.ones(prompt.shape[0], prompt.shape[1] + tokens, dtype=torch.long, device=prompt.device)
    pairs = []
    with torch.no_grad():
        for p in range(passes):
            states = {}
            for name, model in (("unpatched", unpatched), ("patched", patched)):
                out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
                states[name] = [model, out.past_key_values, out.logits[:, -1:].argmax(-1)]
            for t in range(tokens):
                step = {}
                for name in ("unpatched", "patched") if t % 2 == 0 else ("patched", "unpatched"):
                    model, cache, token = states[name]
                    step_mask = ones[:, : prompt.shape[1] + t + 1] if mask else None
                    _sync(device)
                    start = time.perf_counter()
                    out = model(input_ids=token, past_key_values=cache, use_cache=True, attention_mask=step_mask)
                    states[name][2] = out.logits[:, -1:].argmax(-1)
                    _sync(device)
                    step[name] = time.perf_counter() - start
                if p > 0:
                    pairs.append((step["unpatched"], step["patched"]))
    return pairs[:pairs_wanted]


def run_command(doc: str, commands: dict):
    """A multi-mode script's ``main``: runs ``commands[sys.argv[1]]`` on the remaining arguments, else prints ``doc``
    (exit 0 for ``-h`` / ``--help``, 2 otherwise)."""
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(doc)
        raise SystemExit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    commands[sys.argv[1]](sys.argv[2:])


def plot_rounds(path: str, title: str, series: dict, target=None) -> None:
    """A strip plot of per-round overheads (%): ``series`` maps a label to ``(rounds, median, [low, high])``, drawn as
    the rounds' dots, the median and its 95% interval; ``target`` a dashed line. Writes ``path`` (PNG); without
    matplotlib it says so and draws nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(2.4 + 1.5 * len(series), 3.8))
    for i, (label, (rounds, median, (low, high))) in enumerate(series.items()):
        jitter = [i + 0.25 * ((k * 0.618) % 1 - 0.5) for k in range(len(rounds))]
        ax.scatter(jitter, rounds, s=8, alpha=0.45, color="tab:blue")
        ax.errorbar([i], [median], yerr=[[median - low], [high - median]], fmt="o", color="k", capsize=6)
        ax.annotate(f"{median:+.2f}%", (i + 0.18, median), fontsize=8, va="center")
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", linewidth=1, label=f"target {target:g}%")
        ax.legend(fontsize=8, loc="upper right")
    ax.axhline(0, color="0.6", linewidth=0.8)
    ax.set_xticks(range(len(series)), list(series), fontsize=8)
    ax.set_xlim(-0.6, len(series) - 0.2)
    ax.set_ylabel("decode-step overhead per round (%)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
