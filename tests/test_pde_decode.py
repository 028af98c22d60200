"""The one-token state update (``cta.pde_decode``: the CPU / compiled decode path) equals the reference sequence
operator run on the token with the stored state (``pde_decode_step_reference``), for every PDE type, scalar and
per-channel coefficients, padded tokens, and over many consecutive tokens equals the full-sequence result."""

import pytest
import torch

import cta
from cta.pde_decode import causal_decode_map, pde_decode_update
from cta.pde_reference import pde_decode_step_reference, pde_refine_reference

TYPES = ("diffusion", "wave", "advection_diffusion", "reaction_diffusion")


def coefficients(pde_type, channels, per_channel, generator):
    (a_low, a_high), beta_bounds = cta.coefficient_bounds(pde_type, causal=True)
    shape = (channels,) if per_channel else (1,)
    alpha = a_low + (a_high - a_low) * torch.rand(shape, generator=generator)
    beta = None
    if beta_bounds is not None:
        beta = beta_bounds[0] + (beta_bounds[1] - beta_bounds[0]) * torch.rand(shape, generator=generator)
    return alpha, beta


@pytest.mark.parametrize("pde_type", TYPES)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_update_equals_the_reference_step(pde_type, per_channel, masked):
    g = torch.Generator().manual_seed(0)
    batch, steps, channels = 3, 5, 7
    alpha, beta = coefficients(pde_type, channels, per_channel, g)
    x = torch.randn(batch, channels, generator=g)
    state = torch.randn(batch, steps, channels, generator=g)
    mask = torch.tensor([1, 0, 1]) if masked else None
    expected_state, state_2d, state_3d = state.clone(), state.clone(), state.clone()
    expected = pde_decode_step_reference(x, expected_state, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta,
                                         token_mask=mask)
    out = pde_decode_update(x, state_2d, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, token_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state_2d, expected_state, rtol=1e-5, atol=1e-6)
    # a model's [batch, 1, channels] token, and the map kept by the caller (scalar coefficients: a matrix)
    decode_map = None
    if pde_type != "reaction_diffusion":
        decode_map = causal_decode_map(pde_type, steps, alpha, beta)
        decode_map = decode_map[..., 0] if not per_channel else decode_map
    out_3d = pde_decode_update(x.unsqueeze(1), state_3d, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta,
                               token_mask=mask, decode_map=decode_map)
    torch.testing.assert_close(out_3d.squeeze(1), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state_3d, expected_state, rtol=1e-5, atol=1e-6)
    if masked:  # a padded token comes back unchanged and leaves a wall (zeros) as the state
        assert torch.equal(out[1], x[1]) and torch.all(state_2d[1] == 0)


@pytest.mark.parametrize("pde_type", TYPES)
def test_token_by_token_equals_the_sequence(pde_type):
    """Decoding a sequence token by token through the module's step (as cached generation does) gives the
    full-sequence refinement, in fp32 and in bf16 input."""
    g = torch.Generator().manual_seed(1)
    alpha, beta = coefficients(pde_type, 6, False, g)
    module = cta.PDERefinement(6, pde_type, 4, causal=True, alpha=float(alpha), beta=None if beta is None else
                               float(beta), backend="torch", layer_idx=0).eval()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 9, 6, generator=g).to(dtype)
        expected = pde_refine_reference(x, pde_type=pde_type, steps=4, alpha=module.alpha, beta=module.beta,
                                        causal=True)
        levels = tuple(torch.zeros(2, 1, 6) for _ in range(4))  # one buffer per step, as a cache keeps them
        with torch.no_grad():
            tokens = [module._decode_step(x[:, i:i + 1], levels, torch.ones(2, 1)) for i in range(x.shape[1])]
        torch.testing.assert_close(torch.cat(tokens, 1), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_kept_map_follows_the_coefficients():
    """The CPU step keeps the linear map while the coefficients keep their values: after they change (a training
    step), the next token uses the new ones."""
    module = cta.PDERefinement(4, "diffusion", 3, causal=True, alpha=0.1, backend="torch", layer_idx=0).eval()
    x = torch.randn(1, 1, 4)
    for value in (0.1, 0.3, 2.0):  # 2.0: projected onto the bound (1.0 for causal diffusion)
        with torch.no_grad():
            module.alpha.fill_(value)
            levels, expected_state = tuple(torch.ones(1, 1, 4) for _ in range(3)), torch.ones(1, 3, 4)
            out = module._decode_step(x, levels, None)
        expected = pde_decode_step_reference(x[:, 0], expected_state, pde_type="diffusion", steps=3,
                                             alpha=module.alpha, coefficient_bounds=module.bounds)
        torch.testing.assert_close(out[:, 0], expected)
        torch.testing.assert_close(torch.cat(levels, 1), expected_state)
