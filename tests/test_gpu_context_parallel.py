"""Context parallelism on 2 GPUs (issue #52): torch's ``context_parallel`` around a tiny fp32 Llama (sdpa) patched
with every placement outside the attention matrix, and around a native CTA decoder, after ``cta.shard_sequences``,
gives the single-GPU logits, loss and gradients (1e-4), for every PDE type, under torch's head-tail load balancing
(sequence 256).

The attention modules get accelerate's context-parallel pre-hook (the mask dropped, ``is_causal=True``), so the test
needs no accelerate. Run as
``CTA_TEST_GPU=1 pytest -m gpu tests/test_gpu_context_parallel.py`` on a machine with 2 GPUs; the test launches this
file under torchrun (NCCL).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

PDE_TYPES = ("diffusion", "wave", "reaction_diffusion", "advection_diffusion")
LENGTHS = {"head_tail": 256}  # (torch 2.11's load balancer asserts a multiple of 2 * cp_size: no contiguous
# fallback there; the contiguous layout is tested on 2 gloo ranks, test_context_parallel)
STEPS = 3
TOLERANCE = 1e-4
KINDS = ("patched", "native")
PLACEMENTS = ["embedding", "value", "attention_output", "mlp_output", "block_output"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_context_parallel_matches_one_gpu(tmp_path):
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # (conftest's CPU default: the sites run the compiled kernels here)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(f"{k}-{t}-{layout}" for k in KINDS for t in PDE_TYPES for layout in LENGTHS)
    for case, errors in results.items():
        assert errors["layout"] == case.split("-")[2], case  # the layout torch chose is the one we described
        for name, error in errors["errors"].items():
            assert error <= TOLERANCE, (case, name, error)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_trainer_context_parallel_matches_one_gpu(tmp_path):
    """A real Trainer with TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2)), FSDP2 and
    cta.ContextParallelCallback on 2 GPUs (torch's ring sdpa) trains a tiny fp32 patched Llama and a native CTA
    decoder 4 steps each with the single-GPU loss curve and evaluation loss (1e-4); without the callback the proposed forward check stops it on
    both ranks (tests/context_parallel_trainer_worker.py)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env.pop("TRITON_INTERPRET", None)
    worker = str(Path(__file__).resolve().parent / "context_parallel_trainer_worker.py")
    for command, gpus in (([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            worker], "0,1"), ([sys.executable, worker], "0")):
        done = subprocess.run(command + [str(tmp_path), "cuda"], env=dict(env, CUDA_VISIBLE_DEVICES=gpus),
                              capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    _check_trainer_runs(tmp_path, "cp", "head_tail")


def _check_trainer_runs(out, engine, layout):
    """Every rank's losses and evaluation loss are the one-GPU run's (1e-4), its sites were sharded in ``layout`` from
    the first step, and the run without the callback was refused."""
    ranks = [json.loads((out / f"{engine}-rank{rank}.json").read_text()) for rank in range(2)]
    single = json.loads((out / "single.json").read_text())
    for results in ranks:
        for kind in KINDS:
            got, expected = results[kind], single[kind]
            assert "error" not in got, (kind, got)
            assert got["sites"] == [[layout]] * 4 and len(expected["losses"]) == 4
            torch.testing.assert_close(got["losses"], expected["losses"], rtol=0, atol=TOLERANCE)
            assert abs(got["eval_loss"] - expected["eval_loss"]) < TOLERANCE, kind
        assert "ContextParallelCallback" in results["untold"]["error"]
    print(json.dumps({"ranks": ranks, "single": single}))


def _deepspeed_ulysses_missing():
    try:
        import deepspeed
    except Exception as error:  # (not installed, or its import fails here)
        return f"DeepSpeed does not import ({error})"
    from packaging import version

    if version.parse(deepspeed.__version__) < version.parse("0.18.2"):
        return f"DeepSpeed {deepspeed.__version__}: accelerate's Ulysses needs 0.18.2 or later"
    return None


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_trainer_ulysses_matches_one_gpu(tmp_path):
    """The same Trainer runs under DeepSpeed Ulysses (``ParallelismConfig(sp_backend="deepspeed", sp_size=2)``, ZeRO
    stage 0, the sites told contiguous shards by the callback; evaluation unsharded, as accelerate sets Ulysses up)
    log the one-GPU losses and evaluation loss; without the callback the run is refused on both ranks."""
    missing = _deepspeed_ulysses_missing()
    if missing:
        pytest.skip(missing)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                                   os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    env.pop("TRITON_INTERPRET", None)
    worker = str(Path(__file__).resolve().parent / "context_parallel_trainer_worker.py")
    sharded = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker,
               str(tmp_path), "cuda", "sp"]
    # (DeepSpeed sets its sequence-parallel groups up once per process: one Trainer per launch)
    for command, gpus in ([sharded + ["patched"], "0,1"], [sharded + ["native"], "0,1"], [sharded + ["untold"], "0,1"],
                          [[sys.executable, worker, str(tmp_path), "cuda"], "0"]):
        done = subprocess.run(command, env=dict(env, CUDA_VISIBLE_DEVICES=gpus), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    _check_trainer_runs(tmp_path, "sp", "contiguous")


def _mha_copy(source, target):
    """``source`` (a GQA Llama) saved to ``target`` with every key / value head repeated for its query heads: the same
    function, without grouped-query attention (which torch 2.11's ring sdpa rejects)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                weight = proj.weight.view(config.num_key_value_heads, -1, proj.weight.shape[1])
                proj.weight = torch.nn.Parameter(weight.repeat_interleave(groups, 0).flatten(0, 1).contiguous())
                proj.out_features = proj.weight.shape[0]
    config.num_key_value_heads = config.num_attention_heads
    for layer in model.model.layers:
        layer.self_attn.num_key_value_groups = 1
    model.save_pretrained(target)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_finetune_example_under_the_context_parallel_config(tmp_path):
    """examples/finetune_patched_llama.py launched with examples/accelerate/context_parallel.yaml (fp32:
    ``--mixed_precision no``) fine-tunes stories260K (made MHA, the same function) 6 steps, PDE only and LoRA + PDE,
    to the validation perplexity of the same command on one GPU. Needs the shared data (``$CTA_SHARED_DIR``)."""
    root = Path(__file__).resolve().parents[1]
    shared = Path(os.environ.get("CTA_SHARED_DIR") or root.parent / "shared")
    if not (shared / "models" / "stories260K").exists():
        pytest.skip(f"no stories260K in {shared} (set CTA_SHARED_DIR)")
    _mha_copy(shared / "models" / "stories260K", tmp_path / "mha")
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", CTA_SHARED_DIR=str(shared))
    env.pop("TRITON_INTERPRET", None)
    common = [str(root / "examples" / "finetune_patched_llama.py"), "--model_name_or_path", str(tmp_path / "mha"),
              "--tokenizer_name", str(shared / "models" / "stories260K"), "--modes", "pde,lora_pde", "--seeds", "0",
              "--max_steps", "6", "--block_size", "256", "--per_device_train_batch_size", "4",
              "--per_device_eval_batch_size", "8", "--max_train_samples", "64", "--max_eval_samples", "16",
              "--warmup_steps", "0", "--logging_steps", "1"]
    config = str(root / "examples" / "accelerate" / "context_parallel.yaml")
    runs = {"cp": [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--mixed_precision",
                   "no", *common], "one": [sys.executable, *common]}
    results = {}
    for name, command in runs.items():
        out = tmp_path / name
        done = subprocess.run(command + ["--output_dir", str(out), "--results_dir", str(out)], env=dict(
            env, CUDA_VISIBLE_DEVICES="0,1" if name == "cp" else "0"), capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        results[name] = json.loads((out / "finetune_patched_llama.json").read_text())
    assert results["cp"]["training"]["world_size"] == 2
    for mode in ("pde", "lora_pde"):
        cp, one = (results[name]["summary"][mode]["ppl_after_mean"] for name in ("cp", "one"))
        assert abs(cp / one - 1) < 1e-3, (mode, cp, one)
    print(json.dumps({name: r["summary"] for name, r in results.items()}))


# ----------------------------------------------------------------------------------------------------------------
# The torchrun worker
# ----------------------------------------------------------------------------------------------------------------

def _drop_attention_mask(module, args, kwargs):
    # accelerate's context-parallel pre-hook on every self_attn: ring attention takes no mask
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None
        kwargs["is_causal"] = True
    return args, kwargs


def _model(kind, pde_type, device):
    import cta
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=512)
    if kind == "native":
        config = cta.CTAConfig.modern_decoder(pde_type=pde_type, pde_steps=STEPS, pde_placement=PLACEMENTS,
                                             pde_per_channel=True, **shape)
        config._attn_implementation = "sdpa"
        model = cta.CTAForCausalLM(config)
    else:
        config = LlamaConfig(**shape)
        config._attn_implementation = "sdpa"
        model = cta.patch_model(LlamaForCausalLM(config), pde_type=pde_type, pde_steps=STEPS, placement=PLACEMENTS,
                                per_channel=True)
    with torch.no_grad():  # coefficients spread over their stable bounds
        for site in model.modules():
            if isinstance(site, cta.PDERefinement):
                for parameter, bounds in ((site.alpha, site.alpha_bounds), (site.beta, site.beta_bounds)):
                    if parameter is not None:
                        parameter.copy_(bounds[0] + (bounds[1] - bounds[0]) * torch.rand(parameter.shape))
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(_drop_attention_mask, with_kwargs=True, prepend=True)
    return model.to(device).train()


def _step(model, ids, positions, shift_labels, count):
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), reduction="sum") / count
    loss.backward()
    return logits.detach(), loss.detach()


def _unshard(local, shards):
    """The full sequence from every rank's shard (all-gather, then each row to its global position)."""
    import torch.distributed as dist

    from cta.pde_context_parallel import SequenceShards

    gathered = [torch.empty_like(local) for _ in range(shards.world_size)]
    dist.all_gather(gathered, local.contiguous(), group=shards.group)
    length = local.shape[1]
    full = local.new_empty(local.shape[0], length * shards.world_size, *local.shape[2:])
    for rank, part in enumerate(gathered):
        full[:, SequenceShards(shards.layout, shards.world_size, rank).global_positions(length)] = part
    return full


def _compare(kind, pde_type, seq, device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from cta.pde_context_parallel import SequenceSharding, shard_sequences

    generator = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, 128, (2, seq), generator=generator).to(device)
    positions = torch.arange(seq, device=device).expand(2, -1).contiguous()
    shift_labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
    count = int((shift_labels != -100).sum())

    model = _model(kind, pde_type, device)  # one GPU, the full sequence
    logits, loss = _step(model, ids, positions, shift_labels, count)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # torch load-balances (head-tail) by default when the length is a multiple of 2 * cp_size
    sharding = SequenceSharding("torch", mesh.get_group())
    shards = sharding.shards(seq // dist.get_world_size())
    buffers = [ids.clone(), positions.clone(), shift_labels.clone()]
    shard_sequences(model, sharding)
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1]):
        local_logits, local_loss = _step(model, *buffers, count)
    shard_sequences(model, None)
    dist.all_reduce(local_loss)
    errors = {"logits": (_unshard(local_logits, shards) - logits).abs().max().item(),
              "loss": (local_loss - loss).abs().item()}
    for name, parameter in model.named_parameters():
        if name not in grads:
            continue
        dist.all_reduce(parameter.grad)  # (what FSDP / DDP do over the context-parallel ranks)
        errors[f"grad {name}"] = ((parameter.grad - grads[name]).abs().max() / grads[name].abs().max().clamp(min=1)
                                  ).item()
    return {"layout": shards.layout, "errors": errors}


def main(out):
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    results = {f"{kind}-{pde_type}-{layout}": _compare(kind, pde_type, seq, device)
               for kind in KINDS for pde_type in PDE_TYPES for layout, seq in LENGTHS.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
