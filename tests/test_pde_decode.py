"""The one-token state update (``cta.pde_decode``: the CPU / compiled decode path) equals the reference sequence
operator run on the token with the stored state (``pde_decode_step_reference``), for every PDE type, scalar and
per-channel coefficients, padded tokens, and over many consecutive tokens equals the full-sequence result."""

import pytest
import torch

import cta
from cta.pde_decode import decode_update_torch as pde_decode_update
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
    # a model's [batch, 1, channels] token
    out_3d = pde_decode_update(x.unsqueeze(1), state_3d, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta,
                               token_mask=mask)
    torch.testing.assert_close(out_3d.squeeze(1), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state_3d, expected_state, rtol=1e-5, atol=1e-6)
    if masked:  # a padded token comes back unchanged and leaves a wall (zeros) as the state
        assert torch.equal(out[1], x[1]) and torch.all(state_2d[1] == 0)


@pytest.mark.parametrize("pde_type", ("diffusion", "wave", "advection_diffusion"))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_update_on_the_cache_conv_states(pde_type, batch, masked):
    """The update on a cache's own state, its block of conv states ``[batch, steps, channels, 1]`` or its
    ``[batch, 1, channels, 1]`` conv states one per level (read and written as they are), equals the reference
    step."""
    g = torch.Generator().manual_seed(2)
    steps, channels = 4, 5
    alpha, beta = coefficients(pde_type, channels, False, g)
    x = torch.randn(batch, 1, channels, generator=g)
    state = torch.randn(batch, steps, channels, generator=g)
    mask = (torch.arange(batch) != 1).long() if masked else None
    expected_state = state.clone()
    expected = pde_decode_step_reference(x[:, 0], expected_state, pde_type=pde_type, steps=steps, alpha=alpha,
                                         beta=beta, token_mask=mask)
    block = state.unsqueeze(-1).clone()  # [batch, steps, C, 1]: the CPU cache's rows
    conv_states = list(block.clone().split(1, dim=1))  # [batch, 1, C, 1] each
    for held in (block, conv_states):
        held_before = held if torch.is_tensor(held) else None
        out = pde_decode_update(x, held, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, token_mask=mask)
        torch.testing.assert_close(out[:, 0], expected, rtol=1e-5, atol=1e-6)
        got = held_before[..., 0] if held_before is not None else torch.cat([c[..., 0] for c in held], 1)
        torch.testing.assert_close(got, expected_state, rtol=1e-5, atol=1e-6)


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
            tokens = [module._decode(x[:, i:i + 1], levels, torch.ones(2, 1)) for i in range(x.shape[1])]
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
            out = module._decode(x, levels, None)
        expected = pde_decode_step_reference(x[:, 0], expected_state, pde_type="diffusion", steps=3,
                                             alpha=module.alpha, coefficient_bounds=module.bounds)
        torch.testing.assert_close(out[:, 0], expected)
        torch.testing.assert_close(torch.cat(levels, 1), expected_state)


@pytest.mark.parametrize("pde_type", ["diffusion", "reaction_diffusion"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_cpu_cache_holds_a_site_state_as_one_block(pde_type, per_channel):
    """On the CPU a site's conv states are the rows of one block (read and written by one op each); a cache whose
    states were replaced (beam search's reorder) falls back to one buffer per step; both decode the full sequence,
    a padded token inside the decoded part included (its wall)."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from cta.pde_cache import CACHE_ARGUMENT, cached_pde_state, conv_state_block
    from pde_testing import randomize_pde

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    cta.patch_model(model, pde_type=pde_type, pde_steps=3, placement="block_output", backend="torch",
                    per_channel=per_channel)
    randomize_pde(model, seed=1)
    model.eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5] = 0  # (a padded token while decoding: the site's walls)
    site = next(m for m in model.modules() if isinstance(m, cta.PDERefinement))
    block_of = lambda cache: conv_state_block(cached_pde_state(cache, site.layer_idx, site.state_idx, site.steps)[0])  # noqa: E731
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = DynamicCache(config=model.config)
        logits = [model(ids[:, :4], attention_mask=mask[:, :4], **{CACHE_ARGUMENT: cache}, use_cache=True).logits]
        block = block_of(cache)
        assert block is not None and block.shape == (2, 3, 32, 1)
        for t in range(4, 8):
            if t == 7:  # (an identity reorder: the same values in new tensors)
                cache.reorder_cache(torch.arange(2))
                assert block_of(cache) is None
            else:
                assert block_of(cache) is block
            logits.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], **{CACHE_ARGUMENT: cache},
                                use_cache=True).logits)
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[valid], full[valid], rtol=1e-4, atol=1e-5)


def test_a_patched_model_pickles_after_cpu_decoding():
    """What a site keeps while decoding on the CPU (the coefficients' values, the cache's state block, held weakly)
    stays out of a whole-model pickle (``torch.save(model)``); the reloaded model decodes the same tokens."""
    import io

    from transformers import LlamaConfig, LlamaForCausalLM

    from pde_testing import randomize_pde

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    cta.patch_model(model, pde_type="reaction_diffusion", pde_steps=3, placement="block_output", backend="torch")
    randomize_pde(model, seed=2)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert any("_kept_state_block" in vars(m) for m in model.modules())  # (the memo exists: what the test is about)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=False)
    assert not any("_kept_state_block" in vars(m) for m in reloaded.modules())
    assert torch.equal(reloaded.generate(prompt, max_new_tokens=6, do_sample=False), tokens)


def test_reaction_factor_form_is_found_only_where_it_holds():
    """``R(u, b)`` written ``b * f(u)`` or ``-b * f(u)`` (f without ``b``) gets the factor form the CPU decode step adds
    in one fused op, equal to R; any other expression gets none."""
    from cta.pde_spec import SCHEMES, _factor_in_b

    u, b = torch.linspace(-3, 3, 13), 0.37
    for expression, sign in (("-b * tanh(u)", -1.0), ("b * u", 1.0), ("b * (1.0 - tanh(u))", 1.0)):
        found_sign, f = _factor_in_b(expression)
        expected = eval(f"lambda u, b: {expression}", {"tanh": torch.tanh})(u, b)  # noqa: S307
        assert found_sign == sign and torch.allclose(found_sign * b * f(u), expected)
    for expression in ("-b * tanh(u) + u", "b * b * u", "b * (b * u)", "u * b", "-(b * u)", "tanh(u)"):
        assert _factor_in_b(expression) is None
    assert SCHEMES["reaction_diffusion"].torch_reaction_factor[0] == -1.0
