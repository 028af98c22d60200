#!/usr/bin/env python
"""Causal language modelling with a CTA decoder, shaped like transformers' ``run_clm.py`` (paper Tables 2-5 and
13: sequence length, PDE steps, PDE types, training-data fraction; PDE + sliding-window attention = the paper's
PDE-Longformer hybrid, Table 3).

Before any number is written, the trained model goes through a **leak check**: for several cut points ``t``, the
tokens after ``t`` are replaced by random ones and the logits at positions ``<= t`` must not change. If they do,
the script writes ``leak_check: FAILED`` and no perplexity, and exits with status 3.

    python examples/run_clm.py --block_size 512 --pde_steps 4 --output_dir runs/clm \
        --num_train_epochs 3 --learning_rate 1e-3 --per_device_train_batch_size 32

Data (loaded with ``datasets.load_dataset``): ``--dataset_name wikitext --dataset_config_name wikitext-2-raw-v1``
(Hub), your own ``--train_file`` / ``--validation_file`` / ``--test_file`` (text: one row per line; csv, json or
jsonl with ``--text_column_name``; optionally ``.gz``), or by default the offline WikiText-2 copy under
``--data_dir`` (``$CTA_DATA_DIR`` or ``../shared/data``; the tokenized ``wiki.*.tokens`` version). Every non-empty
row is tokenized (``--tokenizer_name``, default bert-base-uncased as the paper's code) and followed by the
tokenizer's eos (or sep) token; the token stream is cut into ``--block_size`` blocks (``group_texts``, as
transformers' script) and batched by ``DataCollatorForLanguageModeling(mlm=False)``. Perplexity is per token of
that tokenizer. Writes ``train_results.json``, ``eval_results.json`` (with ``perplexity``), ``test_results.json``,
``all_results.json`` and ``run_results.json`` to ``--output_dir``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import DataArguments, ModelArguments  # noqa: E402

import cta  # noqa: E402
from transformers import (  # noqa: E402
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
    set_seed,
)

logger = logging.getLogger("cta.examples.clm")


@dataclass
class DataTrainingArguments(DataArguments):
    """What data to train and evaluate on: the offline WikiText-2 copy (default), a Hub dataset, or your own files."""

    file_builders: ClassVar[tuple] = ("text", "csv", "json")

    dataset_folder: str = field(
        default="wikitext2", metadata={"help": "Folder under --data_dir with {train,validation,test}.txt.gz."}
    )
    block_size: int = field(default=256, metadata={"help": "Sequence length (paper: 256 / 512 / 1024)."})
    train_fraction: float = field(default=1.0, metadata={"help": "Fraction of the training blocks (a prefix)."})
    max_text_chars: Optional[int] = field(
        default=None, metadata={"help": "Tokenize only the first rows of each split, up to N characters (smoke tests)."}
    )
    architecture: str = field(
        default="paper",
        metadata={"help": "paper (learned positions, post-LN, GELU, as the authors' code) | modern (RoPE/RMSNorm/SwiGLU)."},
    )
    leak_check_samples: int = field(default=4, metadata={"help": "Sequences used by the leak check."})
    leak_check_tolerance: float = field(default=1e-4, metadata={"help": "Max |logit change| allowed (fp32)."})

    def __post_init__(self):
        if not 0.0 < self.train_fraction <= 1.0:
            raise ValueError(f"`--train_fraction` must be in (0, 1], got {self.train_fraction}.")
        if self.architecture not in ("paper", "modern"):
            raise ValueError(f"`--architecture` must be 'paper' or 'modern', got {self.architecture!r}.")
        super().__post_init__()


def load_raw_datasets(data_args, cache_dir):
    """``(DatasetDict with train [/ validation / test], description)``."""
    import datasets

    if data_args.dataset_name or data_args.train_file:
        return common.load_raw_datasets(data_args, cache_dir), data_args.source()
    base = os.path.join(data_args.data_dir or common.default_data_dir(), data_args.dataset_folder)
    files = {s: os.path.join(base, f"{s}.txt.gz") for s in ("train", "validation", "test")}
    if not os.path.exists(files["train"]):
        raise FileNotFoundError(
            f"{files['train']} not found: pass --data_dir (or CTA_DATA_DIR), --train_file, or --dataset_name."
        )
    raw = datasets.load_dataset("text", data_files={s: p for s, p in files.items() if os.path.exists(p)},
                                cache_dir=cache_dir)
    return raw, f"offline {data_args.dataset_folder} (tokenized wiki.*.tokens version)"


def first_chars(dataset, column, max_chars):
    """The first rows of ``dataset`` whose text (one newline per row) fits in ``max_chars`` characters."""
    lengths = np.cumsum([len(t or "") + 1 for t in dataset[column]])
    return dataset.select(range(int(np.searchsorted(lengths, max_chars, side="right"))))


@torch.no_grad()
def leak_check(model, input_ids: torch.Tensor, cut_points=None, tolerance: float = 1e-4, vocab_size=None, seed=0,
               upcast=True):
    """Changing tokens after position ``t`` must leave logits at positions ``<= t`` unchanged.

    Returns ``{"passed": bool, "max_abs_diff": float, "cut_points": [...], "tolerance": float}``. Runs in fp32 with
    the model in eval mode (restores its mode and dtype); ``upcast=False`` keeps the model's dtype (a model sharded by
    DeepSpeed ZeRO-3 keeps its bf16 partitions outside the module, which a dtype cast of the module would desync).
    """
    was_training = model.training
    dtype = next(model.parameters()).dtype
    model.eval()
    if upcast:
        model.float()
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    seq = input_ids.shape[1]
    vocab_size = vocab_size or model.config.vocab_size
    if cut_points is None:
        cut_points = sorted({0, 1, seq // 4, seq // 2, seq - 2})
    gen = torch.Generator().manual_seed(seed)
    reference = model(input_ids=input_ids, use_cache=False).logits.float()
    worst = 0.0
    for t in cut_points:
        if not 0 <= t < seq - 1:
            continue
        changed = input_ids.clone()
        noise = torch.randint(0, vocab_size, (input_ids.shape[0], seq - t - 1), generator=gen).to(device)
        changed[:, t + 1:] = noise
        logits = model(input_ids=changed, use_cache=False).logits.float()
        diff = (logits[:, :t + 1] - reference[:, :t + 1]).abs().max().item()
        worst = max(worst, diff)
    if upcast:
        model.to(dtype)
    model.train(was_training)
    return {"passed": bool(worst <= tolerance), "max_abs_diff": worst, "cut_points": list(cut_points),
            "tolerance": tolerance, "num_sequences": int(input_ids.shape[0]), "seq_len": int(seq)}


def build_model(model_args, data_args, vocab_size, pad_id):
    if model_args.model_name_or_path:
        return cta.CTAForCausalLM.from_pretrained(model_args.model_name_or_path,
                                                  attn_implementation=model_args.attn_implementation)
    common_kwargs = dict(
        vocab_size=vocab_size,
        max_position_embeddings=data_args.block_size,
        sliding_window=model_args.sliding_window,
        pad_token_id=pad_id,
        is_causal=True,
        **model_args.config_kwargs(),
    )
    if data_args.architecture == "paper":
        config = cta.CTAConfig.paper_encoder(hidden_dropout_prob=model_args.hidden_dropout_prob, **common_kwargs)
    else:
        config = cta.CTAConfig.modern_decoder(**common_kwargs)
    config._attn_implementation = model_args.attn_implementation
    return cta.CTAForCausalLM(config)


def main(argv=None):
    model_args, data_args, training_args = common.parse_arguments(
        (ModelArguments, DataTrainingArguments, TrainingArguments), argv)
    common.setup_logging(training_args)
    # Never gather [tokens x vocab] logits during evaluation: only the loss is needed.
    training_args.prediction_loss_only = True
    tokenizer_name = model_args.tokenizer_name or model_args.model_name_or_path or common.PAPER_TOKENIZER
    block_size = data_args.block_size
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="load datasets"):
        raw, texts_desc = load_raw_datasets(data_args, model_args.cache_dir)
    text_column = data_args.text_column_name or "text"
    common.require_column(raw, "text_column_name", text_column)
    if data_args.max_text_chars:
        raw = type(raw)({s: first_chars(d, text_column, data_args.max_text_chars) for s, d in raw.items()})
        texts_desc += f" (first {data_args.max_text_chars} characters of each split)"
    tokenizer = common.load_tokenizer(tokenizer_name)
    lm_datasets = common.lm_blocks(raw, tokenizer, text_column, block_size, data_args, training_args)
    train_dataset = lm_datasets["train"]
    n_train = int(len(train_dataset) * data_args.train_fraction)
    if n_train < 1:
        raise ValueError(f"No training block of {block_size} tokens in {texts_desc} (train_fraction "
                         f"{data_args.train_fraction}).")
    train_dataset = common.take(train_dataset.select(range(n_train)), data_args.max_train_samples)
    eval_split = "validation" if "validation" in lm_datasets else "test"
    eval_dataset = common.take(lm_datasets[eval_split], data_args.max_eval_samples)
    test_dataset = common.take(lm_datasets["test"], data_args.max_eval_samples) if "test" in lm_datasets else None
    logger.info("data: %s; %d train blocks of %d tokens", texts_desc, len(train_dataset), block_size)

    vocab_size = len(tokenizer)
    model = build_model(model_args, data_args, vocab_size, tokenizer.pad_token_id)
    n_params = common.count_parameters(model)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    # Every block has the same number of predicted tokens, so the per-device mean loss is already the token mean;
    # do not let Trainer rescale it by the number of processes (measured: 2x loss and perplexity**2 under torchrun
    # with 2 processes otherwise).
    trainer.model_accepts_loss_kwargs = False
    train_result, train_seconds, resume = common.train(trainer, training_args)

    # ---- leak check BEFORE any number is reported ----
    probe = torch.tensor(eval_dataset[: data_args.leak_check_samples]["input_ids"], dtype=torch.long)
    # Every rank runs it (a sharded model's forward is collective), in the model's own dtype when sharded.
    leak = leak_check(trainer.model, probe, tolerance=data_args.leak_check_tolerance, vocab_size=vocab_size,
                      upcast=not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled))
    results = dict(
        script="run_clm.py",
        task="causal_lm" if data_args.train_file else "wikitext_lm",
        data=texts_desc,
        tokenizer=tokenizer_name,
        architecture=data_args.architecture,
        block_size=block_size,
        train_fraction=data_args.train_fraction,
        num_train_blocks=len(train_dataset),
        num_train_tokens=len(train_dataset) * block_size,
        leak_check=leak,
        **common.run_record(trainer, training_args, model, n_params, resume),
        argv=sys.argv[1:] if argv is None else list(argv),
    )
    if not leak["passed"]:
        results["error"] = (f"LEAK CHECK FAILED: changing future tokens changed earlier logits by "
                            f"{leak['max_abs_diff']:.3g} > {leak['tolerance']}; no perplexity is reported.")
        logger.error(results["error"])
        if trainer.is_world_process_zero():
            common.write_run_results(training_args.output_dir, results)
        raise SystemExit(3)

    metrics = dict(train_result.metrics, train_samples=len(train_dataset))
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    for prefix, dataset in (("eval", eval_dataset), ("test", test_dataset)):
        if dataset is None:
            continue
        split_metrics = trainer.evaluate(dataset, metric_key_prefix=prefix)
        split_metrics[f"{prefix}_samples"] = len(dataset)
        split_metrics[f"{prefix}_perplexity"] = math.exp(min(split_metrics[f"{prefix}_loss"], 50))
        trainer.log_metrics(prefix, split_metrics)
        trainer.save_metrics(prefix, split_metrics)
        metrics.update(split_metrics)
    results.update(
        eval_split=eval_split,
        eval_loss=metrics.get("eval_loss"),
        eval_perplexity=metrics.get("eval_perplexity"),
        test_loss=metrics.get("test_loss"),
        test_perplexity=metrics.get("test_perplexity"),
        **common.training_record(trainer, metrics, train_seconds),
        train_tokens_per_second=(metrics.get("train_samples_per_second") or 0) * block_size,
        nan_in_training=any(not math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h),
    )
    common.finish_and_maybe_push(trainer, tokenizer, results,
                                 dict(task="text-generation", dataset=data_args.dataset_name or "wikitext"))
    if trainer.is_world_process_zero():
        common.write_run_results(training_args.output_dir, results)
    return results


if __name__ == "__main__":
    main()
