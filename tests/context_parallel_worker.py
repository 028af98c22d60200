"""Two CPU processes (gloo) refine a sharded sequence with cta.pde_context_parallel and record, per case, the largest
difference from the full-sequence PDERefinement (outputs and gradients), and what the refusals raised on each rank.

Run by tests/test_context_parallel.py as ``python context_parallel_worker.py OUT_DIR``; writes OUT_DIR/rank{r}.json.
"""

import itertools
import json
import os
import sys
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
PDE_TYPES = ("diffusion", "wave", "reaction_diffusion", "advection_diffusion")


def walls(kind, batch, length, chunk_length):
    """(token_mask, position_ids) of the full sequence for a wall kind."""
    if kind == "none":
        return None, None
    mask = torch.ones(batch, length, dtype=torch.long)
    if kind == "padding_on_one_rank":
        # padding only in chunk 0 (rank 0), at its last row: rank 1, whose own rows are all real, passes no mask
        # (as a site that drops an all-ones mask would) yet receives a halo holding padding
        mask[:, chunk_length - 1] = 0
        return mask, None
    mask[0, :3] = 0  # left padding
    mask[0, length // 4 - 2] = 0  # padding inside the halo of chunk 1 (head-tail)
    mask[1, length // 2 - 1] = 0  # padding at the end of the chunk before the middle: the next chunk's halo
    mask[1, length - 2 :] = 0  # right padding
    if kind == "padding":
        return mask, None
    # packed: sequences restart inside chunks, at a chunk boundary and inside a halo
    lengths = [[5, length // 4 - 5 + 2, length - length // 4 - 2], [length // 4, 3, length - length // 4 - 3]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return (mask if kind == "packed_padding" else None), positions


def compare(pde_type, per_channel, steps, layout, wall_kind, dtype, rank):
    from cta.pde_context_parallel import SequenceShards, refine_sharded
    from cta.pde_cta import PDERefinement
    from cta.pde_packing import packed_rows

    shards = SequenceShards.from_group(layout)
    channels, batch, length = 3, 2, 4 * WORLD * max(steps, 2)
    seed = zlib.crc32(repr((pde_type, per_channel, steps, layout, wall_kind)).encode())  # (the same on both ranks)
    generator = torch.Generator().manual_seed(seed)
    module = PDERefinement(channels, pde_type, steps=steps, causal=True, per_channel=per_channel, backend="torch")
    module = module.to(dtype)
    with torch.no_grad():  # random coefficients inside their stable bounds
        for parameter, bounds in ((module.alpha, module.alpha_bounds), (module.beta, module.beta_bounds)):
            if parameter is not None:
                low, high = bounds
                parameter.copy_(low + (high - low) * torch.rand(parameter.shape, generator=generator, dtype=dtype))
    x = torch.randn(batch, length, channels, generator=generator, dtype=dtype)
    weight = torch.randn(batch, length, channels, generator=generator, dtype=dtype)
    mask, positions = walls(wall_kind, batch, length, length // shards.num_chunks)

    full_x = x.clone().requires_grad_()
    packed = None if positions is None else packed_rows(positions, mask, length)
    full = module(full_x, mask, None, packed)
    (full * weight).sum().backward()
    full_grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()

    local_x = shards.shard(x).requires_grad_()
    shard = lambda t: None if t is None else shards.shard(t)  # noqa: E731
    local_mask = shard(mask)
    if local_mask is not None and bool(local_mask.all()):
        local_mask = None  # (decided from this rank's rows alone: the ranks may differ)
    local = refine_sharded(module, local_x, shards, local_mask, shard(positions))
    (local * shards.shard(weight)).sum().backward()
    errors = {"out": (local - shards.shard(full)).abs().max().item(),
              "grad_x": (local_x.grad - shards.shard(full_x.grad)).abs().max().item()}
    for name, parameter, expected in zip(("alpha", "beta"), module.parameters(), full_grads):
        grad = parameter.grad.clone()
        dist.all_reduce(grad)  # (what DDP / FSDP do with the ranks' coefficient gradients)
        errors[f"grad_{name}"] = (grad - expected).abs().max().item()
    errors["scale"] = full.abs().max().item()
    return errors


def bf16_outputs():
    """bf16 shards: the halo travels in bf16 and the PDE computes each row from the same inputs, in the same fp32
    arithmetic, as on the full sequence: equal outputs (largest difference per type and layout)."""
    from cta.pde_context_parallel import SequenceShards, refine_sharded
    from cta.pde_cta import PDERefinement

    found = {}
    for pde_type, layout in itertools.product(PDE_TYPES, ("contiguous", "head_tail")):
        shards = SequenceShards.from_group(layout)
        torch.manual_seed(0)
        module = PDERefinement(8, pde_type, steps=3, causal=True, per_channel=True, backend="torch").bfloat16()
        x = torch.randn(2, 24, 8, dtype=torch.bfloat16)
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, 10:13] = 0
        out = refine_sharded(module, shards.shard(x), shards, shards.shard(mask))
        found[f"{pde_type}-{layout}"] = (out.float() - shards.shard(module(x, mask)).float()).abs().max().item()
    return found


def refusals(rank):
    """Each refusal raises on both ranks before any collective: after it the ranks still meet in the same
    collectives (a barrier, then a sharded refinement that works)."""
    from cta.pde_context_parallel import SequenceShards, refine_sharded
    from cta.pde_cta import PDERefinement

    shards = SequenceShards.from_group("head_tail")
    x = torch.randn(1, 4, 2)  # chunks of 2 tokens on each rank
    cases = {
        "short_chunk": (PDERefinement(2, steps=3, causal=True, backend="torch"), x),
        "bidirectional": (PDERefinement(2, steps=1, causal=False, backend="torch"), x),
        "odd_length": (PDERefinement(2, steps=1, causal=True, backend="torch"), torch.randn(1, 5, 2)),
    }
    raised = {}
    for name, (module, tensor) in cases.items():
        try:
            refine_sharded(module, tensor, shards)
            raised[name] = None
        except (ValueError, TypeError) as error:
            raised[name] = f"{type(error).__name__}: {error}"
        dist.barrier()
    out = refine_sharded(PDERefinement(2, steps=2, causal=True, backend="torch"), x, shards)
    raised["after"] = list(out.shape)
    return raised


def torch_layouts():
    """The shards torch's context_parallel cuts buffers into are the ones SequenceShards describes: head-tail when
    the length is a multiple of 2 * cp_size, else contiguous."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from cta.pde_context_parallel import SequenceSharding

    mesh = init_device_mesh("cpu", (WORLD,))
    found = {}
    for length in (16, 14):
        tokens = torch.arange(length).expand(2, -1).contiguous()
        shards = SequenceSharding("torch", mesh.get_group()).shards(length // WORLD)
        with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1], no_restore_buffers={tokens}):
            pass
        found[str(length)] = [shards.layout, torch.equal(tokens, shards.shard(torch.arange(length).expand(2, -1)))]
    found["accelerate"] = accelerator_shards(mesh)
    return found


def accelerator_shards(mesh):
    """SequenceSharding.for_accelerator on stand-ins of accelerate's Accelerator (its public attributes) and of
    DeepSpeed's group registry (not installed here)."""
    import types

    from cta.pde_context_parallel import SequenceSharding

    class Mesh:  # (accelerate's torch_device_mesh["cp"]: a DeviceMesh; its process group is what is read)
        def get_group(self):
            return mesh.get_group()

    def accelerator(cp_size, sp_size):
        config = types.SimpleNamespace(cp_enabled=cp_size > 1, cp_backend="torch", sp_enabled=sp_size > 1,
                                       sp_backend="deepspeed")
        return types.SimpleNamespace(parallelism_config=config, torch_device_mesh={"cp": Mesh()})

    groups = types.ModuleType("deepspeed.utils.groups")
    groups._get_sequence_parallel_group = lambda: None  # the default group
    sys.modules.update({"deepspeed": types.ModuleType("deepspeed"), "deepspeed.utils": types.ModuleType("u"),
                        "deepspeed.utils.groups": groups})
    sys.modules["deepspeed.utils"].groups = groups
    found = {}
    for name, (cp_size, sp_size) in {"cp": (2, 1), "sp": (1, 2), "none": (1, 1), "both": (2, 2)}.items():
        try:
            sharding = SequenceSharding.for_accelerator(accelerator(cp_size, sp_size))
            shards = None if sharding is None else sharding.shards(8)
            found[name] = None if shards is None else [shards.layout, shards.world_size, shards.rank]
        except ValueError as error:
            found[name] = str(error)
    found["no_config"] = SequenceSharding.for_accelerator(types.SimpleNamespace(parallelism_config=None))
    return found


def position_local_attention(module, query, key, value, attention_mask, **kwargs):
    """Each token reads its own value only: position-local, so sharding the sequence cannot change it (torch has no
    ring attention on CPU). The PDE sites are then the models' only cross-position operations."""
    from transformers.integrations.sdpa_attention import repeat_kv

    value = repeat_kv(value, query.shape[1] // value.shape[1])
    return (value[:, :, -query.shape[2]:] * 1.0).transpose(1, 2).contiguous(), None


def models(kind):
    """A tiny patched Llama or native CTA decoder on the position-local attention, every placement it serves."""
    import cta
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("position_local", position_local_attention)
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    if kind == "native":
        config = cta.CTAConfig.modern_decoder(pde_type="advection_diffusion", pde_steps=2, pde_alpha=0.2,
                                             pde_placement=["embedding", "value", "attention_output", "mlp_output",
                                                            "block_output"], **shape)
        config._attn_implementation = "position_local"
        return cta.CTAForCausalLM(config)
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="position_local"))
    return cta.patch_model(model, pde_type="wave", pde_steps=2, init="paper",
                           placement=["embedding", "value", "attention_output", "mlp_output", "block_output"])


def sharded_models(rank):
    """Per model kind and layout: the largest difference between the sharded forward + backward (each rank its
    shard, the coefficients' gradients summed over the ranks) and the same model on the full sequence."""
    from cta.pde_context_parallel import SequenceSharding, shard_sequences

    found = {}
    for kind, layout in itertools.product(("patched", "native"), ("contiguous", "head_tail")):
        model = models(kind).train()
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(16).expand(2, -1)
        full = model(input_ids=ids, position_ids=positions).logits
        full.square().sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if "pde" in n}
        model.zero_grad()
        shard_sequences(model, SequenceSharding(layout))
        shards = SequenceSharding(layout).shards(16 // WORLD)
        logits = model(input_ids=shards.shard(ids), position_ids=shards.shard(positions)).logits
        logits.square().sum().backward()
        errors = {"logits": (logits - shards.shard(full)).abs().max().item()}
        for name, grad in expected.items():
            summed = model.get_parameter(name).grad.clone()
            dist.all_reduce(summed)
            errors[name] = (summed - grad).abs().max().item()
        shard_sequences(model, None)
        found[f"{kind}-{layout}"] = errors
    return found


def run(rank, out_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD)
    results = {"refusals": refusals(rank), "torch_layouts": torch_layouts(), "bf16": bf16_outputs(), "cases": {},
               "models": sharded_models(rank)}
    wall_kinds = ("none", "padding", "padding_on_one_rank", "packed", "packed_padding")
    for case in itertools.product(PDE_TYPES, (False, True), (1, 3), ("contiguous", "head_tail"), wall_kinds,
                                  (torch.float32, torch.float64)):
        key = "-".join(str(part).replace("torch.", "") for part in case)
        results["cases"][key] = compare(*case, rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=WORLD)
