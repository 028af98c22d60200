"""CTA: Continuous-Time Attention (PDE-guided refinement of token representations) for Hugging Face Transformers."""

from .configuration_cta import LAYER_PLACEMENTS, PDE_PLACEMENTS, CTAConfig
from .pde_cta import (
    COEFFICIENT_BOUNDS,
    PDE_TYPES,
    PDERefinement,
    coefficient_bounds,
    pde_decode_step,
    pde_decode_step_reference,
    pde_refine,
    pde_refine_reference,
    triton_available,
)

__version__ = "0.1.0"
