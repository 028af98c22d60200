"""One rank of the FSDP check in test_fsdp.py (run by torchrun, 2 processes, gloo on CPU).

For each engine (FSDP1: ``FullyShardedDataParallel``; FSDP2: ``fully_shard``) and each model of ``fsdp_setup.MODELS``
(a patched Llama and a native CTA decoder, both with the default scalar coefficients), the model is sharded with
each decoder layer its own unit (the classes the model names in ``_no_split_modules``), then trained for a few steps
on this rank's half of a fixed batch. Rank 0 writes the mean loss of every step and saves the gathered full state
dict with ``save_pretrained``.
"""

import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, sys.argv[3])  # the repository root: `cta` from the checkout under test
from fsdp_setup import ENGINES, MODELS, STEPS, batch  # noqa: E402


def layer_classes(model):
    return {type(m) for m in model.modules() if type(m).__name__ in model._no_split_modules}


def shard(model, engine, world):
    classes = layer_classes(model)
    if engine == "fsdp1":
        return FullyShardedDataParallel(
            model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes),
            device_id=torch.device("cpu"), use_orig_params=True)
    mesh = init_device_mesh("cpu", (world,))
    for module in model.modules():
        if type(module) in classes:
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_state_dict(sharded, engine):
    if engine == "fsdp1":
        with FullyShardedDataParallel.state_dict_type(sharded, StateDictType.FULL_STATE_DICT,
                                                      FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            return sharded.state_dict()
    return get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))


def train(engine, build, rank, world):
    sharded = shard(build(), engine, world)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    ids = batch()
    share = ids.shape[0] // world
    mine = ids[rank * share:(rank + 1) * share]
    losses = []
    for _ in range(STEPS):
        loss = sharded(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, full_state_dict(sharded, engine), sharded


def main(out_dir: str, losses_file: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for engine in ENGINES:
        for kind, build in MODELS.items():
            losses, state, sharded = train(engine, build, rank, world)
            if rank == 0:  # (save_pretrained on the sharded module would gather on this rank alone)
                plain = build()
                plain.load_state_dict(state)
                plain.save_pretrained(os.path.join(out_dir, f"{engine}_{kind}"))
                if engine == "fsdp2":  # what Trainer does: the sharded model's save_pretrained, the gathered weights
                    sharded.save_pretrained(os.path.join(out_dir, f"{engine}_{kind}_from_sharded"), state_dict=state)
                results[f"{engine}_{kind}"] = dict(losses=losses,
                                                   units=sorted(c.__name__ for c in layer_classes(plain)))
            dist.barrier()
    if rank == 0:
        with open(losses_file, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
