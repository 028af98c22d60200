"""The PyTorch reference operator against hand-computed cases, closed forms and stability bounds."""

import math

import pytest
import torch

import cta.pde_cta as pde_cta
from cta.pde_cta import (
    COEFFICIENT_BOUNDS,
    PDE_TYPES,
    WAVE_DAMPING,
    PDERefinement,
    pde_decode_step_reference,
    pde_refine,
    pde_refine_reference,
)


def refine(x, **kwargs):
    return pde_refine_reference(torch.tensor(x, dtype=torch.float64).reshape(1, -1, 1), **kwargs).flatten().tolist()


# --------------------------------------------------------------------------------------------------------------
# Hand-computed small cases
# --------------------------------------------------------------------------------------------------------------


def test_bidirectional_diffusion_one_step_by_hand():
    # u[i] += a (u[i-1] - 2 u[i] + u[i+1]) inside, zero-flux at the ends.
    out = refine([0.0, 1.0, 0.0, 0.0], pde_type="diffusion", steps=1, alpha=0.25)
    assert out == pytest.approx([0.25, 0.5, 0.25, 0.0])
    out = refine([1.0, 0.0, 0.0], pde_type="diffusion", steps=1, alpha=0.25)
    assert out == pytest.approx([0.75, 0.25, 0.0])  # the wall: u0 += a (u1 - u0)


def test_bidirectional_diffusion_two_steps_conserve_mass():
    out = refine([0.0, 0.0, 4.0, 0.0, 0.0], pde_type="diffusion", steps=2, alpha=0.25)
    # step 1: [0, 1, 2, 1, 0]; step 2: [0.25, 1, 1.5, 1, 0.25]
    assert out == pytest.approx([0.25, 1.0, 1.5, 1.0, 0.25])
    assert sum(out) == pytest.approx(4.0)


def test_causal_diffusion_by_hand():
    # u[i] += a (u[i-1] - u[i]) with u[-1] = 0 (zero inflow).
    out = refine([1.0, 0.0, 0.0], pde_type="diffusion", steps=1, alpha=0.25, causal=True)
    assert out == pytest.approx([0.75, 0.25, 0.0])
    out = refine([1.0, 0.0, 0.0], pde_type="diffusion", steps=2, alpha=0.25, causal=True)
    assert out == pytest.approx([0.5625, 0.375, 0.0625])


def test_wave_by_hand():
    # v1 = a lap(u0); u1 = u0 + v1; v2 = (1-d) v1 + a lap(u1); u2 = u1 + v2
    a, d = 0.25, WAVE_DAMPING
    u0 = [0.0, 1.0, 0.0]
    v1 = [a * 1, a * -2, a * 1]
    u1 = [x + y for x, y in zip(u0, v1)]
    lap1 = [u1[1] - u1[0], u1[0] - 2 * u1[1] + u1[2], u1[1] - u1[2]]
    v2 = [(1 - d) * v + a * l for v, l in zip(v1, lap1)]
    u2 = [x + y for x, y in zip(u1, v2)]
    assert refine(u0, pde_type="wave", steps=2, alpha=a) == pytest.approx(u2)


def test_advection_moves_mass_downstream_and_conserves_it():
    out = refine([0.0, 1.0, 0.0], pde_type="advection_diffusion", steps=1, alpha=0.0, beta=0.5)
    assert out == pytest.approx([0.0, 0.5, 0.5])
    out = refine([0.0, 1.0, 0.0], pde_type="advection_diffusion", steps=1, alpha=0.0, beta=-0.5)
    assert out == pytest.approx([0.5, 0.5, 0.0])
    out = refine([0.0, 0.0, 1.0], pde_type="advection_diffusion", steps=3, alpha=0.1, beta=0.4)
    assert sum(out) == pytest.approx(1.0)  # walls keep the mass


def test_reaction_is_saturating_decay():
    out = refine([2.0, 2.0, 2.0], pde_type="reaction_diffusion", steps=1, alpha=0.2, beta=0.5)
    assert out == pytest.approx([2.0 - 0.5 * math.tanh(2.0)] * 3)


def test_steps_zero_is_identity_and_dtype_is_kept():
    x = torch.randn(2, 7, 5, dtype=torch.bfloat16)
    for pde_type in PDE_TYPES:
        y = pde_refine_reference(x, pde_type=pde_type, steps=0, alpha=0.2, beta=0.1)
        assert y.dtype == torch.bfloat16 and torch.equal(y, x)
        assert pde_refine_reference(x, pde_type=pde_type, steps=2, alpha=0.1, beta=0.1).dtype == torch.bfloat16


def test_bf16_input_is_accumulated_in_fp32():
    x = torch.randn(1, 64, 8)
    ref = pde_refine_reference(x.to(torch.bfloat16).float(), pde_type="diffusion", steps=16, alpha=0.3)
    y = pde_refine_reference(x.to(torch.bfloat16), pde_type="diffusion", steps=16, alpha=0.3)
    # only the final rounding to bf16 differs
    assert torch.allclose(y.float(), ref, atol=0, rtol=2**-8)


# --------------------------------------------------------------------------------------------------------------
# Closed forms: Fourier modes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0.3, 1.1, 2.5, math.pi])
@pytest.mark.parametrize("steps", [1, 3, 8])
def test_bidirectional_fourier_mode_decays_by_amplification_factor(k, steps):
    a, n = 0.3, 200
    i = torch.arange(n, dtype=torch.float64)
    u = torch.cos(k * i + 0.4).reshape(1, n, 1)
    out = pde_refine_reference(u, pde_type="diffusion", steps=steps, alpha=a).flatten()
    g = 1 - 4 * a * math.sin(k / 2) ** 2
    inner = slice(steps, n - steps)  # positions that never see a wall
    assert torch.allclose(out[inner], (g**steps) * u.flatten()[inner], atol=1e-12)


@pytest.mark.parametrize("k", [0.3, 1.1, 2.5, math.pi])
def test_causal_fourier_mode_decays_by_amplification_factor(k):
    a, n, steps = 0.4, 200, 5
    i = torch.arange(n, dtype=torch.float64)
    g = (1 - a + a * complex(math.cos(k), -math.sin(k))) ** steps  # 1 - a + a e^{-ik}
    u = torch.cos(k * i).reshape(1, n, 1)
    out = pde_refine_reference(u, pde_type="diffusion", steps=steps, alpha=a, causal=True).flatten()
    expected = torch.tensor([(g * complex(math.cos(k * j), math.sin(k * j))).real for j in range(n)], dtype=torch.float64)
    assert abs(g) <= 1 + 1e-12
    assert torch.allclose(out[steps:], expected[steps:], atol=1e-12)


# --------------------------------------------------------------------------------------------------------------
# Stability at the largest coefficients the parametrisation can produce
# --------------------------------------------------------------------------------------------------------------


def _extreme_modules(pde_type, causal, channels):
    """Modules whose raw parameters sit far outside the bounds, so the projection yields the extreme values."""
    (a_low, a_high), beta_bounds = COEFFICIENT_BOUNDS[(pde_type, causal)]
    modules = []
    beta_values = [None] if beta_bounds is None else [1e6, -1e6]
    for raw_alpha in (1e6, 0.1):
        for raw_beta in beta_values:
            module = PDERefinement(channels, pde_type=pde_type, steps=1, causal=causal, alpha=raw_alpha,
                                   beta=raw_beta, backend="torch")
            modules.append(module)
    return modules


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pde_type", PDE_TYPES)
@pytest.mark.parametrize("signal", ["white_noise", "alternating"])
def test_no_growth_over_64_steps(pde_type, causal, signal):
    torch.manual_seed(0)
    seq, channels = 97, 6
    if signal == "white_noise":
        x = torch.randn(3, seq, channels, dtype=torch.float64)
    else:
        x = ((-1.0) ** torch.arange(seq, dtype=torch.float64)).reshape(1, seq, 1).expand(3, seq, channels).clone()
    mask = torch.ones(3, seq)
    mask[1, :10] = 0  # a left-padded row
    mask[2, -13:] = 0  # a right-padded row
    for module in _extreme_modules(pde_type, causal, channels):
        alpha, beta = (c.detach().double() if c is not None else None for c in module.coefficients())
        for attention_mask in (None, mask):
            norm0 = x.norm(dim=(1, 2))
            # Norm after every step count 1..64 (the wave carries a velocity, so each count is a fresh run).
            for steps in range(1, 65):
                out = pde_refine_reference(x, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, causal=causal,
                                           attention_mask=attention_mask)
                assert bool((out.norm(dim=(1, 2)) <= norm0 * (1 + 1e-9)).all()), (steps, alpha, beta)


def test_authors_causal_stencil_would_grow():
    """The reason for our causal stencil: u_i += a (u_i - 2u_{i-1} + u_{i-2}) amplifies the alternating mode."""
    u = (-1.0) ** torch.arange(64, dtype=torch.float64)
    for _ in range(16):
        left1 = torch.cat([u[:1], u[:-1]])
        left2 = torch.cat([u[:2], u[:-2]])
        u = u + 0.1 * (u - 2 * left1 + left2)
    assert u.norm() > 100 * math.sqrt(64)
    ours = pde_refine_reference(((-1.0) ** torch.arange(64.0)).reshape(1, 64, 1), pde_type="diffusion", steps=16,
                                alpha=0.1, causal=True)
    assert ours.norm() <= math.sqrt(64)


# --------------------------------------------------------------------------------------------------------------
# Causality, padding walls, streaming
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pde_type", PDE_TYPES)
def test_causal_depends_only_on_the_past(pde_type):
    torch.manual_seed(1)
    x = torch.randn(2, 40, 4)
    for t in (0, 7, 38):
        y = x.clone()
        y[:, t + 1 :] = torch.randn_like(y[:, t + 1 :])
        a = pde_refine_reference(x, pde_type=pde_type, steps=8, alpha=0.1, beta=0.2, causal=True)
        b = pde_refine_reference(y, pde_type=pde_type, steps=8, alpha=0.1, beta=0.2, causal=True)
        assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    # and the bidirectional operator does read the future (the test above is not vacuous)
    a = pde_refine_reference(x, pde_type=pde_type, steps=2, alpha=0.1, beta=0.2)
    y = x.clone()
    y[:, 20:] += 1
    b = pde_refine_reference(y, pde_type=pde_type, steps=2, alpha=0.1, beta=0.2)
    assert not torch.equal(a[:, 19], b[:, 19])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pde_type", PDE_TYPES)
def test_padding_is_a_wall(pde_type, causal):
    torch.manual_seed(2)
    seq = torch.randn(1, 9, 3)
    garbage = torch.randn(1, 4, 3) * 100
    alone = pde_refine_reference(seq, pde_type=pde_type, steps=4, alpha=0.12, beta=0.1, causal=causal)
    left = torch.cat([garbage, seq], 1)
    right = torch.cat([seq, garbage], 1)
    mask_left = torch.cat([torch.zeros(1, 4), torch.ones(1, 9)], 1)
    mask_right = torch.cat([torch.ones(1, 9), torch.zeros(1, 4)], 1)
    out_left = pde_refine_reference(left, pde_type=pde_type, steps=4, alpha=0.12, beta=0.1, causal=causal,
                                    attention_mask=mask_left)
    out_right = pde_refine_reference(right, pde_type=pde_type, steps=4, alpha=0.12, beta=0.1, causal=causal,
                                     attention_mask=mask_right)
    assert torch.allclose(out_left[:, 4:], alone, atol=1e-6)
    assert torch.allclose(out_right[:, :9], alone, atol=1e-6)
    assert torch.equal(out_left[:, :4], garbage) and torch.equal(out_right[:, 9:], garbage)


@pytest.mark.parametrize("pde_type", PDE_TYPES)
def test_streaming_state_chunked_and_decode_equal_full(pde_type):
    torch.manual_seed(3)
    x = torch.randn(2, 17, 5)
    full = pde_refine_reference(x, pde_type=pde_type, steps=3, alpha=0.1, beta=0.2, causal=True)
    first, state = pde_refine_reference(x[:, :6], pde_type=pde_type, steps=3, alpha=0.1, beta=0.2, causal=True,
                                        return_final_state=True)
    second, state = pde_refine_reference(x[:, 6:12], pde_type=pde_type, steps=3, alpha=0.1, beta=0.2, causal=True,
                                         initial_state=state, return_final_state=True)
    outs = [first, second]
    for t in range(12, 17):
        outs.append(pde_decode_step_reference(x[:, t], state, pde_type=pde_type, steps=3, alpha=0.1, beta=0.2)[:, None])
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-6)


def test_per_channel_coefficients_act_per_channel():
    torch.manual_seed(4)
    x = torch.randn(2, 11, 3)
    alpha = torch.tensor([0.0, 0.2, 0.4])
    out = pde_refine_reference(x, pde_type="diffusion", steps=2, alpha=alpha)
    for c in range(3):
        ref = pde_refine_reference(x[..., c : c + 1], pde_type="diffusion", steps=2, alpha=float(alpha[c]))
        assert torch.allclose(out[..., c : c + 1], ref, atol=1e-6)
    assert torch.equal(out[..., 0], x[..., 0])


def test_module_gradients_reach_coefficients_and_projection_is_exact():
    module = PDERefinement(4, pde_type="advection_diffusion", steps=3, alpha=0.1, beta=0.1, per_channel=True)
    x = torch.randn(2, 9, 4, requires_grad=True)
    module(x).square().sum().backward()
    assert module.alpha.grad is not None and module.alpha.grad.abs().sum() > 0
    assert module.beta.grad is not None and module.beta.grad.abs().sum() > 0
    with torch.no_grad():
        module.alpha.fill_(10.0)
    alpha, _ = module.coefficients()
    assert torch.all(alpha == COEFFICIENT_BOUNDS[("advection_diffusion", False)][0][1])
    identity = PDERefinement(4, pde_type="diffusion", steps=5, alpha=0.0)
    assert torch.equal(identity(x), x)


# --------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(pde_type="heat_equation"), "pde_type"),
        (dict(steps=-1), "steps"),
        (dict(steps=1.5), "steps"),
        (dict(alpha=torch.ones(3)), "alpha"),
        (dict(attention_mask=torch.ones(2, 5)), "attention_mask"),
        (dict(backend="cuda"), "backend"),
        (dict(pde_type="advection_diffusion", beta=None), "beta"),
        (dict(initial_state=torch.zeros(2, 1, 4)), "initial_state"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    args = dict(pde_type="diffusion", steps=1, alpha=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        pde_refine(torch.randn(2, 6, 4), **args)


def test_bad_hidden_states_shape():
    with pytest.raises(ValueError, match="hidden_states"):
        pde_refine(torch.randn(6, 4), pde_type="diffusion", steps=1, alpha=0.1)
    with pytest.raises(ValueError, match="pde_type"):
        PDERefinement(4, pde_type="nope")


def test_entry_points_share_one_signature():
    # The operator's two entry points and their references each spell out their keyword-only parameters (a shared
    # declaration would hide them from the `def`): they must not drift apart. The entry points add the backend and
    # the bounds a module's raw coefficients are projected onto (the decode reference takes the bounds too).
    import inspect

    def parameters(function, extra=("backend", "coefficient_bounds", "out")):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()
                if p.name not in extra]

    assert parameters(pde_refine) == parameters(pde_refine_reference)
    assert parameters(pde_cta.pde_decode_update) == parameters(pde_decode_step_reference)
    for entry_point in (pde_refine, pde_cta.pde_decode_update):
        assert [name for name in inspect.signature(entry_point).parameters][-3:] == \
            ["backend", "coefficient_bounds", "out"]


@pytest.mark.parametrize("pde_type", PDE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_receives_what_each_entry_point_returns(pde_type, dtype):
    """``out=`` (a serving engine's output buffer) holds exactly the result without it, on every CPU path (the
    banded filter, the reference, the C++ decode kernel with and without state rows), and is what is returned."""
    generator = torch.Generator().manual_seed(PDE_TYPES.index(pde_type))
    beta = 0.05 if pde_cta.uses_beta(pde_type) else None
    x = torch.randn(2, 9, 8, generator=generator).to(dtype)
    for initial, causal in ((None, False), (None, True), (torch.randn(2, 3, 8, generator=generator), True)):
        arguments = dict(pde_type=pde_type, steps=3, alpha=0.1, beta=beta, causal=causal, initial_state=initial,
                         return_final_state=causal)
        expected = pde_refine(x, **arguments)
        out = torch.full_like(x, float("nan"))
        got = pde_refine(x, out=out, **arguments)
        assert (got[0] if causal else got) is out
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    table = torch.randn(5, 3, 8, generator=generator)
    for indices in (None, torch.tensor([4, 1])):
        state = table[:2].clone() if indices is None else table.clone()
        token = x[:, 0]
        expected = pde_cta.pde_decode_update(token, state.clone(), pde_type=pde_type, steps=3, alpha=0.1, beta=beta,
                                             state_indices=indices)
        out = torch.full_like(token, float("nan"))
        got = pde_cta.pde_decode_update(token, state, pde_type=pde_type, steps=3, alpha=0.1, beta=beta,
                                        state_indices=indices, out=out)
        assert got is out
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_a_bad_out_is_refused_naming_it():
    x = torch.randn(2, 6, 4)
    arguments = dict(pde_type="diffusion", steps=1, alpha=0.1, causal=True)
    for out in (torch.empty(2, 5, 4), torch.empty(2, 6, 4, dtype=torch.float64), x, x[:, :]):
        with pytest.raises(ValueError, match="`out`"):
            pde_refine(x, out=out, **arguments)
    with pytest.raises(ValueError, match="`out` is for inference"):
        pde_refine(x.requires_grad_(), out=torch.empty(2, 6, 4), **arguments)
    with pytest.raises(ValueError, match="`out`"):
        pde_cta.pde_decode_update(x[:, 0].detach(), torch.zeros(2, 1, 4), pde_type="diffusion", steps=1, alpha=0.1,
                                  out=torch.empty(3, 4))


def test_old_decode_name_warns_and_forwards():
    state, x = torch.zeros(2, 3, 4), torch.randn(2, 4)
    expected = pde_cta.pde_decode_update(x, state.clone(), pde_type="diffusion", steps=3, alpha=0.1)
    with pytest.warns(FutureWarning, match="pde_decode_update"):
        got = pde_cta.pde_decode_step(x, state, pde_type="diffusion", steps=3, alpha=0.1)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pde_type", PDE_TYPES)
def test_float_coefficient_outside_its_stable_interval_raises(pde_type, causal):
    """A Python-number coefficient just outside its interval raises, naming the argument, the scheme and the interval
    (the interval read from COEFFICIENT_BOUNDS, not from the message's code); just inside, it runs and stays bounded."""
    x = torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    alpha_bounds, beta_bounds = COEFFICIENT_BOUNDS[(pde_type, causal)]
    inside = dict(alpha=alpha_bounds[1], beta=beta_bounds[1] if beta_bounds else None)
    out = pde_refine(x, pde_type=pde_type, steps=64, causal=causal, backend="torch", **inside)
    assert out.isfinite().all() and out.abs().max() <= 10 * x.abs().max()  # (the bounds themselves: tests above)
    cases = [("alpha", alpha_bounds, alpha_bounds[1] + 1e-3), ("alpha", alpha_bounds, alpha_bounds[0] - 1e-3),
             ("alpha", alpha_bounds, float("nan"))]
    if beta_bounds is not None:
        cases += [("beta", beta_bounds, beta_bounds[1] + 1e-3), ("beta", beta_bounds, beta_bounds[0] - 1e-3)]
    scheme = f"{'causal' if causal else 'bidirectional'} {pde_type}"
    for name, (low, high), value in cases:
        kwargs = dict(inside, **{name: value})
        for fn in (pde_refine, pde_refine_reference):
            with pytest.raises(ValueError) as error:
                fn(x, pde_type=pde_type, steps=4, causal=causal, **kwargs)
            message = str(error.value)
            assert f"`{name}`" in message and scheme in message and f"[{low}, {high}]" in message, message
        if causal:  # the one-token decode step shares the check
            state = torch.zeros(2, 4, 4, dtype=torch.float32)
            with pytest.raises(ValueError, match=f"`{name}`"):
                pde_decode_step_reference(x[:, 0].float(), state, pde_type=pde_type, steps=4, **kwargs)


def test_issue_examples_and_integer_coefficients():
    u = torch.randn(2, 32, 8)
    for alpha in (0.9, 2.0, 1):  # 0.9 gave 2.5e26 and 2.0 NaN before the check; an int is a Python number too
        with pytest.raises(ValueError, match=r"`alpha`=.*\[0\.0, 0\.5\].*diffusion"):
            pde_refine(u, pde_type="diffusion", steps=64, alpha=alpha)
    assert torch.equal(pde_refine(u, pde_type="diffusion", steps=3, alpha=0), u)  # int 0: inside, the identity


def test_tensor_coefficients_are_checked_for_shape_and_dtype_not_range():
    x = torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match="alpha.*floating point"):
        pde_refine(x, pde_type="diffusion", steps=1, alpha=torch.tensor(1))
    with pytest.raises(ValueError, match=r"beta.*\[channels\] = \[4\]"):
        pde_refine(x, pde_type="reaction_diffusion", steps=1, alpha=0.1, beta=torch.zeros(3))
    # Values are not read (a host-device sync): an out-of-range tensor runs, as the docstring says.
    assert pde_refine(x, pde_type="diffusion", steps=1, alpha=torch.tensor(0.9)).shape == x.shape
    assert "not range-checked" in " ".join(pde_refine.__doc__.split())


def test_triton_backend_names_the_missing_requirement(monkeypatch):
    x = torch.randn(2, 8, 4)
    module, missing = pde_cta._triton_lookup()
    if missing is not None:  # this machine lacks Triton or CUDA (conftest turns the interpreter on where it can)
        with pytest.raises(ValueError, match="Triton is not installed|no CUDA device") as error:
            pde_refine(x, pde_type="diffusion", steps=1, alpha=0.1, backend="triton")
        assert "cannot be imported" not in str(error.value)
    # Every requirement in turn, with the cached lookup replaced (it is looked up once per process).
    fake = type("FakeTritonModule", (), {"INTERPRET": False})()
    for lookup, tensor, message in [
        ((None, "Triton is not installed (`pip install triton`)"), x, "Triton is not installed"),
        ((None, "there is no CUDA device (torch.cuda.is_available() is False)"), x, "no CUDA device"),
        ((fake, None), x, "is on cpu.*TRITON_INTERPRET"),
    ]:
        monkeypatch.setattr(pde_cta, "_triton_lookup", lambda lookup=lookup: lookup)
        with pytest.raises(ValueError, match=message):
            pde_refine(tensor, pde_type="diffusion", steps=1, alpha=0.1, backend="triton")
    fake.INTERPRET = True
    monkeypatch.setattr(pde_cta, "_triton_lookup", lambda: (fake, None))
    assert pde_cta.triton_missing_requirement(x) is None
    with pytest.raises(ValueError, match="float8_e4m3fn.*Triton backend takes"):
        pde_refine(x.to(torch.float8_e4m3fn), pde_type="diffusion", steps=1, alpha=0.1, backend="triton")


@pytest.mark.parametrize("pde_type", PDE_TYPES)
def test_state_history_holds_the_final_state_of_every_prefix(pde_type):
    """What a rolled-back cache keeps: column p of the history is the final state of the tokens up to p."""
    from cta.pde_reference import causal_state_history, pde_refine_reference

    g = torch.Generator().manual_seed(3)
    u, initial = torch.randn(2, 7, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    mask = torch.ones(2, 7)
    mask[1, :2] = 0
    beta = 0.2 if pde_type in ("reaction_diffusion", "advection_diffusion") else None
    kwargs = dict(pde_type=pde_type, steps=3, alpha=0.1, beta=beta)
    out, states = causal_state_history(u, attention_mask=mask, initial_state=initial, **kwargs)
    assert states.shape == (2, 3, 5, 7)
    torch.testing.assert_close(out, pde_refine_reference(u, causal=True, attention_mask=mask, initial_state=initial,
                                                         **kwargs))
    for p in range(7):
        _, final = pde_refine_reference(u[:, :p + 1], causal=True, attention_mask=mask[:, :p + 1],
                                        initial_state=initial, return_final_state=True, **kwargs)
        torch.testing.assert_close(states[..., p], final)
