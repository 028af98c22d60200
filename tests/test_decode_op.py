"""The one-token decode step under ``torch.compile``: the custom op ``cta::pde_decode_token`` (the fused Triton decode
kernel, which reads the token and the state and writes the refined token and, in place, the new state) against the
PyTorch recurrence (``pde_decode_step_reference``, the ground truth), eagerly, through ``torch.library.opcheck``,
through Inductor on a view of a ``[batch, steps, channels, 1]`` cache buffer between an add and a norm, and in a
patched model's compiled decode step (one op per PDE site, nothing else of the PDE traced). On CPU the kernel runs
through Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/triton_testing.py before triton is imported);
with ``CTA_TEST_GPU=1`` the same tests run on CUDA."""

from triton_testing import DEVICE, needs_kernels  # (first: sets up Triton's interpreter before triton is imported)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from cta.pde_cta import PDE_TYPES  # noqa: E402
from cta.pde_reference import pde_decode_step_reference  # noqa: E402
from cta.pde_spec import PDE_IDS, coefficient_bounds  # noqa: E402



def _case(pde, per_channel, batch, steps, channels, seed):
    """Raw coefficients on both sides of the scheme's bounds (the op clamps them), a token, and a cache buffer
    ``[batch, steps, channels, 1]`` whose contiguous ``[batch, steps, channels]`` view is the state."""
    gen = torch.Generator().manual_seed(seed)
    width = channels if per_channel else 1
    alpha = torch.rand(width, generator=gen) * 1.2 - 0.2
    beta = None
    if pde in ("reaction_diffusion", "advection_diffusion"):
        beta = torch.rand(width, generator=gen) * 1.4 - 0.6
    x = torch.randn(batch, 1, channels, generator=gen)
    buffer = torch.randn(batch, steps, channels, 1, generator=gen)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(alpha), to(beta), to(x), to(buffer)


def _reference(x, state, pde, steps, alpha, beta, token_mask):
    """The PyTorch recurrence on the coefficients clamped into their bounds: (refined token, new state)."""
    bounds = coefficient_bounds(pde, True)
    state = state.clone()
    refined = pde_decode_step_reference(
        x.reshape(x.shape[0], x.shape[-1]), state, pde_type=pde, steps=steps, alpha=alpha.clamp(*bounds[0]),
        beta=beta.clamp(*bounds[1]) if beta is not None else None,
        token_mask=None if token_mask is None else token_mask.reshape(-1).float())
    return refined.reshape(x.shape), state


def _op(x, state, alpha, beta, token_mask, pde, steps):
    from cta.triton_cta import pde_decode_token_traced

    return pde_decode_token_traced(x, state, alpha, beta, token_mask, pde, steps, coefficient_bounds(pde, True))


@needs_kernels
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
@pytest.mark.parametrize("pde", PDE_TYPES)
def test_decode_op_matches_the_recurrence(pde, per_channel):
    """The op on odd shapes, with and without a token mask (an attention mask's strided [batch, 1] column, long and
    bool, a padded sequence among them): the refined token and the state, written in place through the view of the
    cache buffer, equal the recurrence's."""
    batch, steps, channels = 3, 3, 37
    alpha, beta, x, buffer = _case(pde, per_channel, batch, steps, channels, seed=5)
    column = torch.tensor([[1, 1, 0], [0, 0, 1], [1, 1, 1]], device=DEVICE)[:, 1:2]  # sequence 1 padded
    for token_mask in (None, column, column.bool()):
        cache = buffer.clone()
        state = cache[..., -1]
        expected, expected_state = _reference(x, state, pde, steps, alpha, beta, token_mask)
        refined = _op(x, state, alpha, beta, token_mask, pde, steps)
        torch.testing.assert_close(refined, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache[..., -1], expected_state, rtol=1e-5, atol=1e-6)
        if token_mask is not None:  # a padded token: returned unchanged, and a wall (zeros) as its state
            assert torch.equal(refined[1], x[1])
            assert not cache[1].any()


@needs_kernels
def test_decode_op_schema_declares_its_mutation():
    """``torch.library.opcheck``: the schema (the state declared as written in place, nothing else), the fake
    implementation's shapes and strides, and the op under AOT dispatch, per-channel and scalar, with a mask."""
    batch, steps, channels = 2, 2, 19
    for pde, per_channel in (("wave", True), ("advection_diffusion", False)):
        alpha, beta, x, buffer = _case(pde, per_channel, batch, steps, channels, seed=9)
        mask = torch.tensor([[1], [0]], device=DEVICE)
        bounds = [v for pair in coefficient_bounds(pde, True) if pair is not None for v in pair]
        torch.library.opcheck(torch.ops.cta.pde_decode_token.default,
                              (x, buffer[..., -1].clone(), alpha, beta, mask, PDE_IDS[pde], steps, bounds))


@needs_kernels
@pytest.mark.parametrize("pde", ["diffusion", "reaction_diffusion"])
def test_decode_op_through_inductor_between_an_add_and_a_norm(pde):
    """Inductor (``fullgraph=True``) compiles the op where a model calls it: on the sum of a residual add, the state a
    view of the cache buffer (a graph input, written in place), an RMS norm after it. The outputs and the buffer
    equal the recurrence's, over several calls (each reads what the previous one wrote)."""
    batch, steps, channels = 2, 4, 24
    alpha, beta, x, buffer = _case(pde, True, batch, steps, channels, seed=13)
    weight = torch.randn(channels, generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def step(residual, update, cache):
        refined = _op(residual + update, cache[..., -1], alpha, beta, None, pde, steps)
        normed = refined * torch.rsqrt(refined.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
        return refined, normed

    torch.compiler.reset()
    compiled = torch.compile(step, fullgraph=True)
    cache, expected_state = buffer.clone(), buffer[..., -1].clone()
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        residual, update = (torch.randn(batch, 1, channels, generator=gen).to(DEVICE) for _ in range(2))
        expected, expected_state = _reference(residual + update, expected_state, pde, steps, alpha, beta, None)
        refined, normed = compiled(residual, update, cache)
        torch.testing.assert_close(refined, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(normed, expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-6)
                                   * weight, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache[..., -1], expected_state, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("pde,per_channel", [("diffusion", False), ("wave", True), ("reaction_diffusion", True),
                                             ("advection_diffusion", False)])
def test_compiled_decode_step_is_one_op_per_site(pde, per_channel):
    """A patched decoder's decode step traced with ``torch.compile(fullgraph=True)`` through transformers'
    StaticCache holds exactly one ``cta::pde_decode_token`` per PDE site and none of the recurrence's torch ops
    (no ``lerp``, no write of the state), and the traced step's logits equal eager decoding's token by token."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from cta.patching_cta import patch_model, pde_modules

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def decode(step):
        """The logits of 4 decode steps after a 6-token prefill (eager), through a StaticCache."""
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        return torch.cat([step(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                               attention_mask=torch.ones(1, t + 1, dtype=torch.long, device=DEVICE)).logits
                          for t in range(6, 10)], 1)

    def traced_targets():
        """(the traced decode step's logits, the targets of the calls of its last graph: the attention mask's
        length changes every step, so a second trace makes it dynamic)."""
        graphs = []

        def backend(graph_module, example_inputs):  # records the traced graph and runs it as traced
            graphs.append(graph_module)
            return graph_module.forward

        torch.compiler.reset()
        logits = decode(torch.compile(model.forward, fullgraph=True, backend=backend))
        assert 1 <= len(graphs) <= 2
        return logits, [node.target for node in graphs[-1].graph.nodes if node.op in ("call_function", "call_method")]

    def writes(targets):
        return sorted(str(t) for t in targets if str(t).rstrip("_").endswith("copy") or str(t).endswith("_"))

    with torch.no_grad():
        _, unpatched_targets = traced_targets()
        patch_model(model, pde_type=pde, pde_steps=3, placement="block_output", init="paper", backend="triton",
                    per_channel=per_channel)
        model.to(DEVICE)
        eager = decode(model.forward)
        compiled, targets = traced_targets()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    ops = [t for t in targets if t in (torch.ops.cta.pde_decode_token.default, torch.ops.cta.pde_decode_token)]
    assert len(ops) == len(pde_modules(model)) == 2
    names = {getattr(t, "__name__", str(t)) for t in targets}
    assert not names & {"lerp", "tanh"}, names  # the recurrence is not traced
    assert writes(targets) == writes(unpatched_targets)  # and no write of its own: the op writes the state
