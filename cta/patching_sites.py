# coding=utf-8
"""Installing and removing the PDE sites of a patch: each PDE module becomes a submodule ``cta_<placement>_pde`` of the
module it refines, applied by ``patching_hooks``' forward hooks (their handles in the base model's ``_cta_context``)."""

from __future__ import annotations

from torch import nn
from transformers.integrations import is_deepspeed_zero3_enabled

from .patching_hooks import LayerSite, OutputSite, PatchContext, ValueSite
from .patching_structure import parameters_of, plan_patch
from .pde_cache import CACHE_ARGUMENTS, layer_state_indices, pde_sites
from .pde_cta import PDERefinement
from .transformers_compat import LAYER_CACHE_ALIASES as _LAYER_CACHE_ALIASES


def _positional_index(function, names):
    """Position of the first of ``names`` among ``function``'s positional parameters, or None."""
    positional = [p.name for p in parameters_of(function).values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return next((positional.index(name) for name in names if name in positional), None)


def layer_indices(spec, num_layers):
    return list(range(num_layers)) if spec["layers"] is None else list(spec["layers"])


def state_indices_of(spec, num_layers):
    """``layer index -> {placement: first cache conv-state index}`` of ``spec``'s causal PDE sites (one per step)."""
    selected = set(layer_indices(spec, num_layers))
    return lambda i: layer_state_indices(spec["placement"], spec["pde_steps"], i in selected, i)


def _make_pde(spec, channels, layer_idx, state_idx, like: nn.Module):
    module = PDERefinement(channels=channels, pde_type=spec["pde_type"], steps=spec["pde_steps"], causal=spec["causal"],
                           alpha=spec["alpha"], beta=spec["beta"], per_channel=spec["per_channel"],
                           backend=spec["backend"], layer_idx=layer_idx, state_idx=state_idx)
    param, own = next(iter(like.parameters()), None), next(iter(module.parameters()), None)
    built_on_meta = own is not None and own.device.type == "meta"  # (under a meta-device construction: stays there)
    if param is not None and param.device.type != "meta" and not built_on_meta:
        module.to(device=param.device)
    if param is not None and param.is_floating_point() and is_deepspeed_zero3_enabled():
        # Loaded under ZeRO-3, the model's parameters were cast to the engine's dtype: DeepSpeed partitions every
        # parameter of one dtype together and refuses an fp32 coefficient among bf16 weights.
        module.to(dtype=param.dtype)
    return module


def _add_pde(module, placement, pde):
    name = f"cta_{placement}_pde"
    if hasattr(module, name):
        raise ValueError(f"{type(module).__name__} already has a `{name}`: call unpatch_model first.")
    module.add_module(name, pde)


def apply_patch(model, spec, plan=None):
    """Adds the PDE modules and hooks of ``spec`` where ``plan`` (``plan_patch``, made if not given: raises before any
    change) says; should adding them fail anyway, what was added is removed again before the error propagates."""
    if plan is None:
        plan = plan_patch(model, spec["placement"], layer_indices(spec, model.config.num_hidden_layers))
    if any("_cta_context" in module.__dict__ for module in model.modules()):
        # A generic head (LlamaForSequenceClassification, ...) builds its backbone with AutoModel.from_config: the
        # patched backbone class, which applied this same patch in its own constructor.
        return model
    try:
        _add_sites(model, spec, plan)
    except BaseException:
        remove_patch_modules(model)
        raise
    return model


def _add_sites(model, spec, plan):
    base, layers, num_layers = plan.base, plan.layers, len(plan.layers)
    states_of = state_indices_of(spec, num_layers)
    sites = pde_sites(num_layers, states_of) if spec["causal"] else []
    base._cta_context = context = PatchContext(
        _positional_index(base.forward, ("attention_mask",)), _positional_index(base.forward, CACHE_ARGUMENTS), sites,
        type(model).__name__, _positional_index(base.forward, ("position_ids",)),
        "use_cache" in parameters_of(type(base).forward))
    context.handles = [base.register_forward_pre_hook(context.enter, with_kwargs=True),
                       base.register_forward_hook(context.exit, with_kwargs=True, always_call=True)]
    if spec["pde_steps"] == 0:
        return
    selected = layer_indices(spec, num_layers)
    for idx in range(num_layers):
        states = states_of(idx)
        if not states:
            continue
        created = []  # sites whose hooks are registered but not yet in context.site_hooks
        try:
            _add_layer_sites(context, spec, model.config.hidden_size, layers[idx], idx, plan.targets[idx], states,
                             spec["placement"] if idx in selected else [], created)
        except BaseException:
            for site in created:
                site.remove()
            raise


def _add_layer_sites(context, spec, hidden, layer, idx, targets, states, per_layer, created):
    nested, value_sites = [], []
    if "value" in per_layer:
        value = targets.value
        _add_pde(value.owner, "value", _make_pde(spec, value.channels, idx, states["value"], layer))
        value_sites.append(ValueSite(context, layer, value.owner, value.attr, value.value_slice))
        created.extend(value_sites)
    for placement in ("attention_output", "mlp_output"):
        if placement in per_layer:
            module = getattr(targets, placement)
            _add_pde(module, placement, _make_pde(spec, hidden, idx, states[placement], layer))
            nested.append(OutputSite(context, layer, module, f"cta_{placement}_pde"))
            created.append(nested[-1])
    if "embedding" in states:
        _add_pde(layer, "embedding", _make_pde(spec, hidden, 0, states["embedding"], layer))
    if "block_output" in per_layer:
        _add_pde(layer, "block_output", _make_pde(spec, hidden, idx, states["block_output"], layer))
    cache_position = _positional_index(type(layer).forward, CACHE_ARGUMENTS + _LAYER_CACHE_ALIASES)
    layer_site = LayerSite(context, layer, f"layer {idx}", spec["causal"],
                           None if cache_position is None else cache_position - 1,
                           embedding="embedding" in states, block_output="block_output" in per_layer,
                           nested=bool(nested or value_sites), value_sites=value_sites,
                           cache_names=CACHE_ARGUMENTS + _LAYER_CACHE_ALIASES)
    context.site_hooks += [*value_sites, *nested, layer_site]


def remove_patch_modules(model):
    """Removes the hooks (through their handles) and the PDE submodules that :func:`apply_patch` added."""
    for module in list(model.modules()):
        context = module.__dict__.pop("_cta_context", None)
        if context is not None:
            context.remove_hooks()
        for name, _ in list(module.named_children()):
            if name.startswith("cta_") and name.endswith("_pde"):
                delattr(module, name)
