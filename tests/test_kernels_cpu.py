"""The CPU decode kernel (cta/kernels_cpu.py, what ``pde_decode_update`` runs for an eager CPU decode) against the torch
ops of the same step (``backend="torch"``, the path the reference tests check) and the reference decode step: every
scheme, scalar and per-channel coefficients, fp32 / fp64 states, bf16 tokens, padding, a state table with indices,
a cache's level buffers, a strided state; its refusals; the torch path where it is off or cannot build."""

import logging

import pytest
import torch

import cta.kernels_cpu as kernels_cpu
from cta.pde_cta import choose_backend, coefficient_bounds, pde_decode_step_reference, pde_decode_update

TYPES = ["diffusion", "wave", "reaction_diffusion", "advection_diffusion"]

pytestmark = pytest.mark.skipif(kernels_cpu.kernel() is None,
                                reason="the CPU decode kernel does not build here (no C++ compiler)")


def _operator(pde_type, channels, per_channel, dtype, generator):
    bounds = coefficient_bounds(pde_type, True)
    shape = (channels,) if per_channel else (1,)
    # (values beyond the bounds too: the kernel projects them, as the torch step does)
    alpha = (torch.rand(shape, generator=generator, dtype=torch.float64) * 0.8 - 0.1).to(dtype)
    beta = None if bounds[1] is None else (torch.rand(shape, generator=generator, dtype=torch.float64) * 0.8
                                           - 0.2).to(dtype)
    return dict(pde_type=pde_type, steps=3, alpha=alpha, beta=beta, coefficient_bounds=bounds)


def _tolerance(dtype):
    return dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=0, atol=2e-6)


@pytest.mark.parametrize("pde_type", TYPES)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("state_dtype,token_dtype", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                                     (torch.float32, torch.bfloat16)])
def test_kernel_equals_the_torch_step(pde_type, per_channel, state_dtype, token_dtype):
    generator = torch.Generator().manual_seed(0)
    batch, channels = 5, 37  # (37: a vector tail on every ISA)
    operator = _operator(pde_type, channels, per_channel, state_dtype, generator)
    tokens = torch.randn(batch, channels, generator=generator).to(token_dtype)
    mask = torch.tensor([1, 0, 1, 1, 0])
    state = torch.randn(batch, 3, channels, generator=generator, dtype=state_dtype)
    cases = {  # name -> (hidden, state made from `state`, how to read the state back)
        "tensor": (tokens, lambda s: s.clone(), lambda s: s),
        "block [b, steps, channels, 1]": (tokens[:, None], lambda s: s.clone()[..., None], lambda s: s[..., 0]),
        "level buffers": (tokens[:, None], lambda s: [lv.clone() for lv in s.unsqueeze(-1).split(1, dim=1)],
                          lambda s: torch.cat([lv[..., 0] for lv in s], dim=1)),
        "strided channels": (tokens, lambda s: s.transpose(1, 2).contiguous().transpose(1, 2), lambda s: s),
    }
    for name, (hidden, make, read) in cases.items():
        for token_mask in (None, mask):
            kernel_state, torch_state = make(state), make(state)
            assert choose_backend("auto", hidden, 3, kernel_state, pde_type) == "cpu"
            got = pde_decode_update(hidden, kernel_state, token_mask=token_mask, **operator)
            want = pde_decode_update(hidden, torch_state, token_mask=token_mask, backend="torch", **operator)
            assert got.dtype == hidden.dtype and got.shape == hidden.shape, name
            torch.testing.assert_close(got.double(), want.double(), **_tolerance(state_dtype), msg=name)
            torch.testing.assert_close(read(kernel_state), read(torch_state), **_tolerance(state_dtype), msg=name)
            if token_mask is not None:  # padding: unchanged, a wall as its state
                assert torch.equal(got[1], hidden[1]) and not read(kernel_state)[1].any()


@pytest.mark.parametrize("pde_type", TYPES)
def test_kernel_with_state_indices_equals_the_reference_step(pde_type):
    """A state table with rows of other sequences (a serving engine's): only the named rows change, each as the
    reference's decode step on that sequence alone."""
    generator = torch.Generator().manual_seed(1)
    channels, rows = 64, 9
    operator = _operator(pde_type, channels, True, torch.float32, generator)
    table = torch.randn(rows, 3, channels, generator=generator)
    indices = torch.tensor([7, 2, 4], dtype=torch.int32)
    tokens = torch.randn(3, channels, generator=generator)
    before = table.clone()
    got = pde_decode_update(tokens, table, state_indices=indices, **operator)
    alpha, beta = (None if c is None else c.clamp(*b) for c, b in zip((operator["alpha"], operator["beta"]),
                                                                           operator["coefficient_bounds"]))
    for row, slot in enumerate(indices.tolist()):
        state = before[slot:slot + 1].clone()
        want = pde_decode_step_reference(tokens[row:row + 1], state, pde_type=pde_type, steps=3, alpha=alpha,
                                         beta=beta)
        torch.testing.assert_close(got[row:row + 1], want, rtol=0, atol=2e-6)
        torch.testing.assert_close(table[slot:slot + 1], state, rtol=0, atol=2e-6)
    untouched = [r for r in range(rows) if r not in indices.tolist()]
    assert torch.equal(table[untouched], before[untouched])


def test_kernel_refuses_what_it_cannot_read():
    table, tokens = torch.zeros(4, 2, 8), torch.zeros(2, 8)
    operator = dict(pde_type="diffusion", steps=2, alpha=0.1)
    with pytest.raises(RuntimeError, match="state_indices: entry 1 is 4, outside the state's 4 rows"):
        pde_decode_update(tokens, table, state_indices=torch.tensor([0, 4]), **operator)
    with pytest.raises(ValueError, match="`state_indices` must be 2 integers"):
        pde_decode_update(tokens, table, state_indices=torch.tensor([0.0, 1.0]), **operator)
    with pytest.raises(ValueError, match=r"With `state_indices`, `state` must be a table \[rows, steps, channels\]"):
        pde_decode_update(tokens, [table[:, :1], table[:, 1:]], state_indices=torch.tensor([0, 1]), **operator)


def test_off_switch_and_a_failed_build_leave_the_torch_step(monkeypatch, caplog):
    tokens, state = torch.randn(2, 8), torch.randn(2, 2, 8)
    monkeypatch.setenv(kernels_cpu.ENV_SWITCH, "0")
    kernels_cpu._kernel.cache_clear()  # (the switch is read once per process)
    assert choose_backend("auto", tokens, 2, state) == "torch"
    monkeypatch.delenv(kernels_cpu.ENV_SWITCH)
    kernels_cpu._kernel.cache_clear()
    assert choose_backend("auto", tokens, 2, state) == "cpu"
    assert choose_backend("torch", tokens, 2, state) == "torch"

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: no compiler")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    kernels_cpu._kernel.cache_clear()
    kernels_cpu._build.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cta.kernels_cpu"):
            assert choose_backend("auto", tokens, 2, state) == "torch"
            assert choose_backend("auto", tokens, 2, state) == "torch"
        warnings = [r for r in caplog.records if "did not build" in r.getMessage()]
        assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()
        want = pde_decode_update(tokens, state.clone(), pde_type="diffusion", steps=2, alpha=0.2, backend="torch")
        assert torch.equal(pde_decode_update(tokens, state.clone(), pde_type="diffusion", steps=2, alpha=0.2), want)
    finally:
        kernels_cpu._kernel.cache_clear()
        kernels_cpu._build.cache_clear()


def test_the_kernel_covers_every_scheme_it_can_write():
    """Each registered scheme has its step in the source (a reaction in u, b and tanh(u), the tanh computed by ATen once
    per level); a reaction the kernel cannot write in C++ leaves that scheme on the torch ops."""
    source = kernels_cpu.cpp_source()
    assert source.count("struct Scheme") == len(TYPES) and "reads_tanh = true" in source
    assert kernels_cpu.cpp_reaction("-b * tanh(u)") == "((-b) * f)"
    assert kernels_cpu.cpp_reaction("b * u * (1 - u)") == "((b * u) * (T(1.0) - u))"
    for unwritten in ("b * sin(u)", "b * tanh(2 * u)", "b ** 2", "u[0]"):
        assert kernels_cpu.cpp_reaction(unwritten) is None, unwritten
    tokens, state = torch.randn(2, 8), torch.randn(2, 2, 8)
    assert [choose_backend("auto", tokens, 2, state, t) for t in TYPES] == ["cpu"] * len(TYPES)
