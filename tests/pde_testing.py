"""What the model tests share: PDE coefficients moved off their initial values, activation checkpointing turned on
under the installed transformers' name."""

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


def enable_checkpointing(model, use_reentrant=None):
    """Turns on activation checkpointing (transformers 5.25's ``activation_checkpointing_enable``; the older releases
    of the tested range have only ``gradient_checkpointing_enable``, which 5.25 deprecates); returns ``model``."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(kwargs)
    return model
