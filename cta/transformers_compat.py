# coding=utf-8
"""The internals of transformers, peft, accelerate and DeepSpeed that cta relies on, in one place (a test,
``tests/test_compat_boundary.py``, fails on a private name of theirs elsewhere): every other file uses public names
(``transformers.<Name>``, ``transformers.logging``; the modules documented for model code: ``modeling_outputs``,
``cache_utils``, ``masking_utils``, ``modeling_layers``, ``modeling_utils``, ``activations``, ``integrations``; a model
class's ``_no_split_modules`` / ``_supports_*`` / ``_can_record_outputs``) or this module. Checked on transformers
5.14 to 5.25 (the suite runs on both ends) and peft 0.21 (``setup.py``). Internal: why (where).

- hybrid cache layers' ``conv_states``, ``has_previous_state``, ``is_conv_states_initialized``,
  ``lazy_initialization(state_idx)``, ``update_conv_state(state_idx=)``, ``record_past``: the causal PDE state, one
  conv state per site and step (``pde_cache``)
- ``_can_record_outputs``, registered in ``PreTrainedModel.__init__``: a model patched in place records hidden states
  as its new class (:func:`register_recorded_outputs`)
- ``get_text_config(decoder=True)`` (``DynamicCache``, ``generate``), a config's ``__dict__``,
  ``cache_utils.get_layer_types_and_kwargs``: the patched config's cache view, hybrid layer types (``patching_classes``)
- ``is_remote_code``, ``get_compiled_call``, ``init_continuous_batching``: overridden (:class:`GenerationHooks`)
- ``mismatched_keys`` entries ``(name, saved shape, model shape)``, the load report (``modeling_utils``' logger,
  ``LOAD REPORT``): 0.1.0 checkpoints' 0-d coefficients (``checkpoint_conversion``)
- ``utils.output_capturing``, ``utils.can_return_tuple``, ``utils.deprecation.deprecate_kwarg``,
  ``integrations.sdpa_attention.repeat_kv``: the native model records, returns tuples, warns as transformers' do
- ``models.auto.modeling_auto.MODEL_*_MAPPING_NAMES``: a model type's heads (:func:`head_names`);
  ``dynamic_module_utils.get_relative_import_files``: the code files a saved folder needs (``hub``)
- releases (refused before, :func:`transformers_before`): ``load_adapter`` loads ``modules_to_save`` from 5.18, an
  assistant's conv states roll back from 5.15, Doge from 5.18
- peft ``mapping.PEFT_TYPE_TO_*_MAPPING``, ``DUMMY_TARGET_MODULES``, ``LoraModel._pre_injection_hook`` /
  ``_prepare_adapter_config``: the ``CTA_LORA`` adapter type (``peft_cta``, :func:`register_peft_tables`)
- peft's adapter operations after the first (checked: peft 0.21.0 and 0.21.2, transformers 5.14 and 5.24): the tuner's
  constructor calls ``_pre_injection_hook``, and adds its config to a ``peft_config`` the model already holds (what
  transformers' ``load_adapter`` of a second adapter does); ``PeftModel.add_adapter`` / ``load_adapter`` and
  ``LoraModel.add_weighted_adapter`` call ``inject_adapter`` directly (and roll back ``peft_config`` where it raises);
  ``ModulesToSaveWrapper``'s ``original_module`` and ``modules_to_save`` (one copy per adapter, made from the
  original): a CTA adapter's PDE coefficients (:func:`saved_module_wrappers`); ``BaseTunerLayer`` /
  ``AuxiliaryTrainingWrapper`` and transformers' ``_hf_peft_config_loaded``: a model PEFT adapts
  (:func:`peft_adapted`); ``PeftAdapterMixin.load_adapter``'s code object (:func:`inside_load_adapter`)
- accelerate's ``AcceleratorState._shared_state`` and its context-parallel guard on ``layer_types``, DeepSpeed's
  ``groups._get_sequence_parallel_group``: sequence sharding (``pde_context_parallel``)
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import inspect
import logging
import sys
import threading

import torch
import transformers
from packaging import version
from transformers.cache_utils import get_layer_types_and_kwargs  # noqa: F401  (a config's cache layer types)
from transformers.dynamic_module_utils import get_relative_import_files  # noqa: F401  (for hub)
from transformers.integrations.sdpa_attention import repeat_kv  # noqa: F401  (for modeling_cta)
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.auto import modeling_auto
from transformers.utils import can_return_tuple  # noqa: F401  (for modeling_cta)
from transformers.utils.deprecation import deprecate_kwarg  # noqa: F401  (for pde_cache)
from transformers.utils.output_capturing import OutputRecorder, capture_outputs  # noqa: F401  (for modeling_cta)

# Auto class -> transformers' name table of its heads (model_type -> class name).
AUTO_HEADS = {auto: f"MODEL_{table}MAPPING_NAMES" for auto, table in {
    "AutoModel": "", "AutoModelForCausalLM": "FOR_CAUSAL_LM_", "AutoModelForSequenceClassification":
    "FOR_SEQUENCE_CLASSIFICATION_", "AutoModelForTokenClassification": "FOR_TOKEN_CLASSIFICATION_",
    "AutoModelForQuestionAnswering": "FOR_QUESTION_ANSWERING_", "AutoModelForMaskedLM": "FOR_MASKED_LM_",
    "AutoModelForMultipleChoice": "FOR_MULTIPLE_CHOICE_", "AutoModelForPreTraining": "FOR_PRETRAINING_",
    "AutoModelForNextSentencePrediction": "FOR_NEXT_SENTENCE_PREDICTION_"}.items()}
# The models' cache keyword: transformers renamed `past_key_values` to `cache` in 5.24 (its model outputs' field too)
# and reads the old name until 5.40 (its models' own `deprecate_kwarg` version). Checked on: transformers 5.14-5.25.
CACHE_ARGUMENT = "cache" if "cache" in {field.name for field in dataclasses.fields(BaseModelOutputWithPast)} \
    else "past_key_values"
PAST_KEY_VALUES_REMOVAL = "5.40.0"
# Older names of a decoder layer's cache keyword: ``layer_past`` (GPT-NeoX, GPT-Neo, GPTBigCode, BLOOM, Falcon),
# ``past_key_value`` (AFMoE's layers in 5.14; 5.17 and later pass ``past_key_values``). Checked on: transformers
# 5.14-5.25.
LAYER_CACHE_ALIASES = ("layer_past", "past_key_value")
# `cache_implementation` values that build a static (compileable) cache. Checked on: transformers 5.14-5.25.
STATIC_CACHES = ("static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked")
# Architectures sizing a 2D mask by a static cache's length (BLOOM's ALiBi), which hybrid layers cannot report; named,
# as older transformers build it in the model's prepare_inputs_for_generation, not in create_masks_for_generate.
STATIC_CACHE_2D_MASK = {"bloom"}
# Cache implementations that cannot serve a model whose cache layers hold conv states, and why. Checked on:
# transformers 5.14-5.25.
REFUSED_CACHES = {
    "quantized": "transformers' quantized cache has key/value layers only, with no room for the PDE sites' conv "
                 "states.",
    # (transformers 5.14-5.24: "ValueError: True is not in list" at the first token)
    "offloaded_static": "transformers' offloaded static cache prefetches the next layer that holds no conv state, and "
                        "every layer of this model's cache holds the PDE state (it fails at the first token)."}
ASSISTANT_ROLLBACK_SINCE = version.parse("5.15.0")  # records an assistant cache's past (`crop` rolls conv states back)
GENERATING = contextvars.ContextVar("cta_generating", default=False)  # inside a generate(): is_remote_code
HOLD_BACK_LOAD_REPORT = contextvars.ContextVar("cta_hold_back_load_report", default=False)


def transformers_before(release) -> bool:
    return version.parse(transformers.__version__) < version.parse(str(release))


def head_names(model_type, autos=tuple(AUTO_HEADS)) -> dict:
    """``{Auto class: class name}`` of transformers' heads of ``model_type`` among ``autos``."""
    names = {}
    for auto in autos:
        name = getattr(modeling_auto, AUTO_HEADS[auto], {}).get(model_type)
        name = (name[0] if name else None) if isinstance(name, (list, tuple)) else name
        if isinstance(name, str):
            names[auto] = name
    return names


def has_head(model_type, auto: str) -> bool:
    return model_type in getattr(modeling_auto, AUTO_HEADS[auto], {})


def auto_classes_naming(class_name: str) -> list:
    """The Auto classes whose head table names ``class_name`` for some model type."""
    return [auto for auto, table in AUTO_HEADS.items() if class_name in getattr(modeling_auto, table, {}).values()]


def config_view(config, **fields):
    """A shallow copy of ``config`` with ``fields`` set as they are (past the config's own ``__setattr__``)."""
    view = copy.copy(config)
    view.__dict__.update(fields)
    return view


def register_recorded_outputs(cls, config) -> None:
    """Builds ``cls`` once on the meta device: transformers learns what ``output_*`` record from a class when it is
    first built (``PreTrainedModel.__init__``), and a model patched in place gets a class never built."""
    if cls.__dict__.get("_cta_records_outputs") or getattr(cls, "_can_record_outputs", None) is None:
        return
    with torch.device("meta"):
        cls(config)
    cls._cta_records_outputs = True


def mismatch_parts(key) -> tuple:
    """``(name, checkpoint shape, model shape)``: an entry of ``loading_info["mismatched_keys"]``."""
    return tuple(key)


def mismatch_name(key) -> str:
    return str(key[0]) if isinstance(key, tuple) else str(key)


def is_scalar_mismatch(key) -> bool:
    """A mismatch of a 0-d checkpoint tensor where the model holds a 1-element one."""
    return isinstance(key, tuple) and len(key) == 3 and tuple(key[1]) == () and tuple(key[2]) == (1,)


def _load_report_held_back(record) -> bool:
    return not (HOLD_BACK_LOAD_REPORT.get() and "LOAD REPORT" in str(record.msg))


_LOAD_REPORT_HOLDERS = [0]  # (how many held_back_load_report contexts are open, in all threads)
_LOAD_REPORT_LOCK = threading.Lock()


@contextlib.contextmanager
def held_back_load_report():
    """Drops the load report (``modeling_utils``' logger, a message with ``LOAD REPORT``; checked on transformers
    5.14-5.25) of a ``from_pretrained`` call made inside: the caller reports instead. The logger carries the filter
    only while some thread is inside one; it drops only this thread's / task's reports (a ContextVar)."""
    logger = logging.getLogger("transformers.modeling_utils")
    with _LOAD_REPORT_LOCK:
        _LOAD_REPORT_HOLDERS[0] += 1
        logger.addFilter(_load_report_held_back)
    token = HOLD_BACK_LOAD_REPORT.set(True)
    try:
        yield
    finally:
        HOLD_BACK_LOAD_REPORT.reset(token)
        with _LOAD_REPORT_LOCK:
            _LOAD_REPORT_HOLDERS[0] -= 1
            if not _LOAD_REPORT_HOLDERS[0]:
                logger.removeFilter(_load_report_held_back)


def training_forward_drops_cache(compiling: bool, packed: bool) -> bool:
    """Whether a training forward given no cache passes ``use_cache=False`` (transformers then makes none). Traced, the
    cache costs graph breaks; given ``position_ids`` / ``cu_seq_lens_q``, transformers' masks separate packed rows only
    without a cache. Eager without them the model's cache stays: without one, its mask builder synchronises with the
    device to look for packed rows. Checked on: transformers 5.14-5.25."""
    return compiling or packed


def holds_conv_states(layer) -> bool:
    return hasattr(layer, "conv_states")


def conv_state_written(layer, index: int) -> bool:
    return bool(layer.has_previous_state.get(index, False))


def conv_state(layer, index: int):
    return layer.conv_states[index]


def records_past(cache, layer_idx: int) -> bool:
    """Whether the cache layer keeps each position's state until ``crop`` (assisted decoding): sites then append."""
    return layer_records_past(cache.layers[layer_idx])


def layer_records_past(layer) -> bool:
    return bool(getattr(layer, "record_past", False))


def store_pde_state(cache, layer_idx: int, state_idx: int, states: torch.Tensor):
    """Stores a site's states ``[batch, steps, channels, positions]`` (after each current token; only the last unless
    the cache records its past) as its conv states ``state_idx ..``, one per step, one position per column. On the
    CPU a site's first store makes its conv states the rows of one block (:func:`conv_state_block`)."""
    layer = cache.layers[layer_idx]
    if (states.device.type == "cpu" and not layer_records_past(layer)
            and not getattr(layer, "is_conv_states_initialized", {}).get(state_idx, True)):
        # One [batch, steps, channels, 1] tensor whose rows are the conv states: a CPU decode step reads and writes the
        # site's state in one op each (an op costs a decoded token 5-15 us there); the cache copies into them in place.
        block = states.new_zeros((*states.shape[:3], 1))
        for step in range(states.shape[1]):
            row = block[:, step:step + 1]  # [batch, 1, channels, 1]
            layer.lazy_initialization(conv_states=row, state_idx=state_idx + step, conv_kernel_size=1)
            layer.conv_states[state_idx + step] = row
    for step in range(states.shape[1]):
        cache.update_conv_state(states[:, step:step + 1], layer_idx, state_idx=state_idx + step, conv_kernel_size=1)


def conv_state_block(levels):
    """The ``[batch, steps, channels, 1]`` tensor whose rows ``0 .. steps - 1`` are a site's conv states ``levels`` in
    order (:func:`store_pde_state`'s CPU layout), or None (another layout, or states the cache has replaced since: a
    reordered, offloaded or copied cache)."""
    block = levels[0]._base
    if block is None or block.dim() != 4 or block.shape[1] != len(levels):
        return None
    row, offset, stride = (block.shape[0], 1, *block.shape[2:]), block.storage_offset(), block.stride(1)
    for step, level in enumerate(levels):
        if level._base is not block or level.storage_offset() != offset + step * stride or level.shape != row:
            return None
    return block


def fill_unused_pde_states(cache):
    """Gives every conv state no PDE site uses an empty one (after a multi-token forward): ``crop`` walks them all."""
    layers = [layer for layer in getattr(cache, "layers", ()) if hasattr(layer, "is_conv_states_initialized")]
    like = next((state for layer in layers for index, state in layer.conv_states.items()
                 if layer.is_conv_states_initialized[index]), None)
    if like is None:
        return
    for layer in layers:
        for index, initialized in layer.is_conv_states_initialized.items():
            if not initialized:
                layer.lazy_initialization(conv_states=like.new_zeros(like.shape[0], 0, 0, 1), state_idx=index,
                                          conv_kernel_size=1)


def _bound_module(value):
    """The module a (compiled, wrapped) bound method of ``value`` is bound to, following ``__wrapped__``; or None."""
    for _ in range(8):  # (a few wrapper levels at most)
        if isinstance(getattr(value, "__self__", None), torch.nn.Module):
            return value.__self__
        value = getattr(value, "__wrapped__", None)
    return None


def compiled_calls(model, foreign_only: bool = False) -> list:
    """Names of ``model``'s attributes wrapping a module's bound method (``torch.compile(model.__call__)`` leaves one);
    ``foreign_only``: only those bound to another module."""
    owners = {name: _bound_module(value) for name, value in vars(model).items()
              if callable(value) and not isinstance(value, torch.nn.Module)}
    return [name for name, owner in owners.items() if owner is not None and (owner is not model or not foreign_only)]


def drop_compiled_calls(model, foreign_only: bool = False) -> list:
    """Removes :func:`compiled_calls` from ``model``; returns their names (``generate()`` compiles again)."""
    names = compiled_calls(model, foreign_only)
    for name in names:
        delattr(model, name)
    return names


class GenerationHooks:
    """transformers' generation methods that a model with causal PDE sites overrides."""

    @classmethod
    def is_remote_code(cls) -> bool:
        """transformers' answer (True: registered with the Auto classes), except in ``generate()``: it asks per token
        (two ``inspect.signature`` calls, a few % of a compiled step) to pass ``cache_position``, which none takes."""
        return False if GENERATING.get() else super().is_remote_code()

    def get_compiled_call(self, compile_config):
        drop_compiled_calls(self, foreign_only=True)
        return super().get_compiled_call(compile_config)

    def init_continuous_batching(self, *args, **kwargs):
        raise ValueError(f"{type(self).__name__}: continuous batching (generate_batch, cache_implementation='paged') "
                         "keeps no per-request conv state, so the PDE sites could not keep theirs; use generate() with "
                         "cache_implementation='dynamic' or 'static'.")


def inside_load_adapter() -> bool:
    """Whether transformers' ``model.load_adapter`` is on the call stack."""
    from transformers.integrations import PeftAdapterMixin

    frame = inspect.currentframe()
    while frame is not None and frame.f_code is not PeftAdapterMixin.load_adapter.__code__:
        frame = frame.f_back
    return frame is not None


def register_peft_tables(kind, config_class, tuner_class) -> None:
    """What ``peft.utils.register_peft_method`` does for a member of PEFT's own enum."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    PEFT_TYPE_TO_CONFIG_MAPPING[kind] = config_class
    PEFT_TYPE_TO_TUNER_MAPPING[kind] = tuner_class
    PEFT_TYPE_TO_PREFIX_MAPPING[kind] = tuner_class.prefix


def peft_adapted(model) -> bool:
    """Whether PEFT adapts ``model``: a ``peft_config`` set on it (by PEFT's tuner or transformers' ``load_adapter``),
    or PEFT's tuner layers / ``modules_to_save`` wrappers among its modules."""
    if model.__dict__.get("peft_config") or model.__dict__.get("_cta_peft_config") or getattr(
            model, "_hf_peft_config_loaded", False):
        return True
    # (where peft was never imported, nothing of it can be in the model)
    kinds = tuple(kind for kind in (getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTunerLayer", None),
                                    getattr(sys.modules.get("peft.utils.other"), "AuxiliaryTrainingWrapper", None))
                  if kind is not None)
    return bool(kinds) and any(isinstance(module, kinds) for module in model.modules())


def saved_module_wrappers(model, names) -> list:
    """``[(parent, attribute, wrapper)]``: PEFT's ``modules_to_save`` wrappers in ``model`` whose attribute name is in
    ``names``."""
    from peft.utils import ModulesToSaveWrapper

    return [(parent, attribute, wrapper) for parent in model.modules()
            for attribute, wrapper in parent.named_children()
            if attribute in names and isinstance(wrapper, ModulesToSaveWrapper)]


def wrapped_original(wrapper):
    """The module a ``ModulesToSaveWrapper`` wraps (the base model's own)."""
    return wrapper.original_module


def wrapped_copies(wrapper):
    """A ``ModulesToSaveWrapper``'s copies of its module, by adapter name (a ``ModuleDict``)."""
    return wrapper.modules_to_save


class PeftTunerHooks:
    """PEFT's private tuner hooks (checked on: peft 0.21.0-0.21.2), overridden for a ``LoraModel`` subclass put after
    this class in its bases: :meth:`before_injection` runs where the tuner's constructor injects its first adapter,
    :meth:`adapter_model_config` is the model config whose ``model_type`` picks LoRA's default target modules."""

    def before_injection(self, model, config, adapter_name) -> None:
        pass

    def adapter_model_config(self, model_config: dict) -> dict:
        return model_config

    def _pre_injection_hook(self, model, config, adapter_name):
        self.before_injection(model, config, adapter_name)
        super()._pre_injection_hook(model, config, adapter_name)

    def _prepare_adapter_config(self, peft_config, model_config):
        return super()._prepare_adapter_config(peft_config, self.adapter_model_config(model_config))


def peft_no_target_modules():
    """PEFT's ``target_modules`` marker for an adapter without LoRA layers (``peft.utils.constants``; checked on: peft
    0.21.0-0.21.2)."""
    from peft.utils.constants import DUMMY_TARGET_MODULES

    return DUMMY_TARGET_MODULES


def deepspeed_sequence_parallel_group():
    """DeepSpeed Ulysses' sequence-parallel process group, which accelerate's ``sp_backend="deepspeed"`` creates
    (``deepspeed.utils.groups._get_sequence_parallel_group``: DeepSpeed has no public getter). Written for DeepSpeed
    >= 0.18.2 (examples/README.md); not yet checked on a run: tests/test_gpu_context_parallel.py holds the test."""
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group()


def accelerate_parallelism_config():
    """The ``parallelism_config`` of accelerate's shared ``AcceleratorState``, or None: read from its shared state
    (``AcceleratorState._shared_state``) so that asking creates no state and imports nothing where accelerate is not
    in use (checked on: accelerate 1.16.0)."""
    state = sys.modules.get("accelerate.state")
    return None if state is None else state.AcceleratorState._shared_state.get("parallelism_config")


def hide_hybrid_layer_types(config):
    """accelerate's context-parallel guard (at ``prepare``; checked on: accelerate 1.16.0) refuses a config whose
    ``layer_types`` hold anything but "full_attention". A native CTA "hybrid" layer is full causal attention plus PDE
    cache state: sets ``layer_types`` to "full_attention" and returns ``(config, layer_types)`` for
    :func:`restore_layer_types`, or None where ``config`` is no all-hybrid CTA config."""
    if getattr(config, "model_type", None) != "cta" or set(config.layer_types or ()) != {"hybrid"}:
        return None
    hidden = (config, config.layer_types)
    config.layer_types = ["full_attention"] * len(config.layer_types)
    return hidden


def restore_layer_types(hidden) -> None:
    """Undoes :func:`hide_hybrid_layer_types` (given its answer; None: nothing to undo)."""
    if hidden is not None:
        config, config.layer_types = hidden
