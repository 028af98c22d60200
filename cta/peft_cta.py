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
from peft.utils.constants import DUMMY_TARGET_MODULES

from . import patching_cta
from .patching_cta import PATCHED_CLASS_PREFIX, PATCHED_MODEL_TYPE_PREFIX, is_patched, patch_model, pde_modules_to_save
from .transformers_compat import inside_load_adapter, register_peft_tables, transformers_before

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
            self.target_modules = DUMMY_TARGET_MODULES  # PDE alone: PEFT's marker for "no LoRA layer"
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


class CTALoraModel(LoraModel):
    """LoRA's tuner that first makes the model carry the adapter's patch (:func:`ensure_patched`)."""

    def _pre_injection_hook(self, model, config, adapter_name):
        ensure_patched(model, config)
        super()._pre_injection_hook(model, config, adapter_name)

    def _prepare_adapter_config(self, peft_config, model_config):
        # LoRA's default target modules are listed by the base model type, not the patched one.
        model_type = str(model_config.get("model_type", ""))
        if model_type.startswith(PATCHED_MODEL_TYPE_PREFIX):
            model_config = {**model_config, "model_type": model_type[len(PATCHED_MODEL_TYPE_PREFIX):]}
        return super()._prepare_adapter_config(peft_config, model_config)


def register_peft_type() -> None:
    """Makes PEFT build :class:`CTALoraConfig` / :class:`CTALoraModel` for adapters of type ``CTA_LORA``."""
    register_peft_tables(CTAPeftType.CTA_LORA, CTALoraConfig, CTALoraModel)


__all__ = ["CTALoraConfig", "CTALoraModel", "CTAPeftType", "ensure_patched", "patch_summary", "register_peft_type"]
