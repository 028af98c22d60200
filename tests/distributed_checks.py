"""The correctness checks of a sharded ``bench_distributed.py`` phase: the PDE coefficients moved, and the saved
checkpoint (a full state dict gathered from the shards; the adapter for LoRA) reloads on rank 0 with the weights the
sharded run held and generates with its cache what it generates without."""

from __future__ import annotations

import contextlib
import json
import os

import torch

import cta
import transformers


@contextlib.contextmanager
def single_process_loading(accelerator):
    """On rank 0 alone, models must load and generate unsharded: under DeepSpeed ZeRO-3, transformers would otherwise
    partition them with zero.Init (a collective the other ranks never join). transformers reads ZeRO-3 from the
    config accelerate registers; it is unregistered for the block and registered again after."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()



def check_coefficients(accelerator, state, before, pde_names):
    if not accelerator.is_main_process:
        return {}
    moved, missing = {}, [n for n in pde_names if n not in state]
    for name in pde_names:
        if name in state:
            moved[name] = float((state[name].float().cpu() - before[name].cpu()).abs().max())
    return {"pde_coefficients": len(pde_names), "pde_missing_from_state_dict": missing,
            "pde_all_moved": bool(moved) and not missing and all(v > 0 for v in moved.values()),
            "pde_max_change": {"min": min(moved.values()), "max": max(moved.values())} if moved else None}


def save_and_reload(accelerator, model, state, phase, paths, work_dir, patch):
    """Saves the gathered full state dict, reloads it patched on rank 0 and checks weights and generation."""
    out = os.path.join(work_dir, f"saved_{phase}")
    if accelerator.is_main_process:  # the gathered dict lives on rank 0 (empty elsewhere); writing needs no peer
        accelerator.unwrap_model(model).save_pretrained(out, state_dict=state)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return {}
    with single_process_loading(accelerator):
        return reload_and_compare(accelerator, state, phase, paths, out, patch)


def reload_and_compare(accelerator, state, phase, paths, out, patch):
    dtype = next(iter(state.values())).dtype
    if phase == "lora_pde":
        from peft import PeftModel

        base = transformers.AutoModelForCausalLM.from_pretrained(paths["llama"], dtype=dtype)
        cta.patch_model(base, **patch)
        reloaded = PeftModel.from_pretrained(base, out)
    else:
        reloaded = cta.load_patched(out, dtype=dtype)
    mine = reloaded.state_dict()
    # PEFT's state dict names the adapter "default" where the saved file has no adapter name: compare the entries
    # the sharded run held, by name.
    # Compared at the saved precision: a frozen original PDE module (PEFT's original_module) is built again in fp32 by
    # patch_model on the reloaded base, where the ZeRO-3 run held it in bf16.
    compared = [n for n in state if n in mine]
    mismatched = [n for n in compared if not torch.equal(mine[n].cpu().to(state[n].dtype), state[n].cpu())]
    reloaded = reloaded.to(accelerator.device, torch.float32).eval()  # fp32: no near-tie flips from rounding
    prompt = torch.randint(0, reloaded.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(8))
    prompt = prompt.to(accelerator.device)
    with torch.no_grad():
        kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, synced_gpus=False)  # rank 0 alone
        cached = reloaded.generate(prompt, use_cache=True, **kwargs)
        uncached = reloaded.generate(prompt, use_cache=False, **kwargs)
    auto_map = {}
    if os.path.exists(os.path.join(out, "config.json")):
        with open(os.path.join(out, "config.json")) as f:
            auto_map = json.load(f).get("auto_map", {})
    # trust_remote_code loading needs auto_map to name the cta classes and their code files next to the weights.
    foreign = sorted({v for v in auto_map.values() if isinstance(v, str) and not v.startswith(("patching_cta.",
                                                                                               "modeling_cta.",
                                                                                               "configuration_cta."))})
    result = {"saved_dir": out, "reload_class": type(reloaded).__name__, "auto_map_foreign_entries": foreign,
              "saved_code_files": sorted(f for f in os.listdir(out) if f.endswith(".py")), "reload_compared_tensors": len(compared),
              "reload_weights_equal": bool(compared) and not mismatched, "reload_mismatched": mismatched[:5],
              "generate_cached_equals_uncached": bool(torch.equal(cached, uncached))}
    del reloaded, mine
    return result
