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
