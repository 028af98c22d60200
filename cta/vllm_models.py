# coding=utf-8
"""vLLM model classes of CTA checkpoints: vLLM's own implementation of the base family (Llama, Mistral, Qwen2, Qwen3)
with a :class:`vllm_site.VllmPDESite` at every PDE site of the checkpoint's patch, or, for a native ``CTAForCausalLM``
(the RoPE / RMSNorm / SwiGLU decoder of ``CTAConfig.modern_decoder``), vLLM's Llama with its weights renamed.

Where a site sits in vLLM's layers:
* ``block_output``: vLLM's decoder layers return ``(hidden_states, residual)`` and leave the residual add to the next
  layer's fused add + norm, so the block output transformers refines is ``hidden_states + residual``. The layer forms
  that sum, refines it and hands on ``(0, refined)``: the next add gives the refined block output exactly.
* ``attention_output`` / ``mlp_output``: the output of vLLM's attention / MLP module (after its output projection,
  before the residual add), as in transformers' layer.
A site is added by giving the module its site as a child named as in the checkpoint (``cta_<placement>_pde``) and a
subclass of its own class whose ``forward`` refines the output (made once per class); weights load by name.

Everything a served checkpoint would need and the plugin does not do is refused when the engine builds the model,
naming it (:func:`check_servable`).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

from .site_spec import site_specs
from .vllm_site import SITE_OP, VllmPDESite

SERVED_PLACEMENTS = ("block_output", "attention_output", "mlp_output")
# The module of a vLLM decoder layer whose output each placement refines ("" for the layer itself).
_SITE_MODULES = {"block_output": "", "attention_output": "self_attn", "mlp_output": "mlp"}
MERGE_ADVICE = ("merge the adapter into the patched model first (`peft_model.merge_and_unload()`, then "
                "`save_pretrained`) and serve the merged checkpoint")


def served_sites(hf_config) -> tuple:
    """The :class:`site_spec.PDESiteSpec` of the sites a checkpoint serves (``cta_patch`` of a patched one, the
    ``pde_*`` fields of a native one); raises for what the plugin cannot serve."""
    patch = getattr(hf_config, "cta_patch", None)
    if isinstance(patch, dict):
        if not patch.get("causal", False):
            raise ValueError("cta vLLM plugin: this patched checkpoint is bidirectional (an encoder); vLLM serves "
                             "causal decoders.")
        placement = patch["placement"]
    else:
        _check_native_decoder(hf_config)
        placement = hf_config.pde_placement
    placements = [placement] if isinstance(placement, str) else list(placement)
    unsupported = [p for p in placements if p not in SERVED_PLACEMENTS]
    if unsupported:
        raise ValueError(f"cta vLLM plugin: PDE placement(s) {unsupported} cannot be served by vLLM; the plugin "
                         f"serves {list(SERVED_PLACEMENTS)}. Use transformers' generate() for this checkpoint.")
    specs = site_specs(hf_config)
    if not specs:
        raise ValueError("cta vLLM plugin: this checkpoint's patch has pde_steps=0 (the identity): serve the base "
                         "model's checkpoint instead (`cta.unpatch_model(model)`, then `save_pretrained`).")
    return specs


def _check_native_decoder(config) -> None:
    """A native CTA checkpoint is served as vLLM's Llama: refuses the options that Llama's layers do not have."""
    expected = dict(is_causal=True, position_embedding_type="rope", norm_type="rmsnorm", norm_position="pre",
                    mlp_type="gated", hidden_act="silu", sliding_window=None)
    wrong = {name: getattr(config, name, None) for name, value in expected.items()
             if getattr(config, name, None) != value}
    if wrong:
        raise ValueError(f"cta vLLM plugin: a native CTAForCausalLM is served as vLLM's Llama, which needs "
                         f"{expected} (`CTAConfig.modern_decoder()`); this checkpoint has {wrong}. Use transformers' "
                         "generate() for it.")


def check_servable(vllm_config) -> None:
    """Raises, naming the engine option, for what the PDE sites cannot serve exactly."""
    if vllm_config.speculative_config is not None:
        raise ValueError("cta vLLM plugin: speculative decoding is not supported for CTA checkpoints (its verify "
                         "step would need the PDE state after every draft token). Drop `speculative_config`.")
    if vllm_config.lora_config is not None:
        raise ValueError("cta vLLM plugin: vLLM's LoRA serving cannot carry a CTA adapter's PDE coefficients "
                         f"(`enable_lora`): {MERGE_ADVICE}.")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError("cta vLLM plugin: tensor and pipeline parallelism are not supported for CTA checkpoints "
                         f"(tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size="
                         f"{parallel.pipeline_parallel_size}); serve on one device.")


def _state_shape(vllm_config):
    specs = served_sites(vllm_config.model_config.hf_config)
    return ((specs[0].steps, vllm_config.model_config.hf_config.hidden_size),)


def prepare_sites(model) -> None:
    """After the weights load, every site's coefficients projected onto their bounds
    (:meth:`VllmPDESite.project_coefficients`) and its decode warmed up (:meth:`VllmPDESite.warm_up`)."""
    for module in model.modules():
        if isinstance(module, VllmPDESite):
            module.project_coefficients()
            module.warm_up()


@lru_cache(maxsize=None)  # (one subclass per vLLM module class: a bounded set)
def refining_class(module_class: type, placement: str) -> type:
    """``module_class`` whose ``forward`` refines its output with its child ``cta_<placement>_pde``."""
    site_name = f"cta_{placement}_pde"
    if placement == "block_output":
        def forward(self, positions, hidden_states, residual, **kwargs):
            hidden_states, residual = module_class.forward(self, positions, hidden_states, residual, **kwargs)
            refined = getattr(self, site_name)(hidden_states + residual)
            if self.cta_last_layer:  # (the model's final norm adds a residual: hand it a zero one)
                return torch.zeros_like(refined), refined
            return refined, None  # (the next layer starts from it, as the first layer starts from the embeddings)
    else:
        def forward(self, *args, **kwargs):
            return getattr(self, site_name)(module_class.forward(self, *args, **kwargs))
    return type(f"CTA{module_class.__name__}", (module_class,), {"forward": forward, "__module__": __name__})


class CTASitesMixin:
    """Mixed in before a vLLM causal LM class (vLLM's `HasInnerState, IsHybrid` after it: typing's protocols end
    the constructor chain): refuses what it cannot serve, then adds the PDE sites of the
    checkpoint's patch to the model vLLM built."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return _state_shape(vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return (torch.float32,)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return (get_temporal_copy_spec,)  # (prefix caching, align mode: a block's state is copied whole)

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_servable(vllm_config)
        specs = served_sites(vllm_config.model_config.hf_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        splitting = vllm_config.compilation_config.splitting_ops
        if isinstance(splitting, list) and splitting and SITE_OP not in splitting:
            splitting.append(SITE_OP)  # (piecewise CUDA graphs: the site's host-side work runs between pieces)
        self._add_sites(specs, vllm_config.model_config.hf_config.hidden_size)

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        prepare_sites(self)
        return loaded

    def _add_sites(self, specs, hidden_size):
        layers = self.model.layers
        model_prefix = next(name for name, module in self.named_modules() if module is layers)
        for spec in specs:
            path = _SITE_MODULES[spec.placement]
            module = layers[spec.layer_idx].get_submodule(path) if path else layers[spec.layer_idx]
            name = f"cta_{spec.placement}_pde"
            prefix = ".".join(filter(None, (model_prefix, str(spec.layer_idx), path, name)))
            module.add_module(name, VllmPDESite(spec, hidden_size, prefix))
            module.__class__ = refining_class(type(module), spec.placement)
            module.cta_last_layer = spec.layer_idx == len(layers) - 1


class CTAPatchedLlamaForCausalLM(CTASitesMixin, LlamaForCausalLM, HasInnerState, IsHybrid):
    pass


class CTAPatchedMistralForCausalLM(CTASitesMixin, MistralForCausalLM, HasInnerState, IsHybrid):
    pass


class CTAPatchedQwen2ForCausalLM(CTASitesMixin, Qwen2ForCausalLM, HasInnerState, IsHybrid):
    pass


class CTAPatchedQwen3ForCausalLM(CTASitesMixin, Qwen3ForCausalLM, HasInnerState, IsHybrid):
    pass


class CTAForCausalLM(CTASitesMixin, LlamaForCausalLM, HasInnerState, IsHybrid):
    """A native CTA decoder (``CTAConfig.modern_decoder``) as vLLM's Llama: Llama's config names are given to the
    config, and the weights' names mapped to Llama's."""

    hf_to_vllm_mapper = WeightsMapper(orig_to_new_substr={
        ".attention_norm.": ".input_layernorm.", ".mlp_norm.": ".post_attention_layernorm.",
        ".block_output_pde.": ".cta_block_output_pde.", ".attention_output_pde.": ".self_attn.cta_attention_output_pde.",
        ".mlp_output_pde.": ".mlp.cta_mlp_output_pde."})

    def __init__(self, *, vllm_config, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        served_sites(config)  # (refuses a native model Llama's layers cannot run before reading its fields)
        config.rms_norm_eps = config.layer_norm_eps
        config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
        config.layer_types = ["full_attention"] * config.num_hidden_layers  # (its cache layout's names: not vLLM's)
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def load_weights(self, weights):
        loaded = AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
        prepare_sites(self)
        return loaded


# architecture (the checkpoint's `architectures[0]`) -> class; the plugin registers each with vLLM's registry.
SERVED_ARCHITECTURES = {cls.__name__: cls for cls in (CTAForCausalLM, CTAPatchedLlamaForCausalLM,
                                                      CTAPatchedMistralForCausalLM, CTAPatchedQwen2ForCausalLM,
                                                      CTAPatchedQwen3ForCausalLM)}
