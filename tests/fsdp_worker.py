"""One rank of the FSDP check in test_fsdp.py (run by torchrun, 2 processes, gloo on CPU).

A tiny Llama, patched with per-channel PDE coefficients, is sharded with FSDP, each decoder layer its own unit (the
classes the model names in ``_no_split_modules``), and trained for a few steps on this rank's half of a fixed batch.
Rank 0 writes the mean loss of every step and saves the full model with ``save_pretrained``.
"""

import functools
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, sys.argv[3])  # the repository root: `cta` from the checkout under test
from fsdp_setup import STEPS, batch, tiny_patched_model  # noqa: E402


def main(out_dir: str, losses_file: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_patched_model()
    layer_classes = {type(m) for m in model.modules() if type(m).__name__ in model._no_split_modules}
    sharded = FullyShardedDataParallel(
        model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes),
        device_id=torch.device("cpu"), use_orig_params=True)
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
    with FullyShardedDataParallel.state_dict_type(sharded, StateDictType.FULL_STATE_DICT,
                                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        state = sharded.state_dict()
    if rank == 0:  # (save_pretrained on the sharded module would gather on this rank alone)
        plain = tiny_patched_model()
        plain.load_state_dict(state)
        plain.save_pretrained(out_dir)
        with open(losses_file, "w") as f:
            json.dump(dict(losses=losses, units=sorted(c.__name__ for c in layer_classes)), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
