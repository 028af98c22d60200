"""Shared helpers of the example scripts: data location and loading, tokenizers, collators, metrics, model
construction from script arguments, result files and the Hub hook.

Nothing here needs `datasets` or `evaluate` for local files: the GPU image may lack them. `datasets` is used for
``--dataset_name`` (Hub) and `evaluate` for metrics when importable (with an evaluate-compatible fallback).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import os
import pickle
import random
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(EXAMPLES_DIR)
if REPO_ROOT not in sys.path:  # `python examples/run_x.py` from anywhere, without installing the package
    sys.path.insert(0, REPO_ROOT)
if EXAMPLES_DIR not in sys.path:
    sys.path.insert(0, EXAMPLES_DIR)

import cta  # noqa: E402  (registers the Auto classes)

logger = logging.getLogger("cta.examples")

ACCURACY_METRIC_PATH = os.path.join(EXAMPLES_DIR, "metrics", "accuracy", "accuracy.py")
PAPER_TOKENIZER = "bert-base-uncased"


# ---------------------------------------------------------------------------------------------------------------
# locations
def default_data_dir() -> str:
    """``$CTA_DATA_DIR`` or ``../shared/data`` next to the repository root."""
    return os.environ.get("CTA_DATA_DIR") or os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "data"))


def default_tokenizer_dir() -> str:
    """``$CTA_TOKENIZER_DIR`` or ``../shared/tokenizers`` (holds ``bert-base-uncased``)."""
    return os.environ.get("CTA_TOKENIZER_DIR") or os.path.normpath(
        os.path.join(REPO_ROOT, "..", "shared", "tokenizers")
    )


def default_cache_dir() -> str:
    return os.environ.get("CTA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cta_examples")


def resolve_tokenizer_path(name: str) -> str:
    """A local copy of a tokenizer when one exists (offline machines), else the name for the Hub."""
    if os.path.isdir(name):
        return name
    local = os.path.join(default_tokenizer_dir(), name)
    return local if os.path.isdir(local) else name


def git_commit() -> Optional[str]:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, stderr=subprocess.DEVNULL,
                                       text=True).strip()
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------------------------
# files and caching
def read_jsonl(path: str) -> List[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def cached(cache_dir: Optional[str], key: dict, fn):
    """``fn()`` memoised on disk under a hash of ``key``. A file lock makes concurrent processes (reproduce.py
    ``--jobs N``, DDP ranks) compute it once; writes are atomic, so a killed run never leaves a bad cache file."""
    if not cache_dir:
        return fn()
    os.makedirs(cache_dir, exist_ok=True)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = os.path.join(cache_dir, f"{key.get('kind', 'data')}-{digest}.pkl")
    lock = None
    try:
        import fcntl

        lock = open(path + ".lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    except (ImportError, OSError):
        lock = None
    try:
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    return pickle.load(f)
            except Exception:  # noqa: BLE001  (unreadable cache: rebuild)
                pass
        value = fn()
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        return value
    finally:
        if lock is not None:
            lock.close()


def file_signature(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{int(st.st_mtime)}"


# ---------------------------------------------------------------------------------------------------------------
# tokenizers
class ByteTokenizer:
    """UTF-8 byte tokenizer for the LRA byte-level tasks, with the ids of ``transformers.ByT5Tokenizer``:
    0 = pad, 1 = eos, 2 = unk, byte ``b`` -> ``b + 3`` (vocabulary 259). No eos is appended by ``encode``.

    ``to_hf()`` returns the equivalent ``ByT5Tokenizer`` (saved with checkpoints, so Hub users decode the same ids).
    """

    pad_token_id = 0
    eos_token_id = 1
    unk_token_id = 2
    offset = 3
    vocab_size = 259
    model_input_names = ["input_ids", "attention_mask"]

    def encode(self, text: str, max_length: Optional[int] = None) -> List[int]:
        data = text.encode("utf-8")
        if max_length is not None:
            data = data[:max_length]
        return [b + self.offset for b in data]

    def decode(self, ids) -> str:
        return bytes(int(i) - self.offset for i in ids if int(i) >= self.offset).decode("utf-8", errors="replace")

    def to_hf(self):
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer(extra_ids=0)

    def save_pretrained(self, directory):
        try:
            return self.to_hf().save_pretrained(directory)
        except Exception as exc:  # noqa: BLE001  (saving the tokenizer is a convenience)
            logger.warning("could not save the ByT5 tokenizer: %s", exc)


class ListOpsTokenizer:
    """Whitespace tokenizer over the fixed ListOps vocabulary (0 = pad)."""

    pad_token_id = 0

    def __init__(self):
        import listops

        self.vocab = listops.VOCAB
        self.vocab_size = len(listops.VOCAB)
        self._encode = listops.encode

    def encode(self, text: str, max_length: Optional[int] = None) -> List[int]:
        ids = self._encode(text)
        return ids[:max_length] if max_length is not None else ids

    def save_pretrained(self, directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "listops_vocab.json"), "w") as f:
            json.dump(list(self.vocab), f)


def load_tokenizer(name: str):
    """``byte`` -> ByteTokenizer, ``listops`` -> ListOpsTokenizer, else a transformers tokenizer (local copy first)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "listops":
        return ListOpsTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_tokenizer_path(name))


def tokenize_texts(tokenizer, texts: List[str], max_length: int, batch_size: int = 2000) -> List[List[int]]:
    """Token ids per text, truncated to ``max_length`` (special tokens included for HF tokenizers)."""
    if isinstance(tokenizer, (ByteTokenizer, ListOpsTokenizer)):
        return [tokenizer.encode(t, max_length) for t in texts]
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i:i + batch_size], truncation=True, max_length=max_length)
        out.extend(enc["input_ids"])
    return out


def tokenizer_pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def tokenizer_vocab_size(tokenizer) -> int:
    return len(tokenizer) if hasattr(tokenizer, "__len__") else int(tokenizer.vocab_size)


# ---------------------------------------------------------------------------------------------------------------
# datasets and collators
class ListDataset(torch.utils.data.Dataset):
    """A list of feature dicts (``input_ids``, ``labels``); Trainer accepts any map-style dataset."""

    def __init__(self, rows: List[dict]):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class PadCollator:
    """Pads ``input_ids`` to the longest in the batch (rounded up to ``pad_to_multiple_of``), builds
    ``attention_mask``; ``labels`` are stacked (classification) or padded with -100 (token labels)."""

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: Optional[int] = 8):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features):
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = int(math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of)
        ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(features), length), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            mask[i, :n] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if "labels" in features[0]:
            first = features[0]["labels"]
            if isinstance(first, (list, tuple)):
                labels = torch.full((len(features), length), -100, dtype=torch.long)
                for i, f in enumerate(features):
                    labels[i, :len(f["labels"])] = torch.as_tensor(f["labels"], dtype=torch.long)
                batch["labels"] = labels
            else:
                batch["labels"] = torch.as_tensor([f["labels"] for f in features], dtype=torch.long)
        return batch


def subsample(rows: list, n: Optional[int], seed: int = 0) -> list:
    """A seeded random subset of ``n`` rows (all when ``n`` is None or larger)."""
    if n is None or n >= len(rows):
        return rows
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    return [rows[i] for i in sorted(idx[:n])]


# ---------------------------------------------------------------------------------------------------------------
# metrics
class _FallbackAccuracy:
    """Same call and result as ``evaluate.load(examples/metrics/accuracy/accuracy.py)`` (used without evaluate)."""

    name = "accuracy (fallback: evaluate not importable)"

    def compute(self, predictions, references, normalize=True, sample_weight=None):
        predictions, references = list(predictions), list(references)
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions but {len(references)} references.")
        weights = [1.0] * len(predictions) if sample_weight is None else [float(w) for w in sample_weight]
        correct = sum(w for p, r, w in zip(predictions, references, weights) if int(p) == int(r))
        total = sum(weights)
        return {"accuracy": (float(correct / total) if total else 0.0) if normalize else correct}


def load_accuracy_metric():
    """The repo's accuracy module through ``evaluate`` (no Hub access); an identical fallback without it."""
    try:
        import evaluate

        metric = evaluate.load(ACCURACY_METRIC_PATH)
        metric.name_for_results = "evaluate:examples/metrics/accuracy"
        return metric
    except ImportError:
        metric = _FallbackAccuracy()
        metric.name_for_results = "fallback accuracy (evaluate not installed)"
        return metric


# ---------------------------------------------------------------------------------------------------------------
# model arguments shared by the scripts
@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Start from this CTA checkpoint instead of a fresh model."}
    )
    hidden_size: int = field(default=128, metadata={"help": "Embedding / hidden size (paper: 128)."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Transformer blocks (paper Table 1: 2 and 4)."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads (paper: 4)."})
    intermediate_size: int = field(default=256, metadata={"help": "FFN inner size (paper: 256)."})
    hidden_dropout_prob: float = field(default=0.1, metadata={"help": "Dropout."})
    pde_type: str = field(
        default="diffusion", metadata={"help": "diffusion | wave | reaction_diffusion | advection_diffusion"}
    )
    pde_steps: int = field(default=1, metadata={"help": "PDE steps per site; 0 = the plain-transformer baseline."})
    pde_placement: str = field(
        default="block_output",
        metadata={"help": "Comma-separated: embedding,value,attention_output,mlp_output,block_output,attention_matrix"},
    )
    pde_alpha: float = field(default=0.1, metadata={"help": "Initial diffusion coefficient."})
    pde_beta: Optional[float] = field(default=None, metadata={"help": "Initial reaction/advection coefficient."})
    pde_per_channel: bool = field(default=False, metadata={"help": "One coefficient per channel."})
    pde_backend: str = field(default="auto", metadata={"help": "auto | torch | triton"})
    sliding_window: Optional[int] = field(
        default=None, metadata={"help": "Local attention window (PDE + sliding-window hybrid; paper: 256)."}
    )
    attn_implementation: str = field(default="sdpa", metadata={"help": "eager | sdpa | flash_attention_2"})

    def pde_kwargs(self) -> dict:
        placement = [p.strip() for p in self.pde_placement.split(",") if p.strip()]
        kwargs = dict(
            pde_type=self.pde_type,
            pde_steps=self.pde_steps,
            pde_placement=placement[0] if len(placement) == 1 else placement,
            pde_alpha=self.pde_alpha,
            pde_per_channel=self.pde_per_channel,
            pde_backend=self.pde_backend,
        )
        if self.pde_beta is not None:
            kwargs["pde_beta"] = self.pde_beta
        return kwargs


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# results and the Hub hook
def is_main_process(training_args) -> bool:
    return training_args.process_index == 0


def device_description() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores)"


def write_run_results(output_dir: str, results: dict):
    """``run_results.json``: everything reproduce.py aggregates (written last: its presence = run complete)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "run_results.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)
    return path


def run_record(trainer, training_args, model, n_params, resume) -> dict:
    """The fields every run's results JSON shares: schedule, scale, PDE config, provenance."""
    keep = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "sliding_window",
            "vocab_size")
    return dict(
        epochs=training_args.num_train_epochs if training_args.max_steps <= 0 else None,
        max_steps=training_args.max_steps if training_args.max_steps > 0 else None,
        global_steps=trainer.state.global_step,
        world_size=training_args.world_size,
        per_device_train_batch_size=training_args.per_device_train_batch_size,
        learning_rate=training_args.learning_rate,
        seed=training_args.seed,
        n_parameters=n_params,
        model_config={k: v for k, v in model.config.to_dict().items() if k.startswith("pde_") or k in keep},
        resumed_from=resume,
        device=device_description(),
        git_commit=git_commit(),
    )


def finish_and_maybe_push(trainer, tokenizer, results: dict, card_kwargs: dict):
    """Saves model + tokenizer, writes the CTA model card (``cta.hub.write_model_card``: model-index filled from
    ``results``) and, with ``--push_to_hub``, exports a self-contained Hub folder and pushes it with the same card
    (``cta.hub.publish_trainer_model``)."""
    args = trainer.args
    if not (args.push_to_hub or args.save_strategy != "no"):
        return
    trainer.save_model()
    if trainer.is_world_process_zero() and tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(args.output_dir)
    if not trainer.is_world_process_zero():
        return
    from cta import hub

    hub.write_model_card(args.output_dir, results=results, **card_kwargs)
    if args.push_to_hub:
        # Not trainer.push_to_hub(): it would replace our card with Trainer's generic one and upload pickles.
        hub.publish_trainer_model(trainer, results=results, task=card_kwargs.get("task"),
                                  dataset=card_kwargs.get("dataset"), tokenizer=args.output_dir)


def setup_logging(training_args):
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO
                        if is_main_process(training_args) else logging.WARNING)
    import transformers

    transformers.utils.logging.set_verbosity_warning()


def asdict_safe(obj) -> dict:
    return {k: v for k, v in asdict(obj).items()}
