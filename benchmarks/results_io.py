"""What the benchmark scripts share (not a benchmark): ``sync()``, the GPU check, the model-level Llama, per-token
paired decoding, clocks of a call and of ``generate()``'s tokens, a median's bootstrap interval, result files, plots."""

import json
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)  # the scripts import this module first: then `import cta` finds the repository's


def sync(device=None):
    """Waits for a CUDA device's queued work (no-op on the CPU): every wall-clock timing here calls it."""
    if torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda":
        torch.cuda.synchronize(device)


def clocked(fn, device=None) -> float:
    """Seconds of one call of ``fn``, synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def on_gpu(script: str) -> bool:
    """True on a CUDA GPU (kernels then compile, not interpreted); otherwise prints that ``script`` needs one."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU.")
        return False
    os.environ.pop("TRITON_INTERPRET", None)
    return True


def device_name(device) -> str:
    """The GPU's name as result files spell it (``NVIDIA_H200``), or ``cpu``."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device).replace(" ", "_").replace("/", "_") if device.type == "cuda" else "cpu"


def llama_model(layers, hidden, vocab, device, dtype, intermediate=None, max_positions=32768):
    """The model-level benchmarks' random Llama (seed 0, heads of 128, MLP 11008/4096 of ``hidden``, sdpa, eval)."""
    import transformers

    intermediate = intermediate or int(round(11008 * hidden / 4096 / 64)) * 64
    heads = max(1, hidden // 128)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=max_positions, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(dtype).eval()


class TokenClock:
    """A ``generate()`` streamer recording when each token arrives (on the host: after a synchronisation)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def median_step(self):
        """The median time between decoded tokens (the first two puts: the prompt and the prefill's token)."""
        return statistics.median(b - a for a, b in zip(self.times[1:], self.times[2:]))


def bootstrap_median(values, resamples=2000, seed=0):
    """A 95% interval of the median of ``values`` (percentile bootstrap)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples)]


def paired_decode(patched, unpatched, prompt, tokens, pairs_wanted, mask=False):
    """Per-token pairs ``(unpatched_s, patched_s)`` of greedy decoding after both prefill ``prompt``, each token by one
    model then the other (alternating), each step timed alone; passes of ``tokens`` after an untimed one (sdpa's cuDNN
    backend plans each new length once). ``mask``: an all-ones attention mask per step, as ``generate()`` passes."""
    ones = torch.ones(prompt.shape[0], prompt.shape[1] + tokens, dtype=torch.long, device=prompt.device)
    pairs = []
    with torch.no_grad():
        for p in range(1 + -(-pairs_wanted // tokens)):
            states = {}
            for name, model in (("unpatched", unpatched), ("patched", patched)):
                out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
                states[name] = [model, out.past_key_values, out.logits[:, -1:].argmax(-1)]
            for t in range(tokens):
                step = {}
                for name in ("unpatched", "patched") if t % 2 == 0 else ("patched", "unpatched"):
                    model, cache, token = states[name]
                    sync(prompt.device)
                    start = time.perf_counter()
                    out = model(input_ids=token, past_key_values=cache, use_cache=True,
                                attention_mask=ones[:, : prompt.shape[1] + t + 1] if mask else None)
                    states[name][2] = out.logits[:, -1:].argmax(-1)
                    sync(prompt.device)
                    step[name] = time.perf_counter() - start
                if p > 0:
                    pairs.append((step["unpatched"], step["patched"]))
    return pairs[:pairs_wanted]


def write_result_files(stem: str, info: dict, lines) -> None:
    """Writes ``info`` to ``<stem>.json`` and the markdown ``lines`` to ``<stem>.md``, ending with the command that
    reproduces them (``info["command"]``), and prints the markdown."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    text = "\n".join([*lines, "", f"Reproduce: `{info['command']}`", ""])
    for suffix, content in ((".json", json.dumps(info, indent=1)), (".md", text)):
        with open(stem + suffix, "w") as f:
            f.write(content)
    print(text)


def pyplot():
    """matplotlib's pyplot (Agg), or None (and a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        return __import__("matplotlib.pyplot").pyplot
    except ImportError:
        print("matplotlib not installed: no plot")


def plot_rounds(path: str, title: str, series: dict, target=None, ylabel="decode-step overhead per round (%)") -> None:
    """``path`` (PNG): ``series`` label -> ``(rounds, median, [low, high])`` in %, dots and 95% interval; ``target``."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(2.4 + 1.5 * len(series), 3.8))
    for i, (label, (rounds, median, (low, high))) in enumerate(series.items()):
        jitter = [i + 0.25 * ((k * 0.618) % 1 - 0.5) for k in range(len(rounds))]
        ax.scatter(jitter, rounds, s=8, alpha=0.45, color="tab:blue")
        ax.errorbar([i], [median], yerr=[[median - low], [high - median]], fmt="o", color="k", capsize=6)
        ax.annotate(f"{median:+.2f}%", (i + 0.18, median), fontsize=8, va="center")
    for i, label in enumerate(series if target is not None else ()):  # (dashed; a dict: each label's own target)
        ax.hlines(target[label] if isinstance(target, dict) else target, i - 0.4, i + 0.4, color="tab:red",
                  linestyle="--", linewidth=1, label="target" if i == 0 else None)
    if target is not None:
        ax.legend(fontsize=8, loc="upper right")
    ax.axhline(0, color="0.6", linewidth=0.8)
    ax.set_xticks(range(len(series)), list(series), fontsize=8)
    ax.set(xlim=(-0.6, len(series) - 0.2), ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
