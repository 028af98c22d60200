"""A real ``transformers.Trainer`` under accelerate's context parallelism (``TrainingArguments(parallelism_config=
ParallelismConfig(cp_size=2))``) with ``cta.ContextParallelCallback``: per model (a patched Llama, a native CTA
decoder), the logged training losses of a few steps and the evaluation loss, to compare with the same script on one
process (the native decoder's ``layer_types`` hidden from accelerate's guard while the Trainer prepares it, and
restored). Then a run without the callback: ``SiteWalls.of_forward`` refuses the untold sites on every rank before the first
step.

    python -m torch.distributed.run --standalone --nproc_per_node 2 context_parallel_trainer_worker.py OUT cpu|cuda \
        [cp|sp [KINDS]]   # KINDS: some of patched,native,untold (DeepSpeed's groups: one Trainer per process)
    python context_parallel_trainer_worker.py OUT cpu|cuda         # the one-process reference

writes ``OUT/{engine}-rank{r}.json`` (one process: ``OUT/single.json``). ``cpu``: 2 gloo ranks; torch has no CPU ring
attention, so the attention is made position-local (registered as ``sdpa``, the only implementation the Trainer
takes under context parallelism) and accelerate's refusal of CPU processes for a ParallelismConfig is lifted; torch's
``context_parallel`` still shards the Trainer's buffers and the PDE sites exchange their halos. ``cuda``: real sdpa
ring attention, FSDP2 (accelerate requires it for cp_size > 1), fp32; ``sp``: DeepSpeed Ulysses (sp_size 2,
CUDA only).
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS, BATCH = 4, 2
# Tokens per row: on CUDA each rank's shard is a multiple of 32 (torch 2.11's ring efficient attention merges a
# logsumexp padded to 32 columns: a 16-token shard fails there with a shape mismatch, patched or not).
LENGTHS = {"cpu": 32, "cuda": 128}


def model(kind, device):
    import cta
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = 2 if device == "cpu" else 4  # (no GQA: torch 2.11's ring sdpa rejects it)
    shape = dict(vocab_size=64, hidden_size=8 * heads, intermediate_size=16 * heads, num_hidden_layers=2,
                 num_attention_heads=heads, num_key_value_heads=heads)
    placement = ["embedding", "value", "attention_output", "mlp_output", "block_output"]
    if kind == "native":
        config = cta.CTAConfig.modern_decoder(pde_type="advection_diffusion", pde_steps=2, pde_alpha=0.2,
                                             pde_placement=placement, **shape)
        config._attn_implementation = "sdpa"
        return cta.CTAForCausalLM(config)
    return cta.patch_model(LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")), pde_type="wave",
                           pde_steps=2, init="paper", placement=placement)


def data(count, seed, length):
    ids = torch.randint(0, 64, (count, length), generator=torch.Generator().manual_seed(seed))
    # (position_ids: DeepSpeed Ulysses requires them in every batch; torch CP adds them where they are missing)
    return [{"input_ids": row, "labels": row, "attention_mask": torch.ones_like(row),
             "position_ids": torch.arange(length)} for row in ids]


def parallelism(engine, device, world):
    """The TrainingArguments that shard each sequence over ``world`` ranks: torch CP (FSDP2 on CUDA, which
    accelerate requires for it), or DeepSpeed Ulysses (ZeRO stage 0: the Trainer's own optimizer, as on one GPU)."""
    from accelerate import ParallelismConfig

    if engine == "sp":
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
        deepspeed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "gradient_clipping": "auto", "zero_optimization": {"stage": 0}}
        return dict(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=world, sp_handler=handler),
                    deepspeed=deepspeed)
    extra = dict(parallelism_config=ParallelismConfig(cp_size=world))
    if device == "cuda":
        extra.update(fsdp="full_shard", fsdp_config={"version": 2})
    return extra


def train(kind, device, world, told, out, engine="cp"):
    import cta
    from cta.pde_context_parallel import _site_holders
    from transformers import Trainer, TrainerCallback, TrainingArguments

    net = model(kind, device)
    seen = []

    class Recorder(TrainerCallback):  # what the sites hold when each step begins
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append(sorted({str(getattr(h, n) and getattr(h, n).shards(LENGTHS[device] // world).layout)
                                for h, n in _site_holders(net)}))

    extra = parallelism(engine, device, world) if world > 1 else {}
    args = TrainingArguments(output_dir=str(out / f"run-{kind}"), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             per_device_eval_batch_size=BATCH, learning_rate=1e-2, logging_steps=1, report_to="none",
                             save_strategy="no", use_cpu=device == "cpu", dataloader_num_workers=0, seed=0, **extra)
    callbacks = [Recorder()] + ([cta.ContextParallelCallback()] if told else [])
    trainer = Trainer(model=net, args=args, train_dataset=data(4 * BATCH * STEPS, 1, LENGTHS[device]),
                      eval_dataset=data(2 * BATCH, 2, LENGTHS[device]),
                      callbacks=callbacks)
    try:
        trainer.train()
    except ValueError as error:
        return {"error": str(error), "steps_begun": len(seen)}
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "eval_loss": trainer.evaluate()["eval_loss"], "sites": seen,
            "layer_types": getattr(net.config, "layer_types", None)}


def main(out, device, engine="cp", kinds="patched,native,untold"):
    out = Path(out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cuda":  # (fp32 against fp32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if device == "cpu":
        from context_parallel_worker import position_local_attention
        from transformers import AttentionInterface

        AttentionInterface.register("sdpa", position_local_attention)
        if world > 1:
            from accelerate import ParallelismConfig

            ParallelismConfig._validate_accelerator = lambda self, accelerator: None  # (CPU processes: see above)
    kinds = [k for k in kinds.split(",") if world > 1 or k != "untold"]
    results = {kind: train("patched" if kind == "untold" else kind, device, world, kind != "untold", out, engine)
               for kind in kinds}
    path = out / (f"{engine}-rank{os.environ['RANK']}.json" if world > 1 else "single.json")
    if path.exists():  # (a run of some kinds adds to an earlier one's)
        results = {**json.loads(path.read_text()), **results}
    path.write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:5])
