"""CTA: Continuous-Time Attention (PDE-guided refinement of token representations) for Hugging Face Transformers."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from .configuration_cta import LAYER_PLACEMENTS, PDE_PLACEMENTS, CTAConfig
from .modeling_cta import CTAForCausalLM, CTAForSequenceClassification, CTAModel, CTAPreTrainedModel
from .pde_context_parallel import ContextParallelCallback, SequenceSharding, shard_sequences
from .patching_cta import load_patched, mark_pde_trainable, patch_model, pde_modules_to_save, unpatch_model
from .pde_cta import (COEFFICIENT_BOUNDS, PDE_TYPES, PDERefinement, coefficient_bounds, pde_decode_step,
                      pde_decode_step_reference, pde_decode_update, pde_refine, pde_refine_reference,
                      triton_available)

__version__ = "0.2.0"

try:  # PEFT is optional: with it, adapters of patched models carry their patch (`CTALoraConfig`)
    from .peft_cta import CTALoraConfig, register_peft_type
except ImportError as _peft_missing:
    _PEFT_ERROR = str(_peft_missing)

    def CTALoraConfig(*args, **kwargs):  # noqa: N802 (stands in for the class)
        raise ImportError(f"cta.CTALoraConfig needs peft (`pip install 'cta[peft]'`): {_PEFT_ERROR}")
else:
    register_peft_type()

AutoConfig.register("cta", CTAConfig, exist_ok=True)
CTAConfig.register_for_auto_class()
for _auto, _model_class in ((AutoModel, CTAModel), (AutoModelForCausalLM, CTAForCausalLM),
                            (AutoModelForSequenceClassification, CTAForSequenceClassification)):
    _auto.register(CTAConfig, _model_class, exist_ok=True)
    # `save_pretrained` then writes `auto_map` and copies the flat code files next to the weights.
    _model_class.register_for_auto_class(_auto.__name__)
del _auto, _model_class
