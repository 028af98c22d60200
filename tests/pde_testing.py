"""What the model tests share: PDE coefficients moved off their initial values."""

import torch

import cta


def randomize_pde(model, seed=0, margin=0.0):
    """Moves every PDE coefficient of ``model`` to a random point of its stable interval (so that a bug cannot hide
    behind 0), at least ``margin`` (a fraction of the interval) away from either bound."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, cta.PDERefinement):
                for param, bounds in ((module.alpha, module.alpha_bounds), (module.beta, module.beta_bounds)):
                    if param is not None:
                        low, high = bounds
                        draw = torch.rand(param.shape, generator=generator)
                        param.copy_((low + (high - low) * (margin + (1 - 2 * margin) * draw)).to(param.device))
    return model
