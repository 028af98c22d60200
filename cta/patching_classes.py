# coding=utf-8
"""The classes of patched models, ``CTAPatched<Base>`` (see ``patching_cta``), and loading a saved patched checkpoint.
Their ``__module__`` is ``patching_cta`` (``auto_map`` and pickling find them there, through its ``__getattr__``)."""

from __future__ import annotations

import transformers

from .checkpoint_conversion import (SAVES_CURRENT_NAMES, from_pretrained_with_pde_check, hub_arguments,
                                    saved_as_own_class)
from .generation_cta import PDEGenerationMixin, refuse_vllm_transformers_backend
from .patching_sites import apply_patch
from .patching_structure import base_model_type, config_is_decoder
from .site_spec import cache_layout, site_specs
from .transformers_compat import auto_classes_naming, config_view, get_layer_types_and_kwargs, head_names

PATCHED_MODEL_TYPE_PREFIX = "cta_patched_"
PATCHED_CLASS_PREFIX = "CTAPatched"
# The module the patched classes are named after (`auto_map`: `patching_cta.CTAPatched<Base>`).
ENTRY_MODULE = ".".join(filter(None, (__name__.rpartition(".")[0], "patching_cta")))
# The heads a patched family saves in its `auto_map` (decoders without the masked-LM, encoders the causal-LM one).
SAVED_HEADS = ("AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
               "AutoModelForTokenClassification", "AutoModelForQuestionAnswering", "AutoModelForMaskedLM")


def is_patched_config(config) -> bool:
    return isinstance(getattr(config, "cta_patch", None), dict)


# The key of a patched config's ``__dict__`` that keeps its cache view, with what the view was made from; never saved,
# copied or compared (:class:`CTAPatchedConfigMixin`).
KEPT_CACHE_VIEW = "_cta_kept_cache_view"


def _saved_fields(config) -> dict:
    return {name: value for name, value in config.__dict__.items() if name != KEPT_CACHE_VIEW}


def _cache_view(config):
    """A shallow copy of ``config`` whose layer types make ``DynamicCache`` build hybrid (KV + conv state) layers, or
    None where no site keeps a state (``site_spec.cache_layout``).

    Kept on the config while its fields keep their values: transformers asks for it at every forward that starts a
    cache (a training forward too), and the layout reads every layer's fields (about 0.2 ms at 12 layers). A field set
    again makes a new view; so do the sites (``cta_patch``) and ``layer_types`` changed in place, which the view's
    layout reads (the view shares every other field's object with the config)."""
    spec = config.cta_patch if is_patched_config(config) else None
    specs = site_specs(spec, config.num_hidden_layers) if spec is not None else ()
    fields = _saved_fields(config)
    key = (specs, tuple(fields.get("layer_types") or ()), fields)
    kept = config.__dict__.get(KEPT_CACHE_VIEW)
    if kept is not None and kept[0] == key:
        return kept[1]
    view = None
    if any(site.keeps_state for site in specs):
        layout = cache_layout(tuple(get_layer_types_and_kwargs(config)[0]), specs)
        view = None if layout is None else config_view(config, layer_types=list(layout[0]),
                                                       number_of_conv_states=layout[1], _cta_cache_view=True)
    config.__dict__[KEPT_CACHE_VIEW] = (key, view)
    return view


class CTAPatchedConfigMixin:
    """Mixed into the config class of a patched model: distinct ``model_type`` and the cache view."""
    _cta_patched = {}  # base config class -> its patched class

    def __getstate__(self):  # (copies, deep copies and pickles: without the kept cache view)
        return _saved_fields(self)

    def __eq__(self, other):
        return isinstance(other, transformers.PretrainedConfig) and _saved_fields(self) == _saved_fields(other)

    __hash__ = None  # (as PretrainedConfig's: defining __eq__ drops it)

    def to_dict(self):
        kept = self.__dict__.pop(KEPT_CACHE_VIEW, None)
        try:
            return super().to_dict()
        finally:
            if kept is not None:
                self.__dict__[KEPT_CACHE_VIEW] = kept

    def get_text_config(self, decoder=None, encoder=None):
        config = super().get_text_config(decoder=decoder, encoder=encoder)
        if decoder and config is self and not self.__dict__.get("_cta_cache_view", False):
            return _cache_view(self) or config
        return config

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """A patched checkpoint's config; the config of a plain checkpoint of the base type as the plain config it
        is (a patched model's adapter names the plain model it was made from, and PEFT reads that config with the
        patched model's config class when it saves the adapter: read as a patched one, transformers warns that the
        types differ)."""
        config_dict, _ = cls.get_config_dict(pretrained_model_name_or_path, **hub_arguments(kwargs))
        if config_dict.get("model_type") == cls._cta_base_model_type and "cta_patch" not in config_dict:
            return cls._cta_original_class.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


class CTAPatchedModelMixin(PDEGenerationMixin):
    """Mixed into the model classes of patched models: builds the plain model, then applies ``config.cta_patch``;
    ``generate()`` keeps the PDE sites exact (``generation_cta``)."""
    _cta_patched = {}  # base model class -> its patched class

    def pde_cache_sites(self):
        """``[(site, cache layer, conv state)]`` of this model's causal PDE sites."""
        contexts = (module.__dict__.get("_cta_context") for module in self.modules())
        return next((context.sites for context in contexts if context is not None), [])

    @property
    def peft_config(self):
        """The PEFT adapter configs (set by PEFT on the model it adapts): only configs that record the patch
        (``cta.CTALoraConfig``) are taken, since an adapter saved without it loads onto a plain base without its PDE."""
        if "_cta_peft_config" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no PEFT adapter (`peft_config`)")
        return self.__dict__["_cta_peft_config"]

    @peft_config.setter
    def peft_config(self, configs):
        for name, adapter in (configs or {}).items():
            if not isinstance(getattr(adapter, "cta_patch", None), dict):
                raise ValueError(f"PEFT adapter {name!r} ({type(adapter).__name__}) does not record this model's CTA "
                                 "patch: saved, it would load onto a plain base without its PDE, silently. Use "
                                 "`cta.CTALoraConfig` (LoraConfig's arguments; it records the patch, saves the PDE "
                                 "coefficients and re-applies the patch where it is loaded).")
        self.__dict__["_cta_peft_config"] = configs

    @peft_config.deleter
    def peft_config(self):
        self.__dict__.pop("_cta_peft_config", None)

    def __init__(self, config, *args, **kwargs):
        spec = getattr(config, "cta_patch", None)
        if not isinstance(spec, dict):
            raise ValueError(f"{type(self).__name__} needs `config.cta_patch` (the patch recorded by "
                             f"cta.patch_model); got {spec!r}.")
        refuse_vllm_transformers_backend(config, type(self).__name__)
        super().__init__(config, *args, **kwargs)
        apply_patch(self, spec)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Saves weights (safetensors), the config (``model_type = cta_patched_*``, ``cta_patch``, ``auto_map``) and
        the flat code files (``patching_cta.py`` and the siblings it imports) so that the folder reloads patched."""
        self.config.auto_map = auto_map_for(self.config)
        if getattr(self, SAVES_CURRENT_NAMES, False):  # read from an earlier release's names: saved in the current ones
            kwargs.setdefault("save_original_format", False)
        with saved_as_own_class(self, ENTRY_MODULE):  # (a model sharded by FSDP2 has a class of torch's)
            return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loading (earlier releases' too); raises where the PDE weights mismatch ``config.cta_patch``."""
        return from_pretrained_with_pde_check(super().from_pretrained, cls, args, kwargs)


def _transformers_class(base_class):
    """Raises unless ``base_class`` is transformers' own (saved checkpoints rebuild it from ``transformers.<name>``)."""
    if getattr(transformers, base_class.__name__, None) is not base_class:
        raise ValueError(f"patch_model patches transformers' own model classes (a saved patched checkpoint rebuilds "
                         f"`{PATCHED_CLASS_PREFIX}<name>` from `transformers.<name>`); "
                         f"{base_class.__module__}.{base_class.__name__} is not one.")


def _register(cls):
    """Registers a patched class with its transformers Auto class."""
    key = cls.model_type if cls._cta_auto == "AutoConfig" else cls.config_class
    getattr(transformers, cls._cta_auto).register(key, cls, exist_ok=True)


def _derived_class(mixin, base_class, doc, auto, **attributes):
    """``CTAPatched<Base>``: ``mixin`` over ``base_class``, made once, registered with and for (code files) ``auto``."""
    if base_class not in mixin._cta_patched:
        _transformers_class(base_class)
        name = f"{PATCHED_CLASS_PREFIX}{base_class.__name__}"
        mixin._cta_patched[base_class] = cls = type(name, (mixin, base_class), {
            "_cta_original_class": base_class, "_cta_auto": auto, "__module__": ENTRY_MODULE, "__doc__": doc,
            **attributes})
        cls.register_for_auto_class(auto)
        _register(cls)
    return mixin._cta_patched[base_class]


def patched_config_class(base_class):
    """The ``CTAPatched<Base>Config`` subclass of a config class (created on first use, registered with AutoConfig)."""
    if issubclass(base_class, CTAPatchedConfigMixin):
        return base_class
    model_type = getattr(base_class, "model_type", None)
    if not model_type:
        raise ValueError(f"patch_model needs a config class with a `model_type`; {base_class.__name__} has none.")
    return _derived_class(CTAPatchedConfigMixin, base_class, f"{base_class.__name__} of a CTA-patched model.",
                          "AutoConfig", model_type=PATCHED_MODEL_TYPE_PREFIX + model_type,
                          _cta_base_model_type=model_type)


def patched_class(base_class):
    """The ``CTAPatched<Base>`` subclass of a transformers model class (created on first use with its family, the heads
    of its model type, each registered with its Auto class so that a generic head's backbone is built patched)."""
    if issubclass(base_class, CTAPatchedModelMixin):
        return base_class
    if base_class not in CTAPatchedModelMixin._cta_patched:
        _transformers_class(base_class)
        config_class, base_name = base_class.config_class, base_class.__name__
        heads = head_names(getattr(config_class, "model_type", None)).items()
        autos = [auto for auto, name in heads if name == base_name]
        autos = autos or auto_classes_naming(base_name)  # (a class shared by several model types)
        if not autos:
            raise ValueError(f"patch_model patches the heads transformers' Auto classes know "
                             f"({', '.join(SAVED_HEADS)}, ...); {base_name} is none of them.")
        doc = f"{base_name} with CTA PDE refinement (built from `config.cta_patch`)."
        _derived_class(CTAPatchedModelMixin, base_class, doc, autos[0], config_class=patched_config_class(config_class))
        for name in head_names(config_class.model_type, SAVED_HEADS).values():
            head = getattr(transformers, name, None)
            if isinstance(head, type) and head.config_class is config_class:
                patched_class(head)
    return CTAPatchedModelMixin._cta_patched[base_class]


def patched_class_named(name):
    """``CTAPatched<Base>`` for any transformers class ``<Base>``, made on first access (``patching_cta.__getattr__``):
    what a saved checkpoint's ``auto_map`` and ``architectures`` name, and what pickling reads."""
    if name.startswith(PATCHED_CLASS_PREFIX):
        base = getattr(transformers, name[len(PATCHED_CLASS_PREFIX):], None)
        if isinstance(base, type) and issubclass(base, transformers.PreTrainedConfig):
            return patched_config_class(base)
        if isinstance(base, type) and issubclass(base, transformers.PreTrainedModel):
            return patched_class(base)
    raise AttributeError(f"module {ENTRY_MODULE!r} has no attribute {name!r}")


def auto_map_for(config) -> dict:
    """The ``auto_map`` of a patched checkpoint: every Auto class of the family -> a class of ``patching_cta``
    (decoders without the masked-LM head, encoders without the causal-LM one)."""
    module = ENTRY_MODULE.rsplit(".", 1)[-1]
    causal = config.cta_patch["causal"] if is_patched_config(config) else config_is_decoder(config)
    auto_map = {"AutoConfig": f"{module}.{patched_config_class(type(config)).__name__}"}
    for auto, name in head_names(base_model_type(config), SAVED_HEADS).items():
        if auto != ("AutoModelForMaskedLM" if causal else "AutoModelForCausalLM"):
            auto_map[auto] = f"{module}.{PATCHED_CLASS_PREFIX}{name}"
    return auto_map


def register_auto_classes():
    """Registers every patched config/model class made so far with transformers' Auto classes (as each is when made)."""
    for cls in (*CTAPatchedConfigMixin._cta_patched.values(), *CTAPatchedModelMixin._cta_patched.values()):
        _register(cls)


def load_patched(path, **kwargs):
    """Loads a checkpoint saved from a patched model (a folder or Hub id), as the class it was saved from."""
    config_dict, _ = transformers.PreTrainedConfig.get_config_dict(path, **hub_arguments(kwargs))
    model_type = str(config_dict.get("model_type", ""))
    base_type = model_type[len(PATCHED_MODEL_TYPE_PREFIX):]
    if model_type.startswith(PATCHED_MODEL_TYPE_PREFIX) and base_type in transformers.CONFIG_MAPPING:
        patched_config_class(transformers.CONFIG_MAPPING[base_type])  # (AutoConfig then reads it without remote code)
    config = transformers.AutoConfig.from_pretrained(path, **hub_arguments(kwargs))  # the weights' folder
    if not is_patched_config(config):
        raise ValueError(f"{path!r} is not a CTA-patched checkpoint (its config has no `cta_patch`).")
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        try:
            cls = patched_class_named(name)
        except AttributeError:
            continue
        if isinstance(cls, type) and issubclass(cls, CTAPatchedModelMixin):
            return cls.from_pretrained(path, config=config, **kwargs)
    raise ValueError(f"{path!r}: cannot find a patched class for architectures {architectures}.")
