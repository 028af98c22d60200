"""Shared helpers of the example scripts: where data and tokenizers live, the model arguments, thin wrappers over
`datasets.load_dataset` / tokenizer / `evaluate.load` calls, result files and the Hub hook.

The scripts hold no dataset, collator, tokenizer or metric class of their own: data are `datasets.Dataset`s
(cached by `datasets`), batches come from transformers' collators, tokenizers are transformers tokenizers
(``ByT5Tokenizer`` for bytes, a `tokenizers` word-level model for ListOps) and metrics are `evaluate` modules
loaded by path (``examples/metrics``). Requirements: ``pip install -r examples/requirements.txt``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import subprocess
import sys
from dataclasses import dataclass, field
from typing import ClassVar, Optional

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
def shared_dir() -> str:
    """``$CTA_SHARED_DIR`` or ``../shared`` next to the repository root: the offline data (``data``), tokenizers
    (``tokenizers``) and models (``models``) a development checkout has beside it. A user's clone has none; tests
    point ``CTA_SHARED_DIR`` at an empty folder to run as such a clone."""
    return os.environ.get("CTA_SHARED_DIR") or os.path.normpath(os.path.join(REPO_ROOT, "..", "shared"))


def default_data_dir() -> str:
    """``$CTA_DATA_DIR`` or ``data`` in :func:`shared_dir`."""
    return os.environ.get("CTA_DATA_DIR") or os.path.join(shared_dir(), "data")


def default_tokenizer_dir() -> str:
    """``$CTA_TOKENIZER_DIR`` or ``tokenizers`` in :func:`shared_dir` (holds ``bert-base-uncased``)."""
    return os.environ.get("CTA_TOKENIZER_DIR") or os.path.join(shared_dir(), "tokenizers")


def default_model_path(name: str) -> str:
    """``models/<name>`` in :func:`shared_dir` (e.g. ``stories260K``)."""
    return os.path.join(shared_dir(), "models", name)


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
# data, tokenizers, metrics: thin wrappers over `datasets`, `transformers` / `tokenizers` and `evaluate`
LOCAL_FILE_BUILDERS = {"csv": "csv", "json": "json", "jsonl": "json", "txt": "text", "text": "text"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")


def file_builder(paths, allowed=("csv", "json")) -> str:
    """The `datasets` builder (``csv``, ``json`` or ``text``) for local files, from their extension (``.csv``,
    ``.json``, ``.jsonl``, ``.txt``; a ``.gz``/``.bz2``/``.xz``/``.zst`` suffix is read through). All files must
    share one builder."""
    builders = set()
    for path in paths:
        name = path.lower()
        for suffix in COMPRESSIONS:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        builder = LOCAL_FILE_BUILDERS.get(name.rsplit(".", 1)[-1])
        if builder not in allowed:
            kinds = sorted(ext for ext, b in LOCAL_FILE_BUILDERS.items() if b in allowed)
            raise ValueError(f"{path}: a data file must end in one of {kinds} (optionally compressed).")
        builders.add(builder)
    if len(builders) > 1:
        raise ValueError(f"--train_file / --validation_file / --test_file must be of one kind, got {sorted(builders)}.")
    return builders.pop()


def load_raw_datasets(data_args, cache_dir=None):
    """``datasets.load_dataset``: the Hub dataset ``--dataset_name`` (+ ``--dataset_config_name``), or the local
    ``--train_file`` / ``--validation_file`` / ``--test_file`` as splits ``train`` / ``validation`` / ``test``."""
    import datasets

    if data_args.dataset_name:
        return datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache_dir)
    files = {split: path for split, path in (("train", data_args.train_file), ("validation", data_args.validation_file),
                                              ("test", data_args.test_file)) if path}
    return datasets.load_dataset(file_builder(files.values(), data_args.file_builders), data_files=files,
                                 cache_dir=cache_dir)


def take(dataset, n: Optional[int], seed: Optional[int] = None):
    """The first ``n`` rows (all when ``n`` is None or larger); with ``seed``, ``n`` rows of a seeded shuffle."""
    if n is None or n >= len(dataset):
        return dataset
    return (dataset if seed is None else dataset.shuffle(seed=seed)).select(range(n))


def require_column(raw, argument: str, column: str, splits=None) -> None:
    """Raises a ValueError naming ``--argument`` and listing the columns the data has when ``column`` is missing
    from one of ``splits`` (default: every split) of the DatasetDict ``raw`` (a bare KeyError would follow)."""
    for split, dataset in raw.items():
        if (splits is None or split in splits) and column not in dataset.column_names:
            raise ValueError(
                f"--{argument} {column!r} is not a column of the {split} data: its columns are "
                f"{dataset.column_names}. Pass --{argument} with one of them."
            )


def lm_blocks(raw, tokenizer, text_column: str, block_size: int, data_args, training_args,
              add_special_tokens: bool = False, with_labels: bool = False):
    """transformers' run_clm.py preprocessing, cached by `datasets`: every non-empty row of ``text_column`` is
    tokenized and followed by the tokenizer's eos (else sep) token, the ids are concatenated and cut into
    ``block_size`` blocks (``group_texts``; each map batch of 1,000 rows drops its remainder). Two
    ``.map(batched=True)`` under ``main_process_first``. ``with_labels`` adds ``labels`` (a copy of ``input_ids``)
    for ``default_data_collator``; ``DataCollatorForLanguageModeling`` makes them itself."""
    from itertools import chain

    require_column(raw, "text_column_name", text_column)
    eos = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id]
    eos = [] if eos[0] is None else eos

    def tokenize_function(examples):
        texts = [t or "" for t in examples[text_column]]
        ids = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": [x + eos if t.strip() else [] for x, t in zip(ids, texts)]}

    def group_texts(examples):
        concatenated = list(chain(*examples["input_ids"]))
        total = len(concatenated) // block_size * block_size
        result = {"input_ids": [concatenated[i:i + block_size] for i in range(0, total, block_size)]}
        if with_labels:
            result["labels"] = [list(block) for block in result["input_ids"]]
        return result

    columns = next(iter(raw.values())).column_names
    with training_args.main_process_first(desc="dataset map pre-processing"):
        tokenized = raw.map(tokenize_function, batched=True, num_proc=data_args.preprocessing_num_workers,
                            remove_columns=columns, load_from_cache_file=not data_args.overwrite_cache,
                            desc="Running tokenizer on dataset")
        return tokenized.map(group_texts, batched=True, num_proc=data_args.preprocessing_num_workers,
                             load_from_cache_file=not data_args.overwrite_cache,
                             desc=f"Grouping texts in chunks of {block_size}")


def load_tokenizer(name: str):
    """A transformers tokenizer: ``byte`` -> ``ByT5Tokenizer(extra_ids=0)`` (UTF-8 bytes, ids byte + 3, 0 = pad,
    1 = eos), ``listops`` -> the ListOps word-level tokenizer (``listops.tokenizer()``), else
    ``AutoTokenizer.from_pretrained`` (a local copy in ``$CTA_TOKENIZER_DIR`` first)."""
    if name == "byte":
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer(extra_ids=0)
    if name == "listops":
        import listops

        return listops.tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_tokenizer_path(name))


def load_accuracy_metric():
    """``evaluate.load`` of the repository's accuracy module (by path: no Hub access)."""
    import evaluate

    metric = evaluate.load(ACCURACY_METRIC_PATH)
    metric.name_for_results = "evaluate:examples/metrics/accuracy"
    return metric


def last_checkpoint(training_args) -> Optional[str]:
    """``--resume_from_checkpoint``, else the newest checkpoint in ``--output_dir`` (an interrupted run resumes)."""
    from transformers.trainer_utils import get_last_checkpoint

    if training_args.resume_from_checkpoint:
        return training_args.resume_from_checkpoint
    if os.path.isdir(training_args.output_dir) and not getattr(training_args, "overwrite_output_dir", False):
        return get_last_checkpoint(training_args.output_dir)
    return None


def train(trainer, training_args):
    """``trainer.train()``, resuming the run's last checkpoint (:func:`last_checkpoint`): (its ``TrainOutput``, wall
    seconds, the checkpoint resumed or None)."""
    resume = last_checkpoint(training_args)
    start = time.time()
    result = trainer.train(resume_from_checkpoint=resume)
    return result, time.time() - start, resume


# ---------------------------------------------------------------------------------------------------------------
# model arguments shared by the scripts
# The size of a fresh model as both scripts set it (and its results JSON records it).
MODEL_SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


@dataclass
class PretrainedArguments:
    """Which model and tokenizer to start from, as in transformers' example scripts."""

    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Start from this CTA checkpoint (folder or Hub id) instead of a fresh model."}
    )
    tokenizer_name: Optional[str] = field(
        default=None,
        metadata={"help": "Pretrained tokenizer name or path if not the same as model_name_or_path (default: the "
                          "task's: bert-base-uncased, `byte` = ByT5 bytes, `listops`). Local copies in "
                          "$CTA_TOKENIZER_DIR (default $CTA_SHARED_DIR/tokenizers, ../shared/tokenizers) come first."},
    )
    cache_dir: Optional[str] = field(
        default=None, metadata={"help": "Where datasets (and Hub downloads) are cached (default: datasets' cache)."}
    )


@dataclass
class ModelArguments(PretrainedArguments):
    """A fresh CTA model's size and PDE refinement (ignored for a checkpoint's architecture)."""

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

    def config_kwargs(self) -> dict:
        """The ``CTAConfig`` keywords of a fresh model: its size (:data:`MODEL_SIZE_FIELDS`) and PDE refinement."""
        placement = [p.strip() for p in self.pde_placement.split(",") if p.strip()]
        kwargs = dict(
            {name: getattr(self, name) for name in MODEL_SIZE_FIELDS},
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


@dataclass
class DataArguments:
    """The data options both scripts share, named as in transformers' example scripts. A script subclasses it with
    its own options and sets ``file_builders``: the kinds of local files it reads."""

    file_builders: ClassVar[tuple] = ("csv", "json")

    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "The name of the dataset to use (via the datasets library)."}
    )
    dataset_config_name: Optional[str] = field(
        default=None, metadata={"help": "The configuration name of the dataset to use (via the datasets library)."}
    )
    train_file: Optional[str] = field(
        default=None,
        metadata={"help": "A file containing the training data: csv, json or jsonl (run_clm.py: also text, one row "
                          "per line); .gz / .bz2 / .xz / .zst are read through."},
    )
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "A file of the same kind containing the validation (evaluation) data."}
    )
    test_file: Optional[str] = field(
        default=None, metadata={"help": "A file of the same kind containing the test data."}
    )
    text_column_name: Optional[str] = field(
        default=None,
        metadata={"help": "The name of the text column in the dataset or files (default: `text`, else `sentence`).",
                  "aliases": ["--text_column"]},
    )
    max_train_samples: Optional[int] = field(
        default=None,
        metadata={"help": "For debugging purposes or quicker training, truncate the number of training examples "
                          "(run_clm.py: blocks) to this value if set."},
    )
    max_eval_samples: Optional[int] = field(
        default=None,
        metadata={"help": "For debugging purposes or quicker training, truncate the number of evaluation examples "
                          "(run_clm.py: validation and test blocks) to this value if set."},
    )
    preprocessing_num_workers: Optional[int] = field(
        default=None, metadata={"help": "The number of processes to use for the preprocessing."}
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Overwrite the cached preprocessed datasets or not."}
    )
    data_dir: Optional[str] = field(
        default=None, metadata={"help": "Root of the offline copies of the paper's data (default $CTA_DATA_DIR or "
                                        "$CTA_SHARED_DIR/data, ../shared/data)."}
    )

    def __post_init__(self):
        files = [f for f in (self.train_file, self.validation_file, self.test_file) if f]
        if files and not self.train_file:
            raise ValueError("`--validation_file` / `--test_file` need `--train_file`.")
        if files and not self.dataset_name:
            file_builder(files, self.file_builders)

    def source(self) -> str:
        if self.dataset_name:
            return f"Hub {self.dataset_name}/{self.dataset_config_name}"
        return "local files " + ", ".join(f for f in (self.train_file, self.validation_file, self.test_file) if f)


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
    keep = (*MODEL_SIZE_FIELDS, "sliding_window", "vocab_size")
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


def training_record(trainer, metrics: dict, train_seconds: float) -> dict:
    """The training fields every run's results JSON shares: the train metrics and the logged loss curve."""
    return dict(
        train_loss=metrics.get("train_loss"),
        train_runtime=metrics.get("train_runtime"),
        train_wall_seconds=train_seconds,
        train_samples_per_second=metrics.get("train_samples_per_second"),
        loss_history=[{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h],
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


def parse_arguments(dataclass_types, argv=None, **defaults):
    """The arguments as transformers' example scripts read them: a single ``.json`` file of arguments, or the
    command line (``argv``; None: ``sys.argv``). ``defaults`` override the dataclasses' own defaults."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_types)
    parser.set_defaults(**defaults)
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    return parser.parse_args_into_dataclasses(args=argv)


def setup_logging(training_args):
    """As transformers' example scripts: this script's INFO lines on the main process; transformers and datasets at
    ``--log_level`` (default: warnings)."""
    import transformers

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)],
                        level=logging.INFO if is_main_process(training_args) else logging.WARNING)
    log_level = training_args.get_process_log_level()
    try:  # (finetune_patched_llama.py --study runs where `datasets` is not installed)
        import datasets

        datasets.utils.logging.set_verbosity(log_level)
    except ImportError:
        pass
    transformers.utils.logging.set_verbosity(log_level)
