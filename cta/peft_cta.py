# coding=utf-8
"""PEFT adapters of patched models that carry their patch (``docs/adapters.md``).

PEFT silently drops a LoRA adapter's PDE coefficients (``modules_to_save``) loaded onto a plain base, so these adapters
have a PEFT type of their own, ``CTA_LORA``: :class:`CTALoraConfig` records the patch; after ``import cta`` PEFT builds
:class:`CTALoraModel`, which patches a plain base with it (a base patched alike is accepted, another refused). Without
``import cta`` PEFT refuses the unknown type.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import peft
import transformers
from packaging import version
from peft import LoraConfig, LoraModel

if version.parse(peft.__version__) < version.parse("0.21"):
    # Older releases save the state dict of a method they do not list in PeftType through no generic path.
    raise ImportError(f"adapters of patched models need peft >= 0.21, found {peft.__version__}")

from . import patching_cta
from .patching_cta import (PATCHED_CLASS_PREFIX, PATCHED_MODEL_TYPE_PREFIX, is_patched, patch_model,
                           pde_modules_to_save, unpatch_model)
from .transformers_compat import (PeftTunerHooks, inside_load_adapter, peft_no_target_modules, register_peft_tables,
                                  saved_module_wrappers, transformers_before, wrapped_copies, wrapped_original)

# What makes two patches the same model (the initial coefficients and the compute backend do not).
SPEC_KEYS = ("pde_type", "pde_steps", "placement", "layers", "causal", "per_channel")
_PATCH_ARGUMENTS = ("pde_type", "pde_steps", "placement", "layers", "init", "backend", "per_channel", "alpha", "beta")


class CTAPeftType(str, enum.Enum):
    """The PEFT type of adapters that carry a CTA patch (a ``str`` enum like ``peft.PeftType``)."""

    CTA_LORA = "CTA_LORA"


def patch_summary(spec) -> dict:
    return {key: spec.get(key) for key in SPEC_KEYS}


def _describe(spec) -> str:
    return ", ".join(f"{key}={spec.get(key)!r}" for key in SPEC_KEYS)


@dataclass
class CTALoraConfig(LoraConfig):
    """``LoraConfig`` of a CTA-patched model: the same arguments, plus the patch it was trained with (filled from the
    model by ``get_peft_model``). ``target_modules=[]`` trains the PDE coefficients alone."""

    cta_patch: Optional[dict] = field(default=None, metadata={
        "help": "The patch of the model the adapter was trained on (filled in by `get_peft_model`)."})
    cta_version: Optional[str] = field(default=None, metadata={"help": "The cta release that saved the adapter."})

    def __post_init__(self):
        if self.target_modules is not None and not isinstance(self.target_modules, str) and not self.target_modules:
            self.target_modules = peft_no_target_modules()  # PDE alone: PEFT's marker for "no LoRA layer"
        super().__post_init__()
        self.peft_type = CTAPeftType.CTA_LORA
        if self.cta_patch is not None and not isinstance(self.cta_patch, dict):
            raise ValueError(f"`cta_patch` must be a patch spec dict (a patched config's `cta_patch`), got "
                             f"{self.cta_patch!r}.")

    def save_pretrained(self, save_directory, **kwargs):
        mapping = kwargs.get("auto_mapping_dict")
        if mapping and str(mapping.get("base_model_class", "")).startswith(PATCHED_CLASS_PREFIX):
            # AutoPeftModel imports the base class named here; it loads the plain base, which the adapter patches.
            original = getattr(patching_cta, mapping["base_model_class"])._cta_original_class
            kwargs["auto_mapping_dict"] = {"base_model_class": original.__name__, "parent_library": original.__module__}
        return super().save_pretrained(save_directory, **kwargs)


def ensure_patched(model, config) -> None:
    """Makes ``model`` carry ``config``'s patch: records the patch of a patched model in a config that has none,
    patches a plain model with the recorded one, raises for a model patched with another; then lists the PDE modules
    in ``modules_to_save`` (their coefficients are part of the adapter)."""
    from . import __version__

    spec = config.cta_patch
    if spec is None:
        if not is_patched(model):
            raise ValueError(f"CTALoraConfig: {type(model).__name__} is not patched with CTA and the config records "
                             "no patch; call `cta.patch_model(model, ...)` first (or use peft.LoraConfig for a plain "
                             "model).")
        config.cta_patch = dict(model.config.cta_patch)
        config.cta_version = __version__
    elif transformers_before("5.18") and inside_load_adapter():
        # There model.load_adapter loads no modules_to_save: the PDE coefficients would keep their initial values.
        raise ValueError(f"transformers {transformers.__version__}'s `model.load_adapter` does not load an adapter's "
                         "`modules_to_save`, which hold a CTA adapter's PDE coefficients (5.18 and later do): use "
                         "`peft.PeftModel.from_pretrained(model, adapter)` or upgrade transformers.")
    elif not is_patched(model):
        patch_model(model, **{key: spec[key] for key in _PATCH_ARGUMENTS if key in spec})
        if patch_summary(model.config.cta_patch) != patch_summary(spec):  # e.g. an encoder given a causal patch
            raise ValueError(f"The adapter's patch ({_describe(spec)}) does not fit {type(model).__name__}: "
                             f"patched, it gets ({_describe(model.config.cta_patch)}).")
    elif patch_summary(model.config.cta_patch) != patch_summary(spec):
        raise ValueError(f"The adapter was trained with the patch ({_describe(spec)}) but {type(model).__name__} is "
                         f"patched with ({_describe(model.config.cta_patch)}); load it onto the plain base model (it "
                         "applies its own patch) or a base patched with the same spec.")
    config.modules_to_save = sorted(set(config.modules_to_save or ()) | set(pde_modules_to_save(model))) or None


def check_next_adapter(model, config, adapter_name, others) -> None:
    """Raises where an adapter added to a model that carries the adapters ``others`` (names) records another patch:
    the model has one patch, which every adapter on it runs under."""
    spec = config.cta_patch
    if spec is None or not is_patched(model) or patch_summary(spec) == patch_summary(model.config.cta_patch):
        return
    raise ValueError(f"Adapter {adapter_name!r} was trained with the patch ({_describe(spec)}), but this model carries "
                     f"adapters {sorted(others)} under the patch ({_describe(model.config.cta_patch)}). The adapters "
                     "of one model share its patch, so adapters of two patches cannot be switched between on one "
                     f"model: load {adapter_name!r} onto its own plain base model (`PeftModel.from_pretrained(base, "
                     "adapter)`, which applies its patch).")


class CTALoraModel(PeftTunerHooks, LoraModel):
    """LoRA's tuner that makes the model carry the adapter's patch (:func:`ensure_patched`) before any adapter is
    injected; every adapter of the model has its own PDE coefficients (PEFT's ``modules_to_save`` copies), and the
    operations after the first load keep them or raise (``docs/adapters.md``)."""

    def before_injection(self, model, config, adapter_name):
        # The tuner's constructor: the first adapter (get_peft_model, PeftModel.from_pretrained, transformers'
        # load_adapter). A config already there is another tuner's adapter, added to the model's own `peft_config`.
        others = [name for name in self.peft_config if name != adapter_name]
        if others:
            del self.peft_config[adapter_name]  # (the model's dict: left as it was)
            raise ValueError(_second_tuner_error(model, adapter_name, others))
        self.cta_applied_patch = not is_patched(model)  # `unload()` gives back the plain model
        ensure_patched(model, config)

    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        # peft calls `_pre_injection_hook` from the tuner's constructor only: `add_adapter`, `load_adapter` and
        # `add_weighted_adapter` inject here directly (and drop the new config from `peft_config` where this raises).
        config = self.peft_config[adapter_name]
        check_next_adapter(model, config, adapter_name, [name for name in self.peft_config if name != adapter_name])
        ensure_patched(model, config)
        super().inject_adapter(model, adapter_name, *args, **kwargs)

    def add_weighted_adapter(self, adapters, weights, adapter_name, *args, **kwargs):
        """PEFT's, keeping the PDE: the weights combine the LoRA weights; the new adapter's PDE coefficients are those
        of the adapter among ``adapters`` that holds them (PEFT refuses two that hold the same module to save),
        where PEFT would start them at the patch's initial values."""
        new = adapter_name not in self.peft_config
        super().add_weighted_adapter(adapters, weights, adapter_name, *args, **kwargs)
        if not new:
            return
        for _, _, wrapper in saved_module_wrappers(self.model, pde_modules_to_save(self.model)):
            copies = wrapped_copies(wrapper)
            sources = [name for name in adapters if name in copies]
            if sources and adapter_name in copies:
                copies[adapter_name].load_state_dict(copies[sources[0]].state_dict())

    def unload(self):
        """PEFT's ``unload()``, giving back the base the adapters were loaded onto: the plain model where the first
        adapter patched it (PEFT would keep the patch, with the active adapter's PDE coefficients), else the patched
        base with its own PDE modules."""
        originals = [(parent, attribute, wrapped_original(wrapper)) for parent, attribute, wrapper
                     in saved_module_wrappers(self.model, pde_modules_to_save(self.model))]
        model = super().unload()
        for parent, attribute, module in originals:
            setattr(parent, attribute, module)
        if self.cta_applied_patch:
            unpatch_model(model)
        return model

    def adapter_model_config(self, model_config):
        # LoRA's default target modules are listed by the base model type, not the patched one.
        model_type = str(model_config.get("model_type", ""))
        if model_type.startswith(PATCHED_MODEL_TYPE_PREFIX):
            model_config = {**model_config, "model_type": model_type[len(PATCHED_MODEL_TYPE_PREFIX):]}
        return model_config


def _second_tuner_error(model, adapter_name, others) -> str:
    if inside_load_adapter():
        # (peft 0.21 activates the new adapter's LoRA layers before it makes its `modules_to_save` copies, which then
        # stay inactive: the PDE would run at the patch's initial coefficients under the new adapter's LoRA)
        return (f"transformers' `model.load_adapter` of a second CTA adapter ({adapter_name!r}; the model has "
                f"{others}) would run its LoRA weights with the PDE at the patch's initial coefficients, not its own "
                f"(peft {peft.__version__} leaves its `modules_to_save` inactive). Load the adapters with PEFT: "
                "`peft_model = PeftModel.from_pretrained(base, first_adapter)`, then `peft_model.load_adapter("
                f"second_adapter, adapter_name={adapter_name!r})` and `peft_model.set_adapter({adapter_name!r})`.")
    return (f"{type(model).__name__} already carries PEFT adapters {others}: a second tuner would inject "
            f"{adapter_name!r} beside them without PEFT's bookkeeping of several adapters. Add it to the PeftModel "
            "that holds them: `peft_model.add_adapter(name, config)` or `peft_model.load_adapter(adapter, name)`.")


def register_peft_type() -> None:
    """Makes PEFT build :class:`CTALoraConfig` / :class:`CTALoraModel` for adapters of type ``CTA_LORA``."""
    register_peft_tables(CTAPeftType.CTA_LORA, CTALoraConfig, CTALoraModel)


__all__ = ["CTALoraConfig", "CTALoraModel", "CTAPeftType", "check_next_adapter", "ensure_patched", "patch_summary",
           "register_peft_type"]
