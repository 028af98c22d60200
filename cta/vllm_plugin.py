# coding=utf-8
"""The vLLM plugin (``pip install "cta[vllm]"``): the ``vllm.general_plugins`` entry point :func:`register`, which
vLLM runs in each of its processes, registers the CTA model classes (``vllm_models``) with vLLM's model registry and
the checkpoints' config classes with transformers' ``AutoConfig``, so that ``vllm serve <checkpoint>`` and
``vllm.LLM(<checkpoint>)`` load a native or patched CTA checkpoint without ``trust_remote_code``.

Importing this module does not import vLLM; :func:`register` does (the classes by name: vLLM imports them lazily).
"""

from __future__ import annotations

# The base families vLLM implements whose patched checkpoints the plugin serves (`architectures[0]` ->
# `cta_patched_<model_type>`), and the native decoder.
SERVED_BASES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3"}
NATIVE_ARCHITECTURE = "CTAForCausalLM"


def served_architectures() -> list:
    """The ``architectures`` names the plugin registers with vLLM."""
    return [NATIVE_ARCHITECTURE, *(f"CTAPatched{base}" for base in SERVED_BASES)]


def register() -> None:
    """Registers the CTA architectures with vLLM and their configs with transformers (idempotent)."""
    import transformers
    from vllm import ModelRegistry

    from . import patching_classes  # (importing the package registers CTAConfig with AutoConfig)

    for model_type in SERVED_BASES.values():  # `cta_patched_<type>` configs, read without remote code
        patching_classes.patched_config_class(transformers.CONFIG_MAPPING[model_type])
    supported = set(ModelRegistry.get_supported_archs())
    for name in served_architectures():
        if name not in supported:
            ModelRegistry.register_model(name, f"{__package__}.vllm_models:{name}")
