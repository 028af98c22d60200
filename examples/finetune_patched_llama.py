"""Fine-tune a pretrained Llama patched with CTA PDE refinement: LoRA only vs LoRA + PDE vs PDE only.

For every mode and seed: load the pretrained model (default: the 260K-parameter stories260K Llama), patch it with
``cta.patch_model(init="identity")`` (so training starts from exactly the pretrained function; "LoRA only" stays
unpatched), train with ``transformers.Trainer`` (+ PEFT LoRA for the LoRA modes, the PDE coefficients through PEFT's
``modules_to_save``), and report validation perplexity before and after. Text: TinyStories sample from
``../shared/data/tinystories`` (stories separated by ``<|endoftext|>`` lines), tokenised with the model's tokenizer,
each story followed by EOS, concatenated and cut into ``--block_size`` blocks.

    python examples/finetune_patched_llama.py                       # the committed results (CPU, a few minutes)
    python examples/finetune_patched_llama.py --max_steps 20 --seeds 0 --modes lora_pde   # smoke test
    python examples/finetune_patched_llama.py --help

Writes ``<results_dir>/finetune_patched_llama.json`` and ``.md``. Any ``TrainingArguments`` flag works as well
(``--learning_rate``, ``--per_device_train_batch_size``, ``--bf16``, ``--push_to_hub`` ...). With ``--push_to_hub``
the last trained model is merged (LoRA) and pushed as a patched checkpoint (it reloads with trust_remote_code).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(EXAMPLES_DIR)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from cta.patching_cta import mark_pde_trainable, patch_model, pde_modules, pde_modules_to_save  # noqa: E402

MODES = ("lora", "lora_pde", "pde")


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(
        default=os.path.join(REPO_ROOT, "..", "shared", "models", "stories260K"),
        metadata={"help": "Pretrained Llama-family model (folder or Hub id). Default: ../shared/models/stories260K."},
    )
    data_dir: str = field(
        default=os.path.join(REPO_ROOT, "..", "shared", "data", "tinystories"),
        metadata={"help": "Folder with train.txt.gz / validation.txt.gz (stories separated by <|endoftext|> lines)."},
    )
    block_size: int = field(default=256, metadata={"help": "Tokens per training / evaluation block."})
    max_train_blocks: Optional[int] = field(default=None, metadata={"help": "Use at most this many training blocks."})
    max_eval_blocks: Optional[int] = field(default=None, metadata={"help": "Use at most this many validation blocks."})
    modes: str = field(
        default="lora,lora_pde,pde",
        metadata={"help": "Comma list of: lora (LoRA on the unpatched model), lora_pde (patched model, LoRA + PDE "
                          "coefficients), pde (patched model, only the PDE coefficients train)."},
    )
    seeds: str = field(default="0,1", metadata={"help": "Comma list of seeds; each mode runs once per seed."})
    pde_type: str = field(default="diffusion", metadata={"help": "diffusion, wave, reaction_diffusion, advection_diffusion."})
    pde_steps: int = field(default=2, metadata={"help": "PDE steps per site."})
    pde_placement: str = field(
        default="block_output",
        metadata={"help": "Comma list of embedding, value, attention_output, mlp_output, block_output."},
    )
    pde_per_channel: bool = field(default=True, metadata={"help": "One coefficient per channel (else per site)."})
    pde_learning_rate: float = field(default=1e-2, metadata={"help": "Learning rate of the PDE coefficients."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        metadata={"help": "Comma list of module names LoRA adapts."},
    )
    results_dir: str = field(default=os.path.join(REPO_ROOT, "results"),
                             metadata={"help": "Where finetune_patched_llama.json / .md are written."})


def read_stories(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    return [s.strip() for s in text.split("<|endoftext|>") if s.strip()]


def make_blocks(tokenizer, stories, block_size, limit=None):
    ids = []
    for encoded in tokenizer(stories, add_special_tokens=True)["input_ids"]:
        ids.extend(encoded + [tokenizer.eos_token_id])
    n = len(ids) // block_size
    if limit is not None:
        n = min(n, limit)
    data = torch.tensor(ids[: n * block_size]).view(n, block_size)
    return [{"input_ids": row, "labels": row.clone(), "attention_mask": torch.ones_like(row)} for row in data]


def build(script, mode, seed):
    from peft import LoraConfig, get_peft_model

    transformers.set_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=torch.float32)
    if mode in ("lora_pde", "pde"):
        patch_model(model, pde_type=script.pde_type, pde_steps=script.pde_steps,
                    placement=script.pde_placement.split(","), init="identity", per_channel=script.pde_per_channel)
    if mode == "pde":
        mark_pde_trainable(model, freeze_others=True)
        return model
    config = LoraConfig(
        r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout,
        target_modules=script.lora_target_modules.split(","), task_type="CAUSAL_LM",
        modules_to_save=pde_modules_to_save(model) if mode == "lora_pde" else None,
    )
    return get_peft_model(model, config)


def optimizer_for(model, training_args, script):
    pde, other = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (pde if "_pde." in name else other).append(param)
    groups = [g for g in ({"params": other, "lr": training_args.learning_rate},
                          {"params": pde, "lr": script.pde_learning_rate, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, weight_decay=training_args.weight_decay)


def coefficient_summary(model):
    values = [m.coefficients()[0].detach().float() for name, m in pde_modules(model) if "original_module" not in name]
    if not values:
        return None
    flat = torch.cat([v.reshape(-1) for v in values])
    return {"sites": len(values), "alpha_mean": float(flat.mean()), "alpha_max": float(flat.max())}


def main():
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    defaults = dict(output_dir=os.path.join("/tmp", "finetune_patched_llama"), max_steps=300, learning_rate=2e-3,
                    per_device_train_batch_size=16, per_device_eval_batch_size=32, warmup_steps=20,
                    lr_scheduler_type="cosine", logging_steps=50, eval_strategy="no", save_strategy="no",
                    report_to="none", use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    parser.set_defaults(**defaults)
    script, training_args = parser.parse_args_into_dataclasses()
    for mode in script.modes.split(","):
        if mode not in MODES:
            raise ValueError(f"`--modes` entries must be in {MODES}, got {mode!r}.")
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    train = make_blocks(tokenizer, read_stories(os.path.join(script.data_dir, "train.txt.gz")), script.block_size,
                        script.max_train_blocks)
    valid = make_blocks(tokenizer, read_stories(os.path.join(script.data_dir, "validation.txt.gz")),
                        script.block_size, script.max_eval_blocks)
    print(f"train blocks {len(train)}, validation blocks {len(valid)} of {script.block_size} tokens", flush=True)

    runs = []
    last = None
    for seed in [int(s) for s in script.seeds.split(",")]:
        for mode in script.modes.split(","):
            training_args.seed = seed
            model = build(script, mode, seed)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=valid,
                              data_collator=default_data_collator,
                              optimizers=(optimizer_for(model, training_args, script), None))
            before = math.exp(trainer.evaluate()["eval_loss"])
            start = time.time()
            trainer.train()
            seconds = time.time() - start
            after = math.exp(trainer.evaluate()["eval_loss"])
            run = {"mode": mode, "seed": seed, "trainable_parameters": trainable, "ppl_before": before,
                   "ppl_after": after, "train_seconds": seconds, "pde": coefficient_summary(model)}
            print(json.dumps(run), flush=True)
            runs.append(run)
            last = (trainer, model)

    summary = {}
    for mode in script.modes.split(","):
        values = [r["ppl_after"] for r in runs if r["mode"] == mode]
        summary[mode] = {"ppl_after_mean": statistics.mean(values),
                         "ppl_after_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "ppl_before": runs[[r["mode"] for r in runs].index(mode)]["ppl_before"],
                         "seeds": len(values),
                         "trainable_parameters": next(r["trainable_parameters"] for r in runs if r["mode"] == mode)}
    result = {
        "script": "examples/finetune_patched_llama.py",
        "model": os.path.basename(os.path.normpath(script.model_name_or_path)),
        "data": "TinyStories sample (../shared/data/tinystories)",
        "train_blocks": len(train), "validation_blocks": len(valid),
        "args": {k: v for k, v in asdict(script).items() if k not in ("model_name_or_path", "data_dir", "results_dir")},
        "training": {"max_steps": training_args.max_steps, "learning_rate": training_args.learning_rate,
                     "batch_size": training_args.per_device_train_batch_size,
                     "scheduler": str(training_args.lr_scheduler_type), "device": str(training_args.device)},
        "torch": torch.__version__, "transformers": transformers.__version__,
        "summary": summary, "runs": runs,
    }
    os.makedirs(script.results_dir, exist_ok=True)
    stem = os.path.join(script.results_dir, "finetune_patched_llama")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# Fine-tuning {result['model']} patched with CTA (validation perplexity)",
        "",
        f"TinyStories sample, {len(train)} train / {len(valid)} validation blocks of {script.block_size} tokens; "
        f"{training_args.max_steps} steps, batch {training_args.per_device_train_batch_size}, lr "
        f"{training_args.learning_rate} (PDE coefficients {script.pde_learning_rate}); PDE: {script.pde_type}, "
        f"{script.pde_steps} steps at {script.pde_placement}, identity init; LoRA r={script.lora_r}. "
        f"Mean ± std over {len(script.seeds.split(','))} seeds.",
        "",
        "| mode | trainable params | ppl before | ppl after |",
        "|---|---|---|---|",
    ]
    for mode, s in summary.items():
        lines.append(f"| {mode} | {s['trainable_parameters']} | {s['ppl_before']:.3f} | "
                     f"{s['ppl_after_mean']:.3f} ± {s['ppl_after_std']:.3f} |")
    lines += ["", "Reproduce: `" + " ".join(["python examples/finetune_patched_llama.py", *sys.argv[1:]]) + "`"]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    if training_args.push_to_hub and last is not None:
        trainer, model = last
        merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
        merged.push_to_hub(training_args.hub_model_id or os.path.basename(training_args.output_dir),
                           token=training_args.hub_token, private=training_args.hub_private_repo)
        tokenizer.push_to_hub(training_args.hub_model_id or os.path.basename(training_args.output_dir),
                              token=training_args.hub_token)


if __name__ == "__main__":
    main()
