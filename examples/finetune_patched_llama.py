#!/usr/bin/env python
"""Fine-tune a pretrained causal LM patched with CTA PDE refinement: LoRA only vs LoRA + PDE vs PDE only.

For every mode and seed: load the pretrained model ``--model_name_or_path`` (any causal LM that ``cta.patch_model``
supports; default: the 260K-parameter stories260K Llama in ``models`` of ``$CTA_SHARED_DIR``, ``../shared``), patch
it with ``cta.patch_model(init="identity")`` (so training starts from exactly the pretrained function; "LoRA only"
stays unpatched), train with ``transformers.Trainer`` (+ PEFT LoRA for the LoRA modes, the PDE coefficients through
PEFT's ``modules_to_save``), and report validation perplexity before and after.

Data: the same options as ``run_clm.py`` (loaded with ``datasets.load_dataset``): ``--dataset_name`` (Hub), your own
``--train_file`` / ``--validation_file`` (text, csv, json or jsonl; ``--text_column_name``), or by default the
TinyStories sample in ``--data_dir``/``--dataset_folder`` (``data/tinystories`` in ``$CTA_SHARED_DIR``). Rows are
split into documents at ``--document_separator`` (``<|endoftext|>``), tokenised with the model's tokenizer (with its
special tokens), each followed by EOS, concatenated and cut into ``--block_size`` blocks (``.map(batched=True)``).

    python examples/finetune_patched_llama.py                       # the committed results (CPU, a few minutes)
    python examples/finetune_patched_llama.py --max_steps 20 --seeds 0 --modes lora_pde   # smoke test
    python examples/finetune_patched_llama.py --model_name_or_path my-llama --train_file my.txt --validation_file dev.txt
    python examples/finetune_patched_llama.py --help

Several GPUs (FSDP2 or DeepSpeed ZeRO-3; the configs are in ``examples/accelerate/``), unchanged::

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/finetune_patched_llama.py --bf16 ...

QLoRA (bitsandbytes, one GPU): ``--load_in_4bit`` loads the base in nf4 (bf16 compute), patches it after loading,
runs ``peft.prepare_model_for_kbit_training`` (which freezes every parameter and upcasts the rest to fp32) and then
adds LoRA with ``modules_to_save=cta.pde_modules_to_save(model)``, so the PDE coefficients train in fp32 next to
LoRA. ``--save_models`` saves each trained model (the adapter for LoRA modes) under ``--output_dir`` and checks that
it reloads onto a freshly loaded (and patched) base with the same logits.

Writes ``<results_dir>/finetune_patched_llama.json`` and ``.md``. Any ``TrainingArguments`` flag works as well
(``--learning_rate``, ``--per_device_train_batch_size``, ``--bf16``, ``--push_to_hub`` ...). With ``--push_to_hub``
the last trained model is merged (LoRA) and pushed as a patched checkpoint (it reloads with trust_remote_code).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (also puts the repo root on sys.path)
import cta  # noqa: E402
from common import DataArguments, PretrainedArguments  # noqa: E402

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from cta.patching_cta import mark_pde_trainable, patch_model, pde_modules, pde_modules_to_save  # noqa: E402

MODES = ("lora", "lora_pde", "pde")


@dataclass
class ModelArguments(PretrainedArguments):
    model_name_or_path: str = field(
        default=common.default_model_path("stories260K"),
        metadata={"help": "Pretrained causal LM (folder or Hub id) that cta.patch_model supports (Llama family). "
                          "Default: models/stories260K in $CTA_SHARED_DIR (../shared)."},
    )


@dataclass
class DataTrainingArguments(DataArguments):
    """run_clm.py's data options; the default is the offline TinyStories sample."""

    file_builders: ClassVar[tuple] = ("text", "csv", "json")

    dataset_folder: str = field(
        default="tinystories",
        metadata={"help": "Folder under --data_dir with train.txt.gz / validation.txt.gz (the default data)."},
    )
    document_separator: str = field(
        default="<|endoftext|>",
        metadata={"help": "Rows are split into documents at this string (TinyStories: a line after each story); "
                          "empty: no split."},
    )
    block_size: int = field(default=256, metadata={"help": "Tokens per training / evaluation block."})


@dataclass
class FinetuneArguments:
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
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "QLoRA: load the base in 4 bits (bitsandbytes nf4, bf16 compute; meant for a CUDA GPU), "
                          "patch it after loading, prepare it with peft.prepare_model_for_kbit_training; LoRA modes "
                          "only."},
    )
    save_models: bool = field(
        default=False,
        metadata={"help": "Save each trained model under --output_dir/<mode>-seed<seed> (LoRA modes: the adapter) and "
                          "check that it reloads onto a fresh base with the same logits."},
    )
    results_dir: str = field(default=os.path.join(common.REPO_ROOT, "results"),
                             metadata={"help": "Where finetune_patched_llama.json / .md are written."})


def load_raw_datasets(data_args, cache_dir):
    """``(DatasetDict with train / validation rows of documents, description)``."""
    import datasets

    if data_args.dataset_name or data_args.train_file:
        raw, desc = common.load_raw_datasets(data_args, cache_dir), data_args.source()
    else:
        base = os.path.join(data_args.data_dir or common.default_data_dir(), data_args.dataset_folder)
        files = {s: os.path.join(base, f"{s}.txt.gz") for s in ("train", "validation")}
        raw = datasets.load_dataset("text", data_files=files, sample_by="document", cache_dir=cache_dir)
        desc = f"offline {data_args.dataset_folder} ({base})"
    sep, column = data_args.document_separator, data_args.text_column_name or "text"
    common.require_column(raw, "text_column_name", column)
    if sep:
        raw = raw.map(lambda batch: {column: [d.strip() for t in batch[column] for d in (t or "").split(sep)
                                              if d.strip()]},
                      batched=True, remove_columns=raw["train"].column_names, desc="Splitting documents")
    return raw, desc


def load_base(model_args, script, mode, training_args):
    """The pretrained model, patched for the PDE modes (after loading: also in 4 bits), prepared for k-bit training
    when 4-bit (the same steps make the fresh base of the reload check)."""
    kwargs = dict(dtype=torch.float32)
    if script.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs = dict(dtype=torch.bfloat16, device_map={"": training_args.device},
                      quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                             bnb_4bit_compute_dtype=torch.bfloat16))
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)
    if mode in ("lora_pde", "pde"):
        patch_model(model, pde_type=script.pde_type, pde_steps=script.pde_steps,
                    placement=script.pde_placement.split(","), init="identity", per_channel=script.pde_per_channel)
    if script.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        # Freezes every parameter and upcasts the non-quantized ones (the PDE coefficients too) to fp32; the PDE
        # coefficients become trainable again as PEFT's modules_to_save copies of those fp32 modules.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=training_args.gradient_checkpointing)
    return model


def build(model_args, script, mode, seed, training_args):
    from peft import LoraConfig, get_peft_model
    from transformers.integrations import is_deepspeed_zero3_enabled

    transformers.set_seed(seed)
    model = load_base(model_args, script, mode, training_args)
    if mode == "pde":
        mark_pde_trainable(model, freeze_others=True)
        return model
    config = LoraConfig(
        r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout,
        target_modules=script.lora_target_modules.split(","), task_type="CAUSAL_LM",
        modules_to_save=pde_modules_to_save(model) if mode == "lora_pde" else None,
    )
    # DeepSpeed partitions the trainable parameters of one dtype together: under ZeRO-3 the adapters keep the model's
    # dtype, like the PDE coefficients (PEFT would upcast bf16 adapters to fp32 and DeepSpeed would refuse the mix).
    return get_peft_model(model, config, autocast_adapter_dtype=not is_deepspeed_zero3_enabled())


def optimizer_for(model, training_args, script):
    pde, other = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (pde if "_pde." in name else other).append(param)
    groups = [g for g in ({"params": other, "lr": training_args.learning_rate},
                          {"params": pde, "lr": script.pde_learning_rate, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, weight_decay=training_args.weight_decay)


class PDETrainer(Trainer):
    """Trainer whose AdamW gives the PDE coefficients their own learning rate. Built in ``create_optimizer`` (not
    passed as ``optimizers=``, which Trainer refuses under FSDP): Trainer calls it after the engine has wrapped or
    sharded the model, and DeepSpeed's setup calls it too."""

    def __init__(self, *args, cta_script=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.cta_script = cta_script

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = optimizer_for(self.model if model is None else model, self.args, self.cta_script)
        return self.optimizer


def full_values(trainer, params):
    """Full (unsharded) copies of ``params`` on every rank: DeepSpeed ZeRO-3 gathers them for the block, FSDP2 holds
    DTensor shards (``full_tensor()``), otherwise they are plain tensors."""
    from contextlib import nullcontext

    gather = nullcontext()
    if getattr(trainer, "is_deepspeed_enabled", False):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params)
    with gather:
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone() for p in params]


def coefficient_summary(model, trainer=None):
    modules = [m for name, m in pde_modules(model) if "original_module" not in name]
    params = [p for m in modules for p in m.parameters()]
    if not params:
        return None
    flat = torch.cat([v.reshape(-1) for v in full_values(trainer, params)])
    return {"sites": len(modules), "alpha_mean": float(flat.mean()), "alpha_max": float(flat.max()),
            "dtype": str(params[0].dtype).replace("torch.", "")}


def reload_check(model_args, script, mode, training_args, trained, saved_dir, valid):
    """The saved model (adapter) on a freshly loaded and patched base gives the trained model's logits."""
    from peft import PeftModel

    if mode == "pde":
        fresh = cta.load_patched(saved_dir, dtype=torch.float32)
    else:
        fresh = PeftModel.from_pretrained(load_base(model_args, script, mode, training_args), saved_dir)
    device = next(trained.parameters()).device
    if not script.load_in_4bit:  # a 4-bit model already sits on its GPU
        fresh.to(device)
    ids = torch.tensor(valid[:2]["input_ids"], device=device)
    trained.eval(), fresh.eval()
    with torch.no_grad():
        diff = (trained(input_ids=ids).logits.float() - fresh(input_ids=ids).logits.float()).abs().max().item()
    return {"saved_dir": saved_dir, "reload_max_abs_logit_diff": diff}


def main(argv=None):
    defaults = dict(output_dir=os.path.join("/tmp", "finetune_patched_llama"), max_steps=300, learning_rate=2e-3,
                    per_device_train_batch_size=16, per_device_eval_batch_size=32, warmup_steps=20,
                    lr_scheduler_type="cosine", logging_steps=50, eval_strategy="no", save_strategy="no",
                    report_to="none", use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    model_args, data_args, script, training_args = common.parse_arguments(
        (ModelArguments, DataTrainingArguments, FinetuneArguments, TrainingArguments), argv, **defaults)
    common.setup_logging(training_args)
    for mode in script.modes.split(","):
        if mode not in MODES:
            raise ValueError(f"`--modes` entries must be in {MODES}, got {mode!r}.")
        if script.load_in_4bit and mode == "pde":
            raise ValueError("`--load_in_4bit` trains through LoRA: use `--modes lora` or `lora_pde`, not `pde` "
                             "(Trainer does not train a quantized model without an adapter).")
    if script.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("`--load_in_4bit` needs bitsandbytes (`pip install bitsandbytes`).")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    with training_args.main_process_first(desc="load datasets"):
        raw, data_desc = load_raw_datasets(data_args, model_args.cache_dir)
    blocks = common.lm_blocks(raw, tokenizer, data_args.text_column_name or "text", data_args.block_size, data_args,
                              training_args, add_special_tokens=True, with_labels=True)
    train = common.take(blocks["train"], data_args.max_train_samples)
    valid = common.take(blocks["validation"], data_args.max_eval_samples)
    print(f"train blocks {len(train)}, validation blocks {len(valid)} of {data_args.block_size} tokens", flush=True)

    runs = []
    last = None
    for seed in [int(s) for s in script.seeds.split(",")]:
        for mode in script.modes.split(","):
            training_args.seed = seed
            model = build(model_args, script, mode, seed, training_args)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            trainer = PDETrainer(model=model, args=training_args, train_dataset=train, eval_dataset=valid,
                                 data_collator=default_data_collator, cta_script=script)
            # Sharded, Trainer (5.x) can evaluate only after training: evaluating first wraps the model without its
            # optimizer (FSDP2: accelerate refuses; DeepSpeed: the training engine is then never built). The
            # "before" perplexity is not measured there.
            sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
            before = None if sharded else math.exp(trainer.evaluate()["eval_loss"])
            start = time.time()
            trainer.train()
            seconds = time.time() - start
            after = math.exp(trainer.evaluate()["eval_loss"])
            run = {"mode": mode, "seed": seed, "trainable_parameters": trainable, "ppl_before": before,
                   "ppl_after": after, "train_seconds": seconds, "pde": coefficient_summary(model, trainer)}
            if script.save_models:
                saved_dir = os.path.join(training_args.output_dir, f"{mode}-seed{seed}")
                trainer.save_model(saved_dir)  # gathers a full state dict under FSDP / ZeRO-3
                if training_args.world_size == 1:  # the check reloads on one device
                    run.update(reload_check(model_args, script, mode, training_args, model, saved_dir, valid))
            print(json.dumps(run), flush=True)
            runs.append(run)
            last = (trainer, model)
            if trainer.is_deepspeed_enabled:
                # One process builds one DeepSpeed setup: the next Trainer reuses it (accelerate refuses a second
                # plugin) and this run's engine is released first.
                trainer.accelerator.free_memory()
                training_args.deepspeed_plugin = None

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
        "model": os.path.basename(os.path.normpath(model_args.model_name_or_path)),
        "data": data_desc,
        "train_blocks": len(train), "validation_blocks": len(valid),
        "args": dict({k: v for k, v in asdict(script).items() if k != "results_dir"}, block_size=data_args.block_size),
        "training": {"max_steps": training_args.max_steps, "learning_rate": training_args.learning_rate,
                     "batch_size": training_args.per_device_train_batch_size,
                     "scheduler": str(training_args.lr_scheduler_type), "device": str(training_args.device),
                     "load_in_4bit": script.load_in_4bit, "world_size": training_args.world_size},
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
        f"Data: {data_desc.split(' (')[0]}, {len(train)} train / {len(valid)} validation blocks of {data_args.block_size} "
        f"tokens; "
        f"{training_args.max_steps} steps, batch {training_args.per_device_train_batch_size}, lr "
        f"{training_args.learning_rate} (PDE coefficients {script.pde_learning_rate}); PDE: {script.pde_type}, "
        f"{script.pde_steps} steps at {script.pde_placement}, identity init; LoRA r={script.lora_r}. "
        f"Mean ± std over {len(script.seeds.split(','))} seeds.",
        "",
        "| mode | trainable params | ppl before | ppl after |",
        "|---|---|---|---|",
    ]
    for mode, row in summary.items():
        before = "n/a (sharded)" if row["ppl_before"] is None else f"{row['ppl_before']:.3f}"
        lines.append(f"| {mode} | {row['trainable_parameters']} | {before} | "
                     f"{row['ppl_after_mean']:.3f} ± {row['ppl_after_std']:.3f} |")
    command = sys.argv[1:] if argv is None else list(argv)
    lines += ["", "Reproduce: `" + " ".join(["python examples/finetune_patched_llama.py", *command]) + "`"]
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
    return result


if __name__ == "__main__":
    main()
