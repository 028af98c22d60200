#!/usr/bin/env python
"""Causal language modelling with CTA on WikiText-2 (paper Tables 2-5 and 13: sequence length, PDE steps, PDE
types, training-data fraction; PDE + sliding-window attention = the paper's PDE-Longformer hybrid, Table 3).

Before any number is written, the trained model goes through a **leak check**: for several cut points ``t``, the
tokens after ``t`` are replaced by random ones and the logits at positions ``<= t`` must not change. If they do,
the script writes ``leak_check: FAILED`` and no perplexity, and exits with status 3.

    python examples/run_clm.py --block_size 512 --pde_steps 4 --output_dir runs/clm \
        --num_train_epochs 3 --learning_rate 1e-3 --per_device_train_batch_size 32

Data: ``--dataset_name wikitext --dataset_config_name wikitext-2-raw-v1`` (Hub; also wikitext-103-*), local
``--train_file/--validation_file/--test_file`` (plain text, optionally .gz), or the offline WikiText-2 copy under
``--data_dir`` (default ``$CTA_DATA_DIR`` or ``../shared/data``; the tokenized ``wiki.*.tokens`` version).
Tokenizer: ``bert-base-uncased`` (as the paper's code) or any HF tokenizer; each non-empty line ends with the
tokenizer's eos/sep token. Perplexity is per token of that tokenizer.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import ModelArguments  # noqa: E402

import cta  # noqa: E402
from transformers import HfArgumentParser, Trainer, TrainingArguments, set_seed  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

logger = logging.getLogger("cta.examples.clm")


@dataclass
class DataArguments:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset, e.g. wikitext."})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "e.g. wikitext-2-raw-v1."})
    text_column: str = field(default="text", metadata={"help": "Text column of a Hub dataset."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Plain-text train file (.txt[.gz])."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Plain-text validation file."})
    test_file: Optional[str] = field(default=None, metadata={"help": "Plain-text test file."})
    data_dir: Optional[str] = field(default=None, metadata={"help": "Offline data root (wikitext2/ inside)."})
    dataset_folder: str = field(default="wikitext2", metadata={"help": "Folder under --data_dir."})
    tokenizer_name: str = field(default=common.PAPER_TOKENIZER, metadata={"help": "Tokenizer (paper: bert-base-uncased)."})
    block_size: int = field(default=256, metadata={"help": "Sequence length (paper: 256 / 512 / 1024)."})
    train_fraction: float = field(default=1.0, metadata={"help": "Fraction of the training tokens (a prefix)."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Cap on training blocks."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Cap on validation/test blocks."})
    architecture: str = field(
        default="paper",
        metadata={"help": "paper (learned positions, post-LN, GELU, as the authors' code) | modern (RoPE/RMSNorm/SwiGLU)."},
    )
    leak_check_samples: int = field(default=4, metadata={"help": "Sequences used by the leak check."})
    leak_check_tolerance: float = field(default=1e-4, metadata={"help": "Max |logit change| allowed (fp32)."})
    max_text_chars: Optional[int] = field(
        default=None, metadata={"help": "Tokenize only the first N characters of each split (smoke tests)."}
    )
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Token cache (default ~/.cache/cta_examples)."})

    def __post_init__(self):
        if not 0.0 < self.train_fraction <= 1.0:
            raise ValueError(f"`--train_fraction` must be in (0, 1], got {self.train_fraction}.")
        if self.architecture not in ("paper", "modern"):
            raise ValueError(f"`--architecture` must be 'paper' or 'modern', got {self.architecture!r}.")


def load_texts(data_args):
    """{"train": str, "validation": str, "test": str} and a description."""
    if data_args.dataset_name:
        import datasets

        ds = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
        texts = {s: "\n".join(ds[s][data_args.text_column]) for s in ("train", "validation", "test") if s in ds}
        return texts, f"Hub {data_args.dataset_name}/{data_args.dataset_config_name}"
    if data_args.train_file:
        files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
        return {s: common.read_text(p) for s, p in files.items() if p}, f"local files {files}"
    base = os.path.join(data_args.data_dir or common.default_data_dir(), data_args.dataset_folder)
    if not os.path.exists(os.path.join(base, "train.txt.gz")):
        raise FileNotFoundError(
            f"{base}/train.txt.gz not found: pass --data_dir (or CTA_DATA_DIR), --train_file, or --dataset_name."
        )
    texts = {s: common.read_text(os.path.join(base, f"{s}.txt.gz")) for s in ("train", "validation", "test")
             if os.path.exists(os.path.join(base, f"{s}.txt.gz"))}
    return texts, f"offline {data_args.dataset_folder} (tokenized wiki.*.tokens version)"


def tokenize_stream(tokenizer, text: str, batch_lines: int = 4000) -> np.ndarray:
    """One token stream: every non-empty line, then the eos (or sep) token."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    lines = [line for line in text.split("\n") if line.strip()]
    out = []
    for i in range(0, len(lines), batch_lines):
        enc = tokenizer(lines[i:i + batch_lines], add_special_tokens=False)["input_ids"]
        for ids in enc:
            out.extend(ids)
            if eos is not None:
                out.append(eos)
    return np.asarray(out, dtype=np.int32)


def blocks(stream: np.ndarray, block_size: int, limit=None):
    n = len(stream) // block_size
    if limit is not None:
        n = min(n, limit)
    return [{"input_ids": stream[i * block_size:(i + 1) * block_size].tolist(),
             "labels": stream[i * block_size:(i + 1) * block_size].tolist()} for i in range(n)]


@torch.no_grad()
def leak_check(model, input_ids: torch.Tensor, cut_points=None, tolerance: float = 1e-4, vocab_size=None, seed=0):
    """Changing tokens after position ``t`` must leave logits at positions ``<= t`` unchanged.

    Returns ``{"passed": bool, "max_abs_diff": float, "cut_points": [...], "tolerance": float}``. Runs in fp32 with
    the model in eval mode (restores its mode and dtype).
    """
    was_training = model.training
    dtype = next(model.parameters()).dtype
    model.eval()
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
        hidden_size=model_args.hidden_size,
        num_hidden_layers=model_args.num_hidden_layers,
        num_attention_heads=model_args.num_attention_heads,
        intermediate_size=model_args.intermediate_size,
        max_position_embeddings=data_args.block_size,
        sliding_window=model_args.sliding_window,
        pad_token_id=pad_id,
        is_causal=True,
        **model_args.pde_kwargs(),
    )
    if data_args.architecture == "paper":
        config = cta.CTAConfig.paper_encoder(hidden_dropout_prob=model_args.hidden_dropout_prob, **common_kwargs)
    else:
        config = cta.CTAConfig.modern_decoder(**common_kwargs)
    config._attn_implementation = model_args.attn_implementation
    return cta.CTAForCausalLM(config)


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    common.setup_logging(training_args)
    # Never gather [tokens x vocab] logits during evaluation: only the loss is needed.
    training_args.prediction_loss_only = True
    cache_dir = data_args.cache_dir or common.default_cache_dir()
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="load + tokenize"):
        tokenizer = common.load_tokenizer(data_args.tokenizer_name)
        texts_desc = None

        def make():
            texts, desc = load_texts(data_args)
            if data_args.max_text_chars:
                texts = {k: v[: data_args.max_text_chars] for k, v in texts.items()}
                desc += f" (first {data_args.max_text_chars} characters of each split)"
            return {s: tokenize_stream(tokenizer, t) for s, t in texts.items()}, desc

        source = data_args.dataset_name or data_args.train_file or os.path.join(
            data_args.data_dir or common.default_data_dir(), data_args.dataset_folder)
        streams, texts_desc = common.cached(
            cache_dir, dict(kind="lm", source=source, config=data_args.dataset_config_name,
                            tok=data_args.tokenizer_name, chars=data_args.max_text_chars), make)
    train_stream = streams["train"][: int(len(streams["train"]) * data_args.train_fraction)]
    train_blocks = blocks(train_stream, data_args.block_size, data_args.max_train_samples)
    eval_split = "validation" if "validation" in streams else "test"
    eval_blocks = blocks(streams[eval_split], data_args.block_size, data_args.max_eval_samples)
    test_blocks = blocks(streams["test"], data_args.block_size, data_args.max_eval_samples) if "test" in streams else None
    logger.info("data: %s; %d train tokens -> %d blocks of %d", texts_desc, len(train_stream), len(train_blocks),
                data_args.block_size)

    pad_id = common.tokenizer_pad_id(tokenizer)
    vocab_size = common.tokenizer_vocab_size(tokenizer)
    model = build_model(model_args, data_args, vocab_size, pad_id)
    n_params = common.count_parameters(model)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=common.ListDataset(train_blocks),
        eval_dataset=common.ListDataset(eval_blocks),
        data_collator=common.PadCollator(pad_id, pad_to_multiple_of=None),
    )
    # Every block has the same number of predicted tokens, so the per-device mean loss is already the token mean;
    # do not let Trainer rescale it by the number of processes (measured: 2x loss and perplexity**2 under torchrun
    # with 2 processes otherwise).
    trainer.model_accepts_loss_kwargs = False
    last_checkpoint = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
    resume = training_args.resume_from_checkpoint or last_checkpoint
    start = time.time()
    train_result = trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.time() - start

    # ---- leak check BEFORE any number is reported ----
    probe = torch.tensor([b["input_ids"] for b in eval_blocks[: data_args.leak_check_samples]], dtype=torch.long)
    leak = leak_check(trainer.model, probe, tolerance=data_args.leak_check_tolerance, vocab_size=vocab_size)
    results = dict(
        script="run_clm.py",
        task="wikitext_lm",
        data=texts_desc,
        tokenizer=data_args.tokenizer_name,
        architecture=data_args.architecture,
        block_size=data_args.block_size,
        train_fraction=data_args.train_fraction,
        num_train_blocks=len(train_blocks),
        num_train_tokens=len(train_blocks) * data_args.block_size,
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

    metrics = dict(train_result.metrics)
    eval_metrics = trainer.evaluate()
    metrics.update(eval_metrics)
    metrics["eval_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50))
    if test_blocks:
        test_metrics = trainer.evaluate(common.ListDataset(test_blocks), metric_key_prefix="test")
        metrics.update(test_metrics)
        metrics["test_perplexity"] = math.exp(min(test_metrics["test_loss"], 50))
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    results.update(
        eval_split=eval_split,
        eval_loss=metrics.get("eval_loss"),
        eval_perplexity=metrics.get("eval_perplexity"),
        test_loss=metrics.get("test_loss"),
        test_perplexity=metrics.get("test_perplexity"),
        train_loss=metrics.get("train_loss"),
        train_runtime=metrics.get("train_runtime"),
        train_wall_seconds=train_seconds,
        train_samples_per_second=metrics.get("train_samples_per_second"),
        train_tokens_per_second=(metrics.get("train_samples_per_second") or 0) * data_args.block_size,
        loss_history=[{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h],
        nan_in_training=any(not math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h),
    )
    common.finish_and_maybe_push(trainer, tokenizer, results, dict(task="text-generation", dataset="wikitext"))
    if trainer.is_world_process_zero():
        common.write_run_results(training_args.output_dir, results)
    return results


if __name__ == "__main__":
    main()
