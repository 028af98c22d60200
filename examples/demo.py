#!/usr/bin/env python
"""`make demo`: CTA's PDE refinement on a real pretrained LLM, end to end, in about 3 minutes on 2 CPU cores.

Everything it needs ships in the repository (``examples/demo_data``: the 260K-parameter stories260K Llama, MIT, and a
117 KB TinyStories slice, CDLA-Sharing-1.0; see the PROVENANCE.md files). No download, no GPU.

1. **Identity.** ``cta.patch_model(model, init="identity")`` adds PDE refinement sites to the pretrained model with
   coefficients 0: the logits and the greedy tokens must equal the unpatched model's (checked, not assumed).
2. **Fine-tune.** For each seed, three arms with the same data order, steps and learning rates (Trainer + PEFT):
   ``lora`` (LoRA on the unpatched model), ``lora_pde`` (LoRA + the trainable PDE coefficients of the patched
   model) and ``pde`` (only the PDE coefficients train, every pretrained weight frozen). Validation perplexity before
   and after, mean ± std over seeds, and a verdict on each comparison that says "within noise" when it is.
3. **Save and reload.** The ``lora_pde`` model of the first seed is merged (``merge_and_unload``), saved with
   ``save_pretrained`` and reloaded with ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` in a
   separate Python process in which ``import cta`` fails: the reloaded logits must equal the ones before saving.
   That process also generates the sample.

Writes ``<output_dir>/demo.json``, ``demo.md``, ``demo.png`` and the saved model (``<output_dir>/model``); prints a
one-paragraph summary of what was shown. Any ``TrainingArguments`` flag works too (``--max_steps``,
``--learning_rate``, ``--per_device_train_batch_size``...).

    python examples/demo.py                      # what `make demo` runs
    python examples/demo.py --seeds 0,1,2,3,4 --max_steps 200   # more seeds / steps (longer)
    python examples/demo.py --help
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (also puts the repo root on sys.path)
import finetune_patched_llama as ft  # noqa: E402  (the fine-tuning arms, reused as they are)

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments  # noqa: E402
from transformers import default_data_collator  # noqa: E402

from cta.patching_cta import patch_model, pde_modules  # noqa: E402

DEMO_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_data")
LABELS = {"lora": "LoRA alone (unpatched model)", "lora_pde": "CTA: PDE + LoRA", "pde": "CTA: PDE coefficients only"}

# Runs in a fresh interpreter where `cta` cannot be imported (a None entry in sys.modules makes `import cta` raise),
# so the checkpoint can only load through the code files saved next to it (auto_map + trust_remote_code).
RELOAD_SCRIPT = r"""
import json, sys
sys.modules["cta"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, ids_file, logits_file, prompt, new_tokens = sys.argv[1:6]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
with torch.no_grad():
    logits = model(input_ids=torch.tensor(json.load(open(ids_file)))).logits
torch.save(logits, logits_file)
inputs = tokenizer(prompt, return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=int(new_tokens), do_sample=False, pad_token_id=tokenizer.eos_token_id)
print("RESULT " + json.dumps({"class": type(model).__module__ + "." + type(model).__name__,
                  "cta_importable": False, "sample": tokenizer.decode(out[0], skip_special_tokens=True)}))
"""


@dataclass
class DemoArguments:
    model_name_or_path: str = field(
        default=os.path.join(DEMO_DATA, "stories260K"),
        metadata={"help": "Pretrained causal LM folder (a Llama-family model cta.patch_model supports). Default: the "
                          "stories260K checkpoint shipped in examples/demo_data."},
    )
    data_dir: str = field(
        default=DEMO_DATA,
        metadata={"help": "Folder holding tinystories/{train,validation}.txt.gz (stories separated by "
                          "<|endoftext|> lines). Default: the slice shipped in examples/demo_data."},
    )
    modes: str = field(default="lora,lora_pde,pde",
                       metadata={"help": "Comma list of arms: lora, lora_pde, pde (see the module docstring)."})
    seeds: str = field(default="0,1,2", metadata={"help": "Comma list of seeds; every arm runs once per seed."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training / validation block."})
    max_train_blocks: Optional[int] = field(default=None, metadata={"help": "Use at most this many training blocks."})
    max_eval_blocks: Optional[int] = field(default=None, metadata={"help": "Use at most this many validation blocks."})
    pde_type: str = field(default="reaction_diffusion",
                          metadata={"help": "diffusion, wave, reaction_diffusion (default: the type that gained most "
                                            "in the README's LM table and in a short trial here), advection_diffusion."})
    pde_steps: int = field(default=2, metadata={"help": "PDE steps per site."})
    pde_placement: str = field(default="block_output", metadata={"help": "Where the PDE sites go (cta.patch_model)."})
    pde_learning_rate: float = field(default=2e-2, metadata={"help": "Learning rate of the PDE coefficients."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (all attention and MLP projections)."})
    prompt: str = field(default="Once upon a time", metadata={"help": "Prompt of the greedy samples."})
    sample_tokens: int = field(default=48, metadata={"help": "New tokens per generated sample."})


def perplexity(model, dataset, batch_size=32):
    """exp(mean next-token loss) over the blocks (every block has the same length, so a mean of block means)."""
    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            ids = torch.tensor(dataset[start:start + batch_size]["input_ids"])
            losses.append(model(input_ids=ids, labels=ids).loss.item() * len(ids))
    return math.exp(sum(losses) / len(dataset))


def greedy(model, tokenizer, prompt, new_tokens):
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0].tolist()


def identity_check(args, tokenizer, probe):
    """The patched model at init="identity" against the unpatched one: logits and greedy tokens."""
    base = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32).eval()
    patched = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32).eval()
    patch_model(patched, pde_type=args.pde_type, pde_steps=args.pde_steps, placement=args.pde_placement.split(","),
                init="identity", per_channel=True)
    with torch.no_grad():
        diff = (base(input_ids=probe).logits - patched(input_ids=probe).logits).abs().max().item()
    tokens_base = greedy(base, tokenizer, args.prompt, args.sample_tokens)
    tokens_patched = greedy(patched, tokenizer, args.prompt, args.sample_tokens)
    if diff > 1e-5 or tokens_base != tokens_patched:
        raise RuntimeError(f"identity init changed the model: max |logit diff| {diff:.3g}, "
                           f"same greedy tokens: {tokens_base == tokens_patched}")
    return {"max_abs_logit_diff": diff, "same_greedy_tokens": tokens_base == tokens_patched,
            "pde_sites": len(pde_modules(patched)),
            "base_sample": tokenizer.decode(tokens_base, skip_special_tokens=True)}


def save_and_reload(model, tokenizer, folder, probe, args):
    """merge_and_unload + save_pretrained, then reload with trust_remote_code in a process without `cta`."""
    merged = model.merge_and_unload().eval()
    with torch.no_grad():
        before = merged(input_ids=probe).logits
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:  # cwd outside the repository: no `cta` folder on sys.path
        ids_file, logits_file = os.path.join(tmp, "ids.json"), os.path.join(tmp, "logits.pt")
        with open(ids_file, "w") as f:
            json.dump(probe.tolist(), f)
        result = subprocess.run(
            [sys.executable, "-c", RELOAD_SCRIPT, os.path.abspath(folder), ids_file, logits_file, args.prompt,
             str(args.sample_tokens)], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"reloading {folder} without `cta` failed:\n{result.stdout}\n{result.stderr}")
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"the reload process printed no result:\n{result.stdout}\n{result.stderr}")
        reloaded = json.loads(lines[-1][len("RESULT "):])
        after = torch.load(logits_file)
    reloaded["max_abs_logit_diff"] = (before - after).abs().max().item()
    reloaded["folder"] = folder
    return reloaded


def verdict(a, b, name_a, name_b):
    """A sentence that compares the seed lists a and b (lower is better) without overclaiming.

    A difference is called real only when it has the same sign in every paired seed and its mean is larger than
    twice the larger seed-to-seed standard deviation; otherwise it is "within seed-to-seed noise"."""
    diffs = [x - y for x, y in zip(a, b)]
    mean = statistics.mean(diffs)
    spread = max(statistics.stdev(a), statistics.stdev(b)) if len(a) > 1 else float("nan")
    text = f"{name_a} − {name_b}: {mean:+.4f} perplexity (per seed: {', '.join(f'{d:+.4f}' for d in diffs)})"
    if len(a) < 2:
        return text + "; one seed: no claim", "one seed"
    if (all(d < 0 for d in diffs) or all(d > 0 for d in diffs)) and abs(mean) > 2 * spread:
        word = "lower" if mean < 0 else "higher"
        return text + f"; {word} in every seed, by more than twice the seed std ({spread:.4f})", word
    return text + f"; within seed-to-seed noise (seed std {spread:.4f})", "within noise"


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["summary"])
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.axhline(result["ppl_before"], color="grey", ls="--", label=f"before fine-tuning: {result['ppl_before']:.3f}")
    for i, mode in enumerate(modes):
        values = [r["ppl_after"] for r in result["runs"] if r["mode"] == mode]
        ax.scatter([i] * len(values), values, color="C%d" % i, alpha=0.6, zorder=3)
        ax.errorbar(i + 0.15, statistics.mean(values), yerr=statistics.stdev(values) if len(values) > 1 else 0,
                    fmt="s", color="C%d" % i, capsize=4, zorder=3)
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels([f"{LABELS[m]}\n{result['summary'][m]['trainable_parameters']:,} trainable" for m in modes],
                       fontsize=8)
    ax.set_ylabel("validation perplexity (lower is better)")
    ax.set_title(f"{result['model']} fine-tuned {result['training']['max_steps']} steps on a TinyStories slice\n"
                 f"dots: seeds ({len(result['seeds'])}); squares: mean ± std. The y axis does not start at 0.",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_markdown(result, path):
    s = result["summary"]
    lines = [
        f"# Demo: CTA PDE refinement on {result['model']} (validation perplexity, lower is better)",
        "",
        f"Data: {result['data']}; {result['train_blocks']} train / {result['validation_blocks']} validation blocks "
        f"of {result['args']['block_size']} tokens. {result['training']['max_steps']} steps, batch "
        f"{result['training']['batch_size']}, lr {result['training']['learning_rate']} (PDE coefficients "
        f"{result['args']['pde_learning_rate']}); PDE: {result['args']['pde_type']}, {result['args']['pde_steps']} "
        f"steps at {result['args']['pde_placement']}, identity init; LoRA r={result['args']['lora_r']}. "
        f"Seeds {result['seeds']}, CPU.",
        "",
        "| arm | trainable params | ppl before | ppl after: mean ± std | per seed |",
        "|---|---|---|---|---|",
    ]
    for mode, row in s.items():
        per_seed = ", ".join(f"{r['ppl_after']:.4f}" for r in result["runs"] if r["mode"] == mode)
        lines.append(f"| {LABELS[mode]} | {row['trainable_parameters']:,} | {result['ppl_before']:.4f} | "
                     f"{row['ppl_after_mean']:.4f} ± {row['ppl_after_std']:.4f} | {per_seed} |")
    lines += ["", "Comparisons (a difference is claimed only if every seed agrees and it exceeds twice the seed std):",
              ""] + [f"- {c['text']}" for c in result["comparisons"]]
    lines += ["", "## Checks", "",
              f"- identity init: max |logit difference| to the unpatched model "
              f"{result['identity']['max_abs_logit_diff']:.3g}, same greedy tokens: "
              f"{result['identity']['same_greedy_tokens']}",
              f"- reload of the merged, saved model in a process without `cta` ({result['reload']['class']}): "
              f"max |logit difference| {result['reload']['max_abs_logit_diff']:.3g}",
              "", "## Samples (greedy)", "",
              f"- pretrained model: {result['identity']['base_sample']!r}",
              f"- reloaded CTA PDE + LoRA model: {result['reload']['sample']!r}",
              "", "## What this shows", "", result["conclusion"], ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def conclusion(result):
    s, c = result["summary"], {x["pair"]: x for x in result["comparisons"]}
    parts = [f"A real pretrained LLM ({result['model']}) was patched with CTA {result['args']['pde_type']} PDE "
             f"refinement ({result['identity']['pde_sites']} sites, identity init): its logits equal the unpatched "
             f"model's (max |difference| {result['identity']['max_abs_logit_diff']:.1g}) and its greedy tokens are "
             f"the same."]
    meaning = {  # what each verdict lets the summary say, and no more
        "lower": "lower in every seed, by more than twice the seed std",
        "higher": "higher (worse) in every seed, by more than twice the seed std",
        "within noise": "within seed-to-seed noise",
        "one seed": "one seed only, so no claim either way",
    }
    if "pde" in s:
        v = c["pde vs before"]["verdict"]
        parts.append(f"Training only the {s['pde']['trainable_parameters']} PDE coefficients (every pretrained "
                     f"weight frozen) moved validation perplexity from {result['ppl_before']:.4f} to "
                     f"{s['pde']['ppl_after_mean']:.4f} ± {s['pde']['ppl_after_std']:.4f} ({meaning[v]})"
                     + (": a small but consistent gain, so the refinement learns something the pretrained model can "
                        "use." if v == "lower" else "."))
    if "lora_pde vs lora" in c:
        v = c["lora_pde vs lora"]["verdict"]
        parts.append(f"PDE + LoRA reached {s['lora_pde']['ppl_after_mean']:.4f} ± "
                     f"{s['lora_pde']['ppl_after_std']:.4f} against {s['lora']['ppl_after_mean']:.4f} ± "
                     f"{s['lora']['ppl_after_std']:.4f} for LoRA alone ({meaning[v]})"
                     + ("; this short run shows no benefit of adding CTA to LoRA." if v != "lower" else "."))
    parts.append(f"The merged PDE + LoRA model was saved and reloaded through trust_remote_code in a process where "
                 f"`cta` cannot be imported: max |logit difference| to before saving "
                 f"{result['reload']['max_abs_logit_diff']:.1g}; it "
                 f"wrote the sample above. Small model ({result['model']}, TinyStories-only), "
                 f"{result['training']['max_steps']} steps, {len(result['seeds'])} seeds on CPU: a demonstration of "
                 f"the mechanics and of honest measurement, not a benchmark.")
    return " ".join(parts)


def main(argv=None):
    started = time.time()
    defaults = dict(output_dir=os.path.join("outputs", "demo"), max_steps=80, learning_rate=2e-3,
                    per_device_train_batch_size=16, warmup_steps=5, lr_scheduler_type="cosine", logging_steps=1000,
                    eval_strategy="no", save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
                    dataloader_num_workers=0)
    args, training_args = common.parse_arguments((DemoArguments, TrainingArguments), argv, **defaults)
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    for mode in modes:
        if mode not in LABELS:
            raise ValueError(f"`--modes` entries must be in {sorted(LABELS)}, got {mode!r}.")
    if not os.path.isfile(os.path.join(args.model_name_or_path, "config.json")):
        raise FileNotFoundError(f"no model at --model_name_or_path {args.model_name_or_path!r} (config.json missing)")
    os.makedirs(training_args.output_dir, exist_ok=True)

    # Data: finetune_patched_llama's loader (documents split at <|endoftext|>) and run_clm.py's blocks.
    data_args = ft.DataTrainingArguments(data_dir=args.data_dir, block_size=args.block_size)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    raw, data_desc = ft.load_raw_datasets(data_args, None)
    blocks = common.lm_blocks(raw, tokenizer, "text", args.block_size, data_args, training_args,
                              add_special_tokens=True, with_labels=True)
    train = common.take(blocks["train"], args.max_train_blocks)
    valid = common.take(blocks["validation"], args.max_eval_blocks)
    probe = torch.tensor(valid[:2]["input_ids"])
    print(f"[demo] {len(train)} train / {len(valid)} validation blocks of {args.block_size} tokens", flush=True)

    print("[demo] 1/3 identity init: patched vs unpatched logits and greedy tokens", flush=True)
    identity = identity_check(args, tokenizer, probe)
    ppl_before = perplexity(AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32), valid)

    print(f"[demo] 2/3 fine-tuning: {len(modes)} arms x {len(seeds)} seeds, {training_args.max_steps} steps each",
          flush=True)
    script = ft.FinetuneArguments(modes=args.modes, pde_type=args.pde_type, pde_steps=args.pde_steps,
                                  pde_placement=args.pde_placement, pde_learning_rate=args.pde_learning_rate,
                                  lora_r=args.lora_r, lora_alpha=2 * args.lora_r)
    model_args = ft.ModelArguments(model_name_or_path=args.model_name_or_path)
    runs, keep = [], None
    for seed in seeds:
        for mode in modes:
            training_args.seed = seed
            model = ft.build(model_args, script, mode, seed, training_args)  # same seed: same LoRA init and data order in each arm
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=default_data_collator,
                              optimizers=(ft.optimizer_for(model, training_args, script), None))
            start = time.time()
            trainer.train()
            run = {"mode": mode, "seed": seed, "trainable_parameters": trainable, "ppl_after": perplexity(model, valid),
                   "train_seconds": round(time.time() - start, 1), "pde": ft.coefficient_summary(model)}
            print(f"[demo] {LABELS[mode]}, seed {seed}: validation perplexity {ppl_before:.4f} -> "
                  f"{run['ppl_after']:.4f} ({run['train_seconds']} s)", flush=True)
            runs.append(run)
            if mode == "lora_pde" and keep is None:
                keep = model

    summary = {}
    for mode in modes:
        values = [r["ppl_after"] for r in runs if r["mode"] == mode]
        summary[mode] = {"ppl_after_mean": statistics.mean(values),
                         "ppl_after_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "seeds": len(values), "trainable_parameters": runs[modes.index(mode)]["trainable_parameters"]}
    per_mode = {m: [r["ppl_after"] for r in runs if r["mode"] == m] for m in modes}
    comparisons = []
    for a, b in (("lora_pde", "lora"), ("pde", "before")):
        if a in per_mode and (b == "before" or b in per_mode):
            # "before" is one number (no seed spread): the arm's own spread is the noise yardstick
            ref = per_mode[b] if b != "before" else [ppl_before] * len(per_mode[a])
            text, word = verdict(per_mode[a], ref, LABELS[a], LABELS.get(b, "before fine-tuning"))
            comparisons.append({"pair": f"{a} vs {b}", "text": text, "verdict": word})

    print("[demo] 3/3 merge, save, reload through trust_remote_code without `cta`, generate", flush=True)
    if keep is None:
        raise ValueError("the save / reload step needs the lora_pde arm: add it to --modes")
    reload = save_and_reload(keep, tokenizer, os.path.join(training_args.output_dir, "model"), probe, args)
    if reload["max_abs_logit_diff"] > 1e-4:
        raise RuntimeError(f"the reloaded model's logits differ by {reload['max_abs_logit_diff']:.3g}")

    result = {
        "script": "examples/demo.py", "model": os.path.basename(os.path.normpath(args.model_name_or_path)),
        "data": data_desc, "train_blocks": len(train), "validation_blocks": len(valid),
        "seeds": seeds, "args": {k: v for k, v in vars(args).items()},
        "training": {"max_steps": training_args.max_steps, "learning_rate": training_args.learning_rate,
                     "batch_size": training_args.per_device_train_batch_size,
                     "scheduler": str(training_args.lr_scheduler_type), "device": str(training_args.device)},
        "identity": identity, "ppl_before": ppl_before, "summary": summary, "comparisons": comparisons,
        "runs": runs, "reload": reload, "torch": torch.__version__, "transformers": transformers.__version__,
    }
    result["conclusion"] = conclusion(result)
    result["wall_seconds"] = round(time.time() - started, 1)
    stem = os.path.join(training_args.output_dir, "demo")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, stem + ".md")
    plot(result, stem + ".png")
    print("\n" + open(stem + ".md").read())
    print(f"[demo] wrote {stem}.json / .md / .png and {reload['folder']} ({result['wall_seconds']} s)")
    return result


if __name__ == "__main__":
    main()
