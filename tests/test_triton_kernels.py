"""Parity of the Triton kernels (cta/triton_cta.py, cta/kernels_*.py) with the PyTorch reference (cta/pde_reference.py).

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` is set by tests/triton_testing.py, before triton is
imported), on a small sample of the shape / option cross product so that this file stays around a minute on 2 cores
(the streaming kernels walk the sequence row by row, which the interpreter executes op by op); ``CTA_RUN_SLOW=1``
runs the larger sample (100 cases, sequences up to 1000, 16 steps) and more hypothesis examples. Tests marked ``gpu``
run the full cross product (and bf16/fp16, larger shapes) on CUDA and skip without it. In the interpreter every launch
runs short programs (16 rows, 16 channels; ``kernels_config.INTERPRETER_CONFIG``), so small shapes cross program
boundaries as long GPU inputs do. The cross product's channel counts (1, 60, 129) never fill whole channel blocks,
which the banded filters need (interior programs and sequence ends, register and tensor-core), so those have their
own tests below (multiples of 16 channels, no padding), a randomised one among them.

Tolerances (``torch.testing.assert_close``, relative to the reference computed from the same input):
* fp32 outputs and input gradients: rtol=1e-4, atol=1e-5 (the kernel does the same fp32 operations; only the
  summation order of the backward differs).
* coefficient gradients (sums over batch x seq [x channels] terms, accumulated per tile then summed):
  rtol=1e-4, atol=1e-4 * (1 + number of summed terms) ** 0.5 -- random-walk growth of fp32 rounding.
* bf16 / fp16 outputs: rtol=1.6e-2 / 1e-3 (one rounding of the same fp32 value can differ by one ulp), atol=1e-2 /
  1e-3; gradients are compared in fp32 with rtol=2e-2.
"""

import contextlib
import itertools
import os
import random

import numpy as np

from triton_testing import DEVICE, ON_GPU, gpu, needs_kernels  # (first: sets up Triton's interpreter before triton is imported)

import pytest
import torch

triton = pytest.importorskip("triton")

from cta.pde_cta import (PDE_TYPES, pde_decode_step_reference, pde_decode_update, pde_refine,  # noqa: E402
                         pde_refine_reference)
from cta.pde_spec import PDE_IDS  # noqa: E402
from cta.triton_cta import is_available  # noqa: E402


def pde_refine_triton(*args, **kwargs):
    """The operator's entry point, the Triton backend asked for (raises where it cannot run)."""
    return pde_refine(*args, backend="triton", **kwargs)


def pde_decode_step_triton(*args, **kwargs):
    return pde_decode_update(*args, backend="triton", **kwargs)


RUN_SLOW = bool(os.environ.get("CTA_RUN_SLOW"))
slow = pytest.mark.skipif(not RUN_SLOW, reason="slow: set CTA_RUN_SLOW=1")

SEQS = (1, 2, 3, 5, 63, 130, 1000)
CHANNELS = (1, 60, 129)
STEPS = (0, 1, 2, 3, 4, 8, 16)
PADDINGS = ("none", "left", "right")


def _coefficients(pde, causal, channels, per_channel, gen, device):
    """Random coefficients inside the stable bounds (bidirectional advection gets both signs)."""
    shape = (channels,) if per_channel else ()
    alpha = (0.02 + 0.2 * torch.rand(shape, generator=gen)).to(device)
    beta = None
    if pde in ("reaction_diffusion", "advection_diffusion"):
        beta = 0.3 * torch.rand(shape, generator=gen)
        if pde == "advection_diffusion" and not causal:
            beta = beta - 0.15
        beta = beta.to(device)
    return alpha, beta


def _mask(batch, seq, padding, gen, device):
    if padding == "none" or seq < 2:
        return None
    mask = torch.ones(batch, seq)
    for b in range(batch):
        n = int(torch.randint(1, seq, (1,), generator=gen))  # at least one padded and one real token... per row
        if b == 0:
            n = 0  # one unpadded row in the batch
        if padding == "left":
            mask[b, :n] = 0
        else:
            mask[b, seq - n :] = 0
    return mask.to(device)


def _run(fn, x, alpha, beta, grad_out, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    a = alpha.detach().clone().requires_grad_(True)
    b = beta.detach().clone().requires_grad_(True) if beta is not None else None
    y = fn(x, alpha=a, beta=b, **kwargs)
    if kwargs.get("return_final_state"):
        y, state = y
    else:
        state = None
    (y.float() * grad_out).sum().backward()
    return y.detach(), x.grad, a.grad, (b.grad if b is not None else None), state


def check_parity(pde, causal, seq, channels, steps, padding, per_channel, *, batch=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, channels, generator=gen).to(DEVICE, dtype)
    alpha, beta = _coefficients(pde, causal, channels, per_channel, gen, DEVICE)
    mask = _mask(batch, seq, padding, gen, DEVICE)
    grad_out = torch.randn(batch, seq, channels, generator=gen).to(DEVICE)
    kwargs = dict(pde_type=pde, steps=steps, causal=causal, attention_mask=mask)
    ref = _run(pde_refine_reference, x, alpha, beta, grad_out, **kwargs)
    out = _run(pde_refine_triton, x, alpha, beta, grad_out, **kwargs)
    if dtype == torch.float32:
        torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-5)
        terms = batch * seq * (1 if per_channel else channels)
        coef_atol = 1e-4 * (1 + terms) ** 0.5
    else:
        low = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(out[0], ref[0], **low)
        torch.testing.assert_close(out[1].float(), ref[1].float(), rtol=2e-2, atol=2e-2)
        terms = batch * seq * (1 if per_channel else channels)
        coef_atol = 2e-2 * (1 + terms) ** 0.5
    for got, want in ((out[2], ref[2]), (out[3], ref[3])):
        if want is None:  # steps == 0 (or no beta): the coefficient is unused
            assert got is None or not got.any()
            continue
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-4 if dtype == torch.float32 else 2e-2,
                                   atol=coef_atol)
    assert torch.isfinite(out[0]).all()


def _all_cases():
    return list(itertools.product(PDE_TYPES, (False, True), SEQS, CHANNELS, STEPS, PADDINGS, (False, True)))


def _sampled_cases(n=100, seed=1234):
    """A fixed sample of the cross product that still covers every value of every axis (CPU interpreter budget)."""
    rng = random.Random(seed)
    cases = []
    # every pde x causal x per_channel combination once, with rotating seq / channels / steps / padding
    for i, (pde, causal, per_channel) in enumerate(itertools.product(PDE_TYPES, (False, True), (False, True))):
        cases.append((pde, causal, SEQS[i % 6], CHANNELS[i % 3], STEPS[1 + i % 6], PADDINGS[i % 3], per_channel))
    while len(cases) < n:
        seq = rng.choice(SEQS[:6]) if rng.random() < 0.9 else 1000
        cases.append((rng.choice(PDE_TYPES), rng.random() < 0.5, seq, rng.choice(CHANNELS), rng.choice(STEPS),
                      rng.choice(PADDINGS), rng.random() < 0.5))
    # the largest sequence and step count appear at least once per pde type
    for i, pde in enumerate(PDE_TYPES):
        cases.append((pde, bool(i % 2), 1000, 60, 16 if i < 2 else 8, PADDINGS[i % 3], bool(i % 2)))
    return cases


def _case_id(case):
    pde, causal, seq, channels, steps, padding, per_channel = case
    return f"{pde}-{'causal' if causal else 'bidi'}-L{seq}-C{channels}-S{steps}-{padding}-{'vec' if per_channel else 'scalar'}"


def _quick_cases():
    """Every pde x causal x per_channel combination once (short sequences, rotating steps / padding / channels)."""
    cases = []
    for i, (pde, causal, per_channel) in enumerate(itertools.product(PDE_TYPES, (False, True), (False, True))):
        cases.append((pde, causal, (5, 17, 33)[i % 3], CHANNELS[i % 3], (1, 2, 3, 4, 8)[i % 5], PADDINGS[i % 3],
                      per_channel))
    cases.append(("diffusion", False, 1, 3, 16, "none", True))
    cases.append(("wave", True, 2, 5, 16, "right", False))
    return cases


@needs_kernels
@pytest.mark.parametrize("case", _quick_cases(), ids=_case_id)
def test_parity_quick(case):
    check_parity(*case)


@needs_kernels
@slow
@pytest.mark.slow
@pytest.mark.parametrize("case", _sampled_cases(), ids=_case_id)
def test_parity_sampled(case):
    check_parity(*case)


@contextlib.contextmanager
def deterministic_algorithms(enabled):
    """``torch.use_deterministic_algorithms(enabled)`` within the block, restored after it."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _program_cases():
    """(pde, causal, seq, channels, steps, padding): every scheme over several programs per sequence, with whole
    channel blocks and no padding (interior programs filter, linear schemes, or run the walk's mask-free copy; the
    end programs filter on the walls' extension), with partial channel blocks or padding (the walk), and sequences
    shorter than the steps (bidirectional ends then walk)."""
    cases = []
    for pde in PDE_TYPES:
        for causal in (False, True):
            for seq, channels, steps, padding in [(64, 16, 3, "none"), (45, 32, 8, "none"), (29, 11, 2, "left"),
                                                  (37, 16, 4, "right"), (5, 16, 8, "none")]:
                cases.append(pytest.param(pde, causal, seq, channels, steps, padding,
                                          id=f"{pde}-{'causal' if causal else 'bidi'}-L{seq}-C{channels}-S{steps}-{padding}"))
    return cases


@needs_kernels
@pytest.mark.parametrize("pde,causal,seq,channels,steps,padding", _program_cases())
def test_programs_interior_ends_and_walk(pde, causal, seq, channels, steps, padding):
    """Outputs, input gradients and coefficient gradients (the per-program partial sums, atomics per channel) vs the
    reference, per-channel and scalar coefficients."""
    check_parity(pde, causal, seq, channels, steps, padding, True, batch=2, seed=steps)
    check_parity(pde, causal, seq, channels, steps, padding, False, batch=2, seed=steps + 1)


def _emitted_taps(causal, steps, c):
    """Runs the tap lines the filters' source generator writes (``kernels_source._fir_taps``) on the tensor ``c``."""
    from types import SimpleNamespace

    from cta import kernels_source

    w = kernels_source._Src()
    kernels_source._fir_taps(w, "tap", causal, steps, "c")
    scope = {"c": c, "tl": SimpleNamespace(fma=lambda a, b, acc: a * b + acc)}
    exec("\n".join(line.strip() for line in w.lines), scope)
    return torch.stack([torch.as_tensor(scope[f"tap{k}"], dtype=c.dtype).expand_as(c) for k in range(steps + 1)])


@pytest.mark.parametrize("causal", (False, True), ids=("bidi", "causal"))
def test_fir_taps_closed_form(causal):
    """The banded filter's taps in closed form equal the stencil convolved with itself ``steps`` times (the
    stencil's polynomial to that power, numpy in float64), for 0..16 steps and coefficients over the whole stable
    range, in float64 (to rounding) and float32 (every term is non-negative: a few ulps)."""
    c = torch.tensor([0.0, 0.02, 0.1, 0.25, 0.4, 0.5] + ([0.75, 1.0] if causal else []), dtype=torch.float64)
    for steps in range(17):
        # the stencil's polynomial to the power steps (numpy): coefficient i of (c + m z + c z^2)^steps is the tap
        # at offset i - steps; of (c + m z)^steps, the causal tap at offset -(steps - i)
        stencils = [[v, 1 - v] if causal else [v, 1 - 2 * v, v] for v in c.tolist()]
        size = (1 if causal else 2) * steps + 1
        powers = [np.polynomial.polynomial.polypow(stencil, steps) for stencil in stencils]
        powers = [np.pad(p, (0, size - len(p))) for p in powers]  # (polypow drops trailing zeros: c = 0)
        expected = torch.tensor(np.stack([p[::-1] if causal else p[steps:] for p in powers], axis=1))
        torch.testing.assert_close(_emitted_taps(causal, steps, c), expected, rtol=1e-12, atol=1e-15)
        closed32 = _emitted_taps(causal, steps, c.float())
        torch.testing.assert_close(closed32.double(), expected, rtol=4e-6, atol=1e-7)


def check_mma_parity(dtype, pde, causal, steps, shape, seed=0):
    """A 16-bit input with a scalar coefficient (interior tiles on tensor cores where ``kernels_config`` sends them:
    forwards from 3 steps, the bidirectional backward from 7) against the fp64 reference: outputs and input
    gradients within one rounding of the 16-bit result, the coefficient gradients to fp32 accuracy (the upstream
    gradient is 16-bit exact, so the reference sees the kernels' inputs)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    alpha = (0.02 + 0.2 * torch.rand((), generator=gen)).to(DEVICE)
    beta = (0.3 * torch.rand((), generator=gen)).to(DEVICE) if pde == "advection_diffusion" else None
    grad_out = torch.randn(shape, generator=gen).to(DEVICE, dtype).float()
    kwargs = dict(pde_type=pde, steps=steps, causal=causal)
    got = _run(pde_refine_triton, x, alpha, beta, grad_out, **kwargs)
    ref = _run(pde_refine_reference, x.double(), alpha.double(), beta.double() if beta is not None else None,
               grad_out.double(), **kwargs)
    one_rounding = dict(rtol=2 ** -7, atol=2 ** -7) if dtype == torch.bfloat16 else dict(rtol=2 ** -10, atol=2 ** -10)
    if dtype == torch.float16 or ON_GPU:  # (the interpreter truncates fp32 -> bf16 instead of rounding)
        # An fp32-accurate filter rounds to the same 16-bit value as the exact result except within ~1e-6 of a
        # rounding boundary; a filter whose taps kept only 16 bits would miss the exact rounding far more often.
        for a, b in ((got[0], ref[0]), (got[1], ref[1])):
            assert (a != b.to(dtype)).double().mean() < 0.01
    torch.testing.assert_close(got[0].double(), ref[0].double(), **one_rounding)
    torch.testing.assert_close(got[1].double(), ref[1].double(), **one_rounding)
    for a, b in zip(got[2:4], ref[2:4]):
        if b is not None:
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-3, atol=1e-3)


def _mma_cases():
    cases = []
    for pde, causal in [("diffusion", False), ("diffusion", True), ("advection_diffusion", True)]:
        for dtype, steps in ((torch.float16, 3), (torch.float16, 8), (torch.bfloat16, 7)):
            cases.append(pytest.param(dtype, pde, causal, steps, id=f"{str(dtype)[6:]}-{pde}-"
                                      f"{'causal' if causal else 'bidi'}-{steps}"))
    return cases


@needs_kernels
@pytest.mark.parametrize("dtype,pde,causal,steps", _mma_cases())
def test_mma_interior_path(dtype, pde, causal, steps):
    """Interior tiles on tensor cores (16-row MMA tiles, two input blocks each, filter matrices split into two 16-bit
    parts): a 137-row sequence has end programs (on the walls' extension, the last one partial) and MMA programs
    between them, and two channel blocks. The interpreter's bf16 ``tl.dot`` is broken, so there the same 16-bit
    operands are multiplied in fp32 (exact); the GPU test below runs the MMA instructions."""
    check_mma_parity(dtype, pde, causal, steps, (2, 137, 32), seed=steps)


@needs_kernels
def test_mma_walls_final_state():
    """A causal prefill that returns its final state (what a patched decoder caches) on the tensor-core filter: the
    first program filters its end (zeros before the first row), the last one walks and writes the state; output and
    state vs the fp64 reference, to one fp16 rounding."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 137, 32, generator=gen).to(DEVICE, torch.float16)
    kwargs = dict(pde_type="diffusion", steps=3, alpha=0.15, causal=True, return_final_state=True)
    out, state = pde_refine_triton(x, **kwargs)
    ref, ref_state = pde_refine_reference(x.double(), **kwargs)
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -10, atol=2 ** -10)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_streaming_state_across_programs():
    """Initial / final causal state across several programs (the state lives in the first / last one; with whole
    channel blocks (16) the other end programs filter, the ones the state reaches walk)."""
    gen = torch.Generator().manual_seed(9)
    for pde, channels, with_init, final in (("diffusion", 9, True, True), ("wave", 9, True, True),
                                             ("diffusion", 16, True, True), ("diffusion", 16, True, False),
                                             ("diffusion", 16, False, True)):
        x = torch.randn(2, 27, channels, generator=gen).to(DEVICE)
        init = torch.randn(2, 3, channels, generator=gen).to(DEVICE) if with_init else None
        kwargs = dict(pde_type=pde, steps=3, alpha=0.1, causal=True, initial_state=init, return_final_state=final)
        out, ref = pde_refine_triton(x, **kwargs), pde_refine_reference(x, **kwargs)
        if not final:
            out, ref = (out, None), (ref, None)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", _all_cases(), ids=_case_id)
def test_parity_full_product_gpu(case):
    check_parity(*case)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("pde", PDE_TYPES)
@pytest.mark.parametrize("causal", (False, True))
def test_parity_half_precision_gpu(dtype, pde, causal):
    check_parity(pde, causal, 1500, 257, 4, "left", True, batch=3, dtype=dtype)
    check_parity(pde, causal, 4097, 512, 8, "none", False, batch=1, dtype=dtype)



@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", (True, False), ids=("per_channel", "scalar"))
@pytest.mark.parametrize("deterministic", (False, True), ids=("atomics", "deterministic"))
@pytest.mark.parametrize("in_kernel", [True, False], ids=["in_kernel", "second_kernel"])
def test_coefficient_gradient_finish_on_large_grids_gpu(per_channel, deterministic, in_kernel, monkeypatch):
    """The backward's last program sums thousands of programs' partial sums on a real GPU, where programs run
    concurrently: every launch gives the fp64 reference's gradient, and under deterministic algorithms the same bits
    every time (a race between the counters and the partial sums would show as a wrong or varying gradient)."""
    from cta import kernels_launch
    from cta.kernels_launch import launch_backward

    monkeypatch.setattr(kernels_launch, "FINISH_MAX_ELEMENTS", 1 << 30 if in_kernel else 0)
    kernels_launch._backward_launch.cache_clear()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4096, 768, generator=gen).to(DEVICE)
    gy = torch.randn(4, 4096, 768, generator=gen).to(DEVICE)
    alpha = (torch.rand(768, generator=gen) * 0.2 if per_channel else torch.tensor([0.15])).to(DEVICE)
    a_ref = alpha.double().clone().requires_grad_(True)
    y = pde_refine_reference(x.double(), pde_type="diffusion", steps=4, alpha=a_ref, causal=True)
    (y * gy.double()).sum().backward()
    try:
        with deterministic_algorithms(deterministic):
            grads = [launch_backward(gy, x, alpha, None, None, None, "diffusion", 4, True)[1] for _ in range(20)]
    finally:
        kernels_launch._backward_launch.cache_clear()
    for got in grads:
        torch.testing.assert_close(got.double(), a_ref.grad, rtol=1e-4, atol=1e-2)
    if deterministic:
        assert all(torch.equal(got, grads[0]) for got in grads)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("pde,causal", [("diffusion", False), ("diffusion", True), ("advection_diffusion", True)])
@pytest.mark.parametrize("steps", range(1, 9))
def test_mma_interior_gpu(dtype, pde, causal, steps):
    """16-bit inputs with a scalar coefficient at every step count the tensor-core filter may take, with the default
    programs, on a GPU (MMA instructions where ``kernels_config`` sends them, the register filter elsewhere)."""
    check_mma_parity(dtype, pde, causal, steps, (2, 1037, 256), seed=steps)

@needs_kernels
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_half_precision_small(dtype):
    check_parity("reaction_diffusion", False, 37, 9, 3, "right", True, dtype=dtype)
    check_parity("diffusion", True, 37, 9, 4, "left", False, dtype=dtype)


@needs_kernels
def test_strided_input_and_fp64_fallback():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(40, 3, 24, generator=gen).to(DEVICE)
    x = base.transpose(0, 1)  # strided batch / seq, contiguous channels
    kwargs = dict(pde_type="advection_diffusion", steps=3, alpha=0.1, beta=-0.2)
    torch.testing.assert_close(pde_refine_triton(x, **kwargs), pde_refine_reference(x, **kwargs), rtol=1e-4, atol=1e-5)
    xt = torch.randn(2, 24, 17, generator=gen).to(DEVICE).transpose(1, 2)  # channels not contiguous
    torch.testing.assert_close(pde_refine_triton(xt, **kwargs), pde_refine_reference(xt, **kwargs), rtol=1e-4, atol=1e-5)
    x64 = torch.randn(2, 10, 3, generator=gen, dtype=torch.float64).to(DEVICE)
    out = pde_refine_triton(x64, **kwargs)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, pde_refine_reference(x64, **kwargs))


@needs_kernels
@pytest.mark.parametrize("pde", PDE_TYPES)
def test_streaming_chunked_equals_full(pde):
    gen = torch.Generator().manual_seed(5)
    batch, seq, channels, steps = 2, 41, 7, 4
    x = torch.randn(batch, seq, channels, generator=gen).to(DEVICE)
    mask = torch.ones(batch, seq, device=DEVICE)
    mask[1, :6] = 0  # left padding
    alpha, beta = _coefficients(pde, True, channels, True, gen, DEVICE)
    kwargs = dict(pde_type=pde, steps=steps, alpha=alpha, beta=beta, causal=True)
    full, full_state = pde_refine_reference(x, attention_mask=mask, return_final_state=True, **kwargs)
    state = None
    outs = []
    for lo, hi in ((0, 3), (3, 4), (4, 20), (20, 41)):
        y, state = pde_refine_triton(x[:, lo:hi], attention_mask=mask[:, lo:hi], initial_state=state,
                                     return_final_state=True, **kwargs)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, full_state, rtol=1e-5, atol=1e-6)
    # decode the rest token by token from the prefill state: equals the full sequence
    ext = torch.randn(batch, 5, channels, generator=gen).to(DEVICE)
    ref_full = pde_refine_reference(torch.cat([x, ext], 1), attention_mask=torch.cat(
        [mask, torch.ones(batch, 5, device=DEVICE)], 1), **kwargs)
    state_t = state.clone()
    for t in range(5):
        tok = pde_decode_step_triton(ext[:, t], state_t, pde_type=pde, steps=steps, alpha=alpha, beta=beta)
        torch.testing.assert_close(tok, ref_full[:, seq + t], rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("pde", PDE_TYPES)
def test_gradients_with_initial_state(pde):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 19, 5, generator=gen).to(DEVICE)
    init = torch.randn(2, 3, 5, generator=gen).to(DEVICE)
    alpha, beta = _coefficients(pde, True, 5, False, gen, DEVICE)
    g = torch.randn(2, 19, 5, generator=gen).to(DEVICE)
    kwargs = dict(pde_type=pde, steps=3, causal=True, initial_state=init)
    ref = _run(pde_refine_reference, x, alpha, beta, g, **kwargs)
    out = _run(pde_refine_triton, x, alpha, beta, g, **kwargs)
    for r, o in zip(ref[:4], out[:4]):
        if r is not None:
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("pde", PDE_TYPES)
@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
def test_gradients_through_the_streamed_state(pde, compiled):
    """A streamed chunk's gradients when the initial state requires grad and/or the loss uses the final state equal
    the reference's (the kernels' backward has neither; the state path must not drop them silently)."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 11, 5, generator=gen).to(DEVICE)
    init = torch.randn(2, 3, 5, generator=gen).to(DEVICE)
    alpha, beta = _coefficients(pde, True, 5, True, gen, DEVICE)
    gy, gfin = torch.randn(2, 11, 5, generator=gen).to(DEVICE), torch.randn(2, 3, 5, generator=gen).to(DEVICE)

    def loss(fn, use_final, xs, a, b, state):
        y, fin = fn(xs, pde_type=pde, steps=3, alpha=a, beta=b, causal=True, initial_state=state,
                    return_final_state=True)
        return (y.float() * gy).sum() + ((fin * gfin).sum() if use_final else 0.0)

    def grads(fn, use_final, init_grad):
        leaves = [t.detach().clone().requires_grad_(need) if t is not None else None
                  for t, need in ((x, True), (alpha, True), (beta, True), (init, init_grad))]
        loss(fn, use_final, *leaves).backward()
        return [t.grad if t is not None else None for t in leaves]

    for use_final, init_grad in ((True, False), (False, True), (True, True), (False, False)):
        triton_fn = pde_refine_triton
        if compiled:
            triton_fn = torch.compile(
                lambda *args, **kwargs: pde_refine_triton(*args, **kwargs), fullgraph=True, backend="aot_eager"
            )
        ref = grads(pde_refine_reference, use_final, init_grad)
        out = grads(triton_fn, use_final, init_grad)
        for name, r, o in zip(("x", "alpha", "beta", "initial_state"), ref, out):
            if r is None:
                assert o is None, name
            else:
                torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@needs_kernels
@pytest.mark.parametrize("pde", PDE_TYPES)
@pytest.mark.parametrize("steps", (1, 5))
def test_decode_step_matches_reference(pde, steps):
    gen = torch.Generator().manual_seed(7)
    batch, channels = 3, 33
    alpha, beta = _coefficients(pde, True, channels, pde != "wave", gen, DEVICE)
    state = torch.randn(batch, steps, channels, generator=gen).to(DEVICE)
    state_ref = state.clone()
    x = torch.randn(batch, channels, generator=gen).to(DEVICE)
    token_mask = torch.tensor([1.0, 0.0, 1.0], device=DEVICE)
    for tm in (None, token_mask):
        out = pde_decode_step_triton(x, state, pde_type=pde, steps=steps, alpha=alpha, beta=beta, token_mask=tm)
        ref = pde_decode_step_reference(x, state_ref, pde_type=pde, steps=steps, alpha=alpha, beta=beta,
                                        token_mask=tm)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("pde", PDE_TYPES)
def test_decode_step_clamps_and_reads_any_token_mask(pde):
    """The decode kernel clamps the coefficients into ``coefficient_bounds`` itself and reads the token mask in its
    own dtype and layout (an attention mask's [batch, 1] column), as the reference does with a clamp and a cast."""
    from cta.pde_spec import coefficient_bounds

    gen = torch.Generator().manual_seed(11)
    batch, channels, steps = 3, 37, 3
    alpha, beta = _coefficients(pde, True, channels, True, gen, DEVICE)
    alpha = alpha * 4 - 0.3  # both sides of the bounds
    beta = beta * 4 - 0.5 if beta is not None else None
    bounds = coefficient_bounds(pde, True)
    column = torch.tensor([[1, 1, 0], [0, 1, 0], [1, 0, 1]], device=DEVICE)[:, 1:2]  # a strided [batch, 1] view
    masks = (None, column, column.bool().reshape(-1), column.float().reshape(1, batch))
    for token_mask in masks:
        state = torch.randn(batch, steps, channels, generator=gen).to(DEVICE)
        state_ref, state_before = state.clone(), state.clone()
        x = torch.randn(batch, channels, generator=gen).to(DEVICE)
        out = pde_decode_step_triton(x, state, pde_type=pde, steps=steps, alpha=alpha, beta=beta,
                                     token_mask=token_mask, coefficient_bounds=bounds)
        clamped_alpha = alpha.clamp(*bounds[0])
        clamped_beta = beta.clamp(*bounds[1]) if beta is not None else None
        ref = pde_decode_step_reference(x, state_ref, pde_type=pde, steps=steps, alpha=clamped_alpha,
                                        beta=clamped_beta, token_mask=None if token_mask is None
                                        else token_mask.float().reshape(-1))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-6)
        state_ref.copy_(state_before)
        ref_bounded = pde_decode_step_reference(x, state_ref, pde_type=pde, steps=steps, alpha=alpha, beta=beta,
                                                token_mask=token_mask, coefficient_bounds=bounds)
        torch.testing.assert_close(ref_bounded, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="coefficient_bounds"):
        pde_decode_step_triton(x, state, pde_type=pde, steps=steps, alpha=alpha, beta=beta,
                               coefficient_bounds=(0.1,))


@needs_kernels
def test_dispatch_and_fallbacks():
    assert is_available()
    x = torch.randn(1, 12, 4, device=DEVICE)
    out = pde_refine(x, pde_type="wave", steps=2, alpha=0.1, backend="triton")
    torch.testing.assert_close(out, pde_refine_reference(x, pde_type="wave", steps=2, alpha=0.1))
    # steps 0 is the identity; steps > 16 falls back to the reference
    assert torch.equal(pde_refine_triton(x, pde_type="diffusion", steps=0, alpha=0.1), x)
    torch.testing.assert_close(pde_refine_triton(x, pde_type="diffusion", steps=20, alpha=0.1),
                               pde_refine_reference(x, pde_type="diffusion", steps=20, alpha=0.1))
    y, st = pde_refine_triton(x, pde_type="diffusion", steps=2, alpha=0.1, return_final_state=True)
    assert st.shape == (1, 0, 4)
    with pytest.raises(ValueError, match="alpha"):
        pde_refine_triton(x, pde_type="diffusion", steps=2, alpha=torch.ones(3))


@needs_kernels
def test_torch_compile_has_no_graph_break():
    def f(t, a, b):
        return pde_refine_triton(t, pde_type="reaction_diffusion", steps=2, alpha=a, beta=b, causal=True) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="eager")  # fullgraph=True raises on a graph break
    x = torch.randn(2, 9, 6, device=DEVICE, requires_grad=True)
    a = torch.tensor(0.1, device=DEVICE, requires_grad=True)
    b = torch.full((6,), 0.05, device=DEVICE, requires_grad=True)
    compiled(x, a, b).sum().backward()
    ga, gb, gx = a.grad.clone(), b.grad.clone(), x.grad.clone()
    for t in (x, a, b):
        t.grad = None
    f(x, a, b).sum().backward()
    torch.testing.assert_close(ga, a.grad)
    torch.testing.assert_close(gb, b.grad)
    torch.testing.assert_close(gx, x.grad)
    from torch.library import opcheck

    from cta import triton_cta

    args = (torch.randn(2, 7, 5, device=DEVICE), torch.tensor(0.1, device=DEVICE), None, None, None, 0, 2, True, True)
    opcheck(triton_cta._pde_refine_fwd, args, test_utils=("test_schema", "test_faketensor"))



def _coefficient_shape_cases():
    cases = []
    for pde, causal, path in [("diffusion", False, "stream-bidi"), ("advection_diffusion", True, "stream-causal-adv"),
                              ("wave", False, "tile-wave")]:
        for alpha_vec, beta in [(False, None), (True, None), (False, "vec"), (True, "scalar"), (False, "scalar")]:
            if beta is None and pde == "advection_diffusion":  # it needs beta
                continue
            cases.append(pytest.param(pde, causal, alpha_vec, beta,
                                      id=f"{path}-alpha_{'vec' if alpha_vec else 'scalar'}-beta_{beta}"))
    return cases


@needs_kernels
@pytest.mark.parametrize("pde,causal,alpha_vec,beta", _coefficient_shape_cases())
def test_backward_op_coefficient_gradient_shapes(pde, causal, alpha_vec, beta):
    """The backward op returns each coefficient's gradient per channel for a per-channel coefficient and as one value
    for a scalar one (a scalar's partial sums are reduced per program in the streaming kernels), exactly as its fake
    implementation -- what ``torch.compile`` traces -- says, on the streaming and the tile kernels; the values are
    the reference's."""
    from torch.library import opcheck

    from cta import triton_cta

    gen = torch.Generator().manual_seed(5)
    channels = 11
    x = torch.randn(2, 29, channels, generator=gen).to(DEVICE)
    gy = torch.randn(2, 29, channels, generator=gen).to(DEVICE)
    alpha = (torch.full((channels,), 0.15) if alpha_vec else torch.tensor(0.15)).to(DEVICE)
    b = {None: None, "vec": torch.full((channels,), 0.05), "scalar": torch.tensor(0.05)}[beta]
    b = b.to(DEVICE) if b is not None else None
    args = (gy, x, alpha, b, None, None, PDE_IDS[pde], 3, causal)
    opcheck(triton_cta._pde_refine_bwd, args, test_utils=("test_schema", "test_faketensor"))
    _, da, db = triton_cta._pde_refine_bwd(*args)
    a_ref = alpha.clone().requires_grad_(True)
    b_ref = b.clone().requires_grad_(True) if b is not None else None
    y = pde_refine_reference(x, pde_type=pde, steps=3, alpha=a_ref, beta=b_ref, causal=causal)
    (y * gy).sum().backward()
    torch.testing.assert_close(da.reshape(alpha.shape), a_ref.grad, rtol=1e-4, atol=1e-4)
    if b is not None:  # (a scheme without beta gives zeros)
        want = b_ref.grad if b_ref.grad is not None else torch.zeros_like(b)
        torch.testing.assert_close(db.reshape(b.shape), want, rtol=1e-4, atol=1e-4)

@needs_kernels
@pytest.mark.parametrize("pde,causal", [("diffusion", False), ("diffusion", True), ("advection_diffusion", True)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("in_kernel", [True, False], ids=["in_kernel", "second_kernel"])
def test_per_channel_coefficient_gradient_paths(pde, causal, deterministic, in_kernel, monkeypatch):
    """The backward kernel finishes the coefficient gradient itself: its programs add their per-channel sums with
    atomics into a few rows or, under ``torch.use_deterministic_algorithms(True)``, store them per program, and the
    last program of each channel block (a scalar coefficient: of the grid) sums them. Both equal the reference's
    gradient over several programs per sequence, and each launch leaves its counters and atomic rows at zero for the
    next (the workspace is shared by the launches of a stream, whatever their kind). Beyond
    ``FINISH_MAX_ELEMENTS`` (here: all) a second kernel sums them instead, to the same gradient."""
    from cta import kernels_launch
    from cta.kernels_launch import _Workspace

    if not in_kernel:
        monkeypatch.setattr(kernels_launch, "FINISH_MAX_ELEMENTS", 0)
    kernels_launch._backward_launch.cache_clear()  # (the choice is cached with the launch)
    try:
        with deterministic_algorithms(deterministic):
            for per_channel in (True, False):
                check_parity(pde, causal, 37, 16, 3, "none", per_channel, batch=2, seed=11)
            check_parity(pde, causal, 37, 16, 3, "left", True, batch=2, seed=12)  # (the walk's programs, a mask)
    finally:
        kernels_launch._backward_launch.cache_clear()
    if not in_kernel:
        return
    assert _Workspace.buffers, "the streaming backward did not use the workspace"
    for (device, stream, atomic), (partials, counters) in _Workspace.buffers.items():
        assert not counters.any(), "a launch left a counter set"
        if atomic:
            assert not partials.any(), "a launch left its atomic rows non-zero"


@needs_kernels
@pytest.mark.parametrize("rows,channels", [(1, 1), (3, 129), (8, 700), (1100, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_coefficient_gradient_finish_matches_torch(rows, channels, dtype):
    """``_coef_grad_like`` (the partial sums finished by ``_sum_rows_kernel`` as the parameter's gradient): a
    per-channel coefficient gets the fp64 sum of the rows, a scalar one ``[1]`` or 0-d the sum of everything, each in
    the coefficient's dtype and shape, to the rounding of that dtype."""
    from cta import kernels_launch

    gen = torch.Generator().manual_seed(rows * 1000 + channels)
    values = torch.randn(rows, channels, generator=gen).to(DEVICE)
    for coefficient, expected in ((torch.zeros(channels, dtype=dtype), values.double().sum(0)),
                                  (torch.zeros(1, dtype=dtype), values.double().sum().reshape(1)),
                                  (torch.zeros((), dtype=dtype), values.double().sum())):
        got = kernels_launch._coef_grad_like(values, coefficient.to(DEVICE))
        assert got.shape == coefficient.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected.to(got.device).to(dtype).double(),
                                   rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-5)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@needs_kernels
@settings(max_examples=40 if RUN_SLOW else 8, deadline=None, derandomize=True)
@given(
    pde=st.sampled_from(PDE_TYPES),
    causal=st.booleans(),
    batch=st.integers(1, 3),
    seq=st.integers(1, 80 if RUN_SLOW else 24),
    channels=st.integers(1, 40),
    steps=st.integers(0, 16 if RUN_SLOW else 6),
    padding=st.sampled_from(PADDINGS),
    per_channel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parity_hypothesis(pde, causal, batch, seq, channels, steps, padding, per_channel, seed):
    check_parity(pde, causal, seq, channels, steps, padding, per_channel, batch=batch, seed=seed)


@needs_kernels
@settings(max_examples=40 if RUN_SLOW else 8, deadline=None, derandomize=True)
@given(
    pde_causal=st.sampled_from([("diffusion", False), ("diffusion", True), ("advection_diffusion", True)]),
    batch=st.integers(1, 2),
    seq=st.integers(1, 80 if RUN_SLOW else 40),
    channels=st.sampled_from([16, 32]),
    steps=st.integers(1, 16 if RUN_SLOW else 8),
    per_channel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parity_hypothesis_filters(pde_causal, batch, seq, channels, steps, per_channel, seed):
    """The banded filters, interior and at the sequence ends (whole channel blocks, no padding: the inputs the
    randomised test above seldom draws), with the sequence ends anywhere in a program."""
    pde, causal = pde_causal
    check_parity(pde, causal, seq, channels, steps, "none", per_channel, batch=batch, seed=seed)
