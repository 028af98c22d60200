"""The CPU filter path of ``pde_refine`` (cta/pde_filters.py): the constant-coefficient causal schemes as one banded
filter (the C++ kernel's single pass, or torch ops where it is off), taken where no gradient is asked, equal the
readable reference; where a gradient is asked, the reference
runs."""

from unittest import mock

import pytest
import torch

import cta.pde_cta as operator
import cta.pde_filters as filters
from cta.pde_cta import pde_refine, pde_refine_reference

STEPS = 4


@pytest.mark.parametrize("pde_type,beta", [("diffusion", None), ("advection_diffusion", 0.2)])
@pytest.mark.parametrize("length", [1, STEPS - 1, STEPS, STEPS + 1, 37])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu kernel", "torch ops"])
def test_the_banded_filter_equals_the_reference(pde_type, beta, length, with_state, cpu_kernel, monkeypatch):
    if not cpu_kernel:
        monkeypatch.setattr(filters, "cpu_kernel", lambda: None)
    elif filters.cpu_kernel() is None:
        pytest.skip("the CPU kernel does not build here (no C++ compiler)")
    generator = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, 16, generator=generator, dtype=torch.float64).to(torch.float32)
    state = torch.randn(2, STEPS, 16, generator=generator) if with_state else None
    arguments = dict(pde_type=pde_type, steps=STEPS, alpha=0.13, beta=beta, causal=True, initial_state=state,
                     return_final_state=True)
    with mock.patch.object(operator, "filtered_refine", wraps=operator.filtered_refine) as banded:
        out, final = pde_refine(x, **arguments)
    assert banded.call_count == 1
    expected_out, expected_final = pde_refine_reference(x, **arguments)
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(final, expected_final, atol=1e-6, rtol=1e-6)


def test_a_gradient_takes_the_reference():
    x = torch.randn(1, 9, 8, requires_grad=True)
    with mock.patch.object(operator, "filtered_refine", wraps=operator.filtered_refine) as banded:
        out = pde_refine(x, pde_type="diffusion", steps=2, alpha=0.2, causal=True)
    assert banded.call_count == 0
    out.sum().backward()
    assert x.grad is not None

