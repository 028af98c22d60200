"""A PDE scheme registered at test time (diffusion with a decay term, ``u += a lap(u) - b u``) runs everywhere the
built-in ones do, from its one definition (``pde_spec.PDEScheme``): the reference takes the rule it states, and the
decode step (torch recurrence, the C++ CPU decode kernel, the Triton decode kernel), the bidirectional and causal Triton forward
and backward (interpreter on CPU; streamed states included) and cached generation all agree with the reference."""

from triton_testing import DEVICE, needs_kernels  # (first: sets up Triton's interpreter before triton is imported)

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import cta  # noqa: E402
from cta import kernels_cpu, pde_spec  # noqa: E402
from cta.pde_decode import decode_update_torch as pde_decode_update  # noqa: E402
from cta.pde_reference import pde_decode_step_reference, pde_refine_reference  # noqa: E402

DECAY = pde_spec.PDEScheme(
    "diffusion_decay", (((0.0, 0.25), (0.0, 0.5)), ((0.0, 0.5), (0.0, 0.5))), (0.1, 0.05),
    reaction=("-b * u", "-b", "-u"),
    stability="rows 1 - 2a - b (bidirectional), 1 - a - b (causal) stay non-negative and sum to at most 1")


@pytest.fixture(autouse=True, scope="module")
def decay_scheme():
    pde_spec.register_scheme(DECAY)
    yield DECAY
    pde_spec.SCHEMES.pop(DECAY.name)  # (its kernel id stays reserved)
    for table in (pde_spec.COEFFICIENT_BOUNDS, pde_spec.PAPER_COEFFICIENTS):
        for key in [k for k in table if DECAY.name in (k, k[0])]:
            del table[key]


def _inputs(causal, seed=0, batch=2, seq=37, channels=20, padded=True):
    """x, per-channel alpha and beta inside the causal / bidirectional bounds, a mask with a wall and left padding."""
    g = torch.Generator().manual_seed(seed)
    (a_lo, a_hi), (b_lo, b_hi) = DECAY.bounds[causal]
    x = torch.randn(batch, seq, channels, generator=g)
    alpha = a_lo + (a_hi - a_lo) * torch.rand(channels, generator=g)
    beta = b_lo + (b_hi - b_lo) * torch.rand(channels, generator=g)
    mask = torch.ones(batch, seq)
    if padded:
        mask[1, :5] = 0
        mask[0, 17] = 0
    return x, alpha, beta, mask


@pytest.mark.parametrize("causal", (False, True), ids=("bidi", "causal"))
def test_reference_follows_the_definition(causal):
    """One step of the registered scheme is a diffusion step minus ``b u`` on every real token."""
    x, alpha, beta, mask = _inputs(causal)
    u = x
    for _ in range(3):
        diffused = pde_refine_reference(u, pde_type="diffusion", steps=1, alpha=alpha, causal=causal,
                                        attention_mask=mask)
        u = diffused - beta * u * mask.unsqueeze(-1)
    got = pde_refine_reference(x, pde_type=DECAY.name, steps=3, alpha=alpha, beta=beta, causal=causal,
                               attention_mask=mask)
    torch.testing.assert_close(got, u, rtol=1e-6, atol=1e-6)
    assert pde_spec.coefficient_bounds(DECAY.name, causal) == DECAY.bounds[causal]
    with pytest.raises(ValueError, match="outside the stable interval"):
        pde_refine_reference(x, pde_type=DECAY.name, steps=1, alpha=0.1, beta=0.9, causal=causal)


@pytest.mark.parametrize("scalar", (False, True), ids=("per_channel", "scalar"))
def test_decode_steps_continue_the_sequence(scalar):
    """Token by token, the torch recurrence, the entry point and the reference decode step continue the causal
    sequence operator's state (and, with kernels, the Triton decode kernel does too); with Python numbers, the
    recurrence adds the reaction ``-b * u`` through its factor form (one fused add)."""
    x, alpha, beta, _ = _inputs(True, padded=False)
    if scalar:
        alpha, beta = alpha[0], beta[0]
    steps, prefix = 4, 30
    full = pde_refine_reference(x, pde_type=DECAY.name, steps=steps, alpha=alpha, beta=beta, causal=True)
    _, state = pde_refine_reference(x[:, :prefix], pde_type=DECAY.name, steps=steps, alpha=alpha, beta=beta,
                                    causal=True, return_final_state=True)
    states = {name: state.clone() for name in ("recurrence", "entry", "reference", "triton", "numbers", "cpu")}
    assert DECAY.torch_reaction_factor[0] == -1.0
    kernels = _triton()
    for t in range(prefix, x.shape[1]):
        token = x[:, t]
        outs = {
            "recurrence": pde_decode_update(token, states["recurrence"], pde_type=DECAY.name, steps=steps,
                                            alpha=alpha, beta=beta),
            "entry": cta.pde_decode_update(token, states["entry"], pde_type=DECAY.name, steps=steps, alpha=alpha,
                                           beta=beta, backend="torch"),
            "reference": pde_decode_step_reference(token, states["reference"], pde_type=DECAY.name, steps=steps,
                                                   alpha=alpha, beta=beta),
        }
        if scalar:
            outs["numbers"] = pde_decode_update(token, states["numbers"], pde_type=DECAY.name, steps=steps,
                                                alpha=float(alpha), beta=float(beta))
        if kernels_cpu.kernel() is not None:  # (a kernel generated with this scheme's step: "-b * u" in C++)
            assert cta.pde_cta.choose_backend("auto", token, steps, states["cpu"], DECAY.name) == "cpu"
            outs["cpu"] = cta.pde_decode_update(token, states["cpu"], pde_type=DECAY.name, steps=steps, alpha=alpha,
                                                beta=beta)
        if kernels is not None:  # (on DEVICE: CUDA in a GPU run)
            state_on_device = states["triton"].to(DEVICE)
            outs["triton"] = cta.pde_decode_update(
                token.to(DEVICE), state_on_device, pde_type=DECAY.name, steps=steps, alpha=alpha.to(DEVICE),
                beta=beta.to(DEVICE), backend="triton").cpu()
            states["triton"].copy_(state_on_device)
        for name, out in outs.items():
            torch.testing.assert_close(out, full[:, t], rtol=1e-5, atol=1e-5, msg=f"{name} at {t}")


def _triton():
    from cta.triton_cta import is_available

    if not is_available():
        return None
    from cta import triton_cta

    return triton_cta


@needs_kernels
@pytest.mark.parametrize("causal, state", [(False, False), (True, False), (True, True)],
                         ids=("bidi", "causal", "causal-streamed_state"))  # (states are causal)
def test_triton_forward_and_backward(causal, state):
    """The Triton forward and backward (the walk and the tile backward the definition derives) equal the reference
    and its autograd: outputs, and the gradients of x, alpha, beta (and of the initial state that a causal call
    streams in and the final state it hands on)."""
    pde_refine_triton = functools.partial(cta.pde_refine, backend="triton")
    x, alpha, beta, mask = _inputs(causal, seed=1)
    steps = 3
    init = torch.randn(x.shape[0], steps, x.shape[2]) if state else None
    results = []
    for fn in (pde_refine_reference, pde_refine_triton):
        leaves = [t.clone().to(DEVICE).requires_grad_() for t in (x, alpha, beta) + ((init,) if state else ())]
        out = fn(leaves[0], pde_type=DECAY.name, steps=steps, alpha=leaves[1], beta=leaves[2], causal=causal,
                 attention_mask=mask.to(DEVICE), initial_state=leaves[3] if state else None,
                 return_final_state=state)
        y, fin = out if state else (out, None)
        loss = (y * torch.linspace(-1, 1, y.shape[1], device=DEVICE)[:, None]).sum()
        if fin is not None:
            loss = loss + fin.square().sum()
        results.append([y, *torch.autograd.grad(loss, leaves)])
    for name, got, expected in zip(("y", "dx", "dalpha", "dbeta", "dinit"), results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)


@needs_kernels
@pytest.mark.parametrize("causal", (False, True), ids=("bidi", "causal"))
def test_module_training_call_clamps_in_the_kernel(causal):
    """``PDERefinement`` on the kernels, its raw coefficients outside the bounds: the kernels clamp them as they read
    them, and the raw parameters get the clamped ones' gradient, as the reference module's straight-through
    projection gives."""
    from cta.pde_cta import PDERefinement

    x, _, _, mask = _inputs(causal, seed=2)
    grads = []
    for backend in ("torch", "triton"):
        module = PDERefinement(x.shape[-1], DECAY.name, 3, causal=causal, per_channel=True, backend=backend).to(DEVICE)
        with torch.no_grad():
            module.alpha.copy_(torch.linspace(-0.2, 0.8, x.shape[-1]))
            module.beta.copy_(torch.linspace(0.7, -0.1, x.shape[-1]))
        xi = x.clone().to(DEVICE).requires_grad_()
        y = module(xi, attention_mask=mask.to(DEVICE))
        (y * torch.linspace(-1, 1, y.shape[1], device=DEVICE)[:, None]).sum().backward()
        grads.append((y, xi.grad, module.alpha.grad, module.beta.grad))
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["native", "llama"])
def test_cached_generation_equals_recomputation(kind):
    """Greedy generation with a cache (the decode step on the cached state) equals recomputing every prefix, with
    left padding, for a native decoder and a patched Llama whose sites run the registered scheme."""
    from test_generation_matrix import decoder, generate, prompts

    model = decoder(kind, DECAY.name, ["embedding", "value", "block_output"] if kind == "native" else "block_output",
                    steps=3)
    ids, mask = prompts(True)
    tokens, logits = generate(model, ids, mask)
    expected, expected_logits = generate(model, ids, mask, use_cache=False)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
