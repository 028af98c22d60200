"""Parity of the Triton kernels (cta/triton_cta.py) with the PyTorch reference (cta/pde_cta.py).

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` is set below, before triton is
imported), on a small sample of the shape / option cross product so that this file stays around a minute on 2 cores
(the streaming kernels walk the sequence row by row, which the interpreter executes op by op); ``CTA_RUN_SLOW=1``
runs the larger sample (100 cases, sequences up to 1000, 16 steps) and more hypothesis examples. Tests marked ``gpu``
run the full cross product (and bf16/fp16, larger shapes) on CUDA and skip without it. The cross product's channel
counts (1, 60, 129) never fill whole channel blocks, which the banded filters need (interior programs and sequence
ends, register and tensor-core), so those have their own tests below, a randomised one among them.

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

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("CTA_TEST_GPU") else "1")

import pytest
import torch

triton = pytest.importorskip("triton")

from cta.pde_cta import PDE_TYPES, pde_decode_step_reference, pde_refine, pde_refine_reference  # noqa: E402
from cta.triton_cta import _is_linear, is_available, pde_decode_step_triton, pde_refine_triton  # noqa: E402


ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with TRITON_INTERPRET unset (CTA_TEST_GPU=1)")
RUN_SLOW = bool(os.environ.get("CTA_RUN_SLOW"))
slow = pytest.mark.skipif(not RUN_SLOW, reason="slow: set CTA_RUN_SLOW=1")
needs_kernels = pytest.mark.skipif(
    not (ON_GPU or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 set before triton is imported"
)

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


@pytest.fixture
def launched_kernels(monkeypatch):
    """The keys of the streaming kernels built or looked up, in launch order (``triton_cta._gen_kernel``)."""
    from cta import triton_cta

    launched = []
    build = triton_cta._gen_kernel
    monkeypatch.setattr(triton_cta, "_gen_kernel", lambda key: launched.append(key) or build(key))
    return launched


@contextlib.contextmanager
def deterministic_algorithms(enabled):
    """``torch.use_deterministic_algorithms(enabled)`` within the block, restored after it."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.fixture
def small_stream_tiles():
    """Forces short tiles (T=8 rows, 8 channels, prefetch 3) on the streaming kernels, so that short sequences cross
    several tile boundaries (warm-up rows, the coefficient-gradient partial sums of each tile, the last partial tile,
    partial channel blocks) -- the situations of the GPU's long sequences."""
    from cta import triton_cta

    saved = dict(triton_cta._STREAM_TUNE)
    for kind in ("fwd", "bwd"):
        for causal in (False, True):
            for steps in range(1, 17):
                triton_cta._STREAM_TUNE[(kind, causal, steps)] = (8, 8, 1, 3)
    yield
    triton_cta._STREAM_TUNE.clear()
    triton_cta._STREAM_TUNE.update(saved)


@needs_kernels
@pytest.mark.parametrize("causal", (False, True), ids=("bidi", "causal"))
@pytest.mark.parametrize(
    "pde,steps,padding,per_channel",
    [
        ("diffusion", 1, "none", True),
        ("diffusion", 3, "left", True),  # padding walls inside and across tiles
        ("diffusion", 4, "right", False),  # scalar coefficient
        ("advection_diffusion", 2, "left", True),  # causal: the linear backward with a + b
        ("wave", 3, "right", True),
        ("reaction_diffusion", 2, "none", False),
    ],
)
def test_stream_tiles(small_stream_tiles, pde, steps, padding, per_channel, causal):
    """Streaming kernels over many tiles (rows 0..T, interior tiles, walls at both ends and at padding) vs the
    reference: outputs, input gradients and the per-tile coefficient-gradient partial sums."""
    check_parity(pde, causal, 29, 11, steps, padding, per_channel, batch=2, seed=steps)


def _interior_cases():
    """(pde, steps, causal, filter unroll): every scheme on the walk's interior copy (unroll 0), and the banded
    filter (unroll 1 and 3) for the linear schemes, the only ones that have it."""
    cases = []
    for pde, steps in [("diffusion", 1), ("diffusion", 2), ("diffusion", 3), ("diffusion", 8),
                       ("advection_diffusion", 2), ("wave", 2), ("reaction_diffusion", 3)]:
        for causal in (False, True):
            for unroll in (0, 1, 3) if _is_linear(pde, causal, False) else (0,):
                path = {0: "walk", 1: "filter", 3: "filter-unrolled"}[unroll]
                cases.append(pytest.param(pde, steps, causal, unroll,
                                          id=f"{pde}-{steps}-{'causal' if causal else 'bidi'}-{path}"))
    return cases


@needs_kernels
@pytest.mark.parametrize("pde,steps,causal,fir_unroll", _interior_cases())
def test_stream_tiles_interior_path(small_stream_tiles, monkeypatch, pde, steps, causal, fir_unroll):
    """Whole channel blocks and no padding: the tiles away from both ends run the mask-free interior copy of the
    loop, or for the linear schemes the banded filter (the paths large inputs mostly take on a GPU); outputs and all
    gradients vs the reference. The coefficient gradient also checks that the filter's per-tile partial sums use the
    walk's split (the end programs filter too, on the walls' extension, or walk with ``USE_FIR`` off)."""
    from cta import triton_cta

    linear = _is_linear(pde, causal, False)
    monkeypatch.setattr(triton_cta, "USE_FIR", bool(fir_unroll))
    for key in list(triton_cta._STREAM_TUNE):
        triton_cta._STREAM_TUNE[key] = triton_cta._STREAM_TUNE[key][:4] + (max(fir_unroll, 1),)
    for kind in ("fwd", "bwd") if linear else ("fwd",):
        key = (kind, pde, causal, steps, 3, False, True, False, False, False, True, fir_unroll)
        src = triton_cta._stream_source("k", *key)
        assert "if interior:" in src  # the path under test exists for this case
        assert ("t = start + j" in src) == bool(fir_unroll)  # the filter's row loop
        assert ("loop_unroll_factor" in src) == (fir_unroll > 1)
    check_parity(pde, causal, 64, 16, steps, "none", True, batch=2, seed=steps)
    if linear:  # scalar coefficient too (the taps broadcast)
        check_parity(pde, causal, 64, 16, steps, "none", False, batch=2, seed=steps + 1)


def _emitted_taps(emit, causal, steps, c):
    """Runs the tap lines ``emit`` writes (``_fir_taps`` or ``_fir_taps_by_levels``) on the tensor ``c``."""
    from types import SimpleNamespace

    from cta import triton_cta

    w = triton_cta._Src()
    emit(w, "tap", causal, steps, "c")
    scope = {"c": c, "tl": SimpleNamespace(fma=lambda a, b, acc: a * b + acc)}
    exec("\n".join(line.strip() for line in w.lines), scope)
    return torch.stack([torch.as_tensor(scope[f"tap{k}"], dtype=c.dtype).expand_as(c) for k in range(steps + 1)])


@pytest.mark.parametrize("causal", (False, True), ids=("bidi", "causal"))
def test_fir_taps_closed_form(causal):
    """The banded filter's taps in closed form equal the stencil convolved with itself ``steps`` times (the
    stencil's polynomial to that power, numpy in float64), for 0..16 steps and coefficients over the whole stable
    range, in float64 (to rounding) and float32 (every term is non-negative: a few ulps); the level-by-level
    emitter, kept for the paired benchmark, agrees too."""
    from cta import triton_cta

    c = torch.tensor([0.0, 0.02, 0.1, 0.25, 0.4, 0.5] + ([0.75, 1.0] if causal else []), dtype=torch.float64)
    for steps in range(17):
        # the stencil's polynomial to the power steps (numpy): coefficient i of (c + m z + c z^2)^steps is the tap
        # at offset i - steps; of (c + m z)^steps, the causal tap at offset -(steps - i)
        stencils = [[v, 1 - v] if causal else [v, 1 - 2 * v, v] for v in c.tolist()]
        size = (1 if causal else 2) * steps + 1
        powers = [np.polynomial.polynomial.polypow(stencil, steps) for stencil in stencils]
        powers = [np.pad(p, (0, size - len(p))) for p in powers]  # (polypow drops trailing zeros: c = 0)
        expected = torch.tensor(np.stack([p[::-1] if causal else p[steps:] for p in powers], axis=1))
        for emit in (triton_cta._fir_taps, triton_cta._fir_taps_by_levels):
            torch.testing.assert_close(_emitted_taps(emit, causal, steps, c), expected, rtol=1e-12, atol=1e-15)
        closed32 = _emitted_taps(triton_cta._fir_taps, causal, steps, c.float())
        torch.testing.assert_close(closed32.double(), expected, rtol=4e-6, atol=1e-7)


def _walls_cases():
    """(pde, causal, steps, seq): sequences shorter than the steps (the bidirectional end programs then walk),
    around one program, and over several with a partial last one."""
    cases = []
    for pde, causal in [("diffusion", False), ("diffusion", True), ("advection_diffusion", True)]:
        for steps, seq in [(1, 3), (3, 2), (3, 21), (8, 5), (8, 45)]:
            cases.append(pytest.param(pde, causal, steps, seq,
                                      id=f"{pde}-{'causal' if causal else 'bidi'}-{steps}-seq{seq}"))
    return cases


@needs_kernels
@pytest.mark.parametrize("pde,causal,steps,seq", _walls_cases())
def test_stream_walls_filter(monkeypatch, launched_kernels, pde, causal, steps, seq):
    """Programs at the sequence ends run the banded filter with the walls as an extension of the input (even
    reflection for the zero-flux bidirectional walls, zeros for the causal ones): outputs and all gradients vs the
    reference, per-channel and scalar, with 16-row programs (the first and last of each sequence are end programs,
    the last one partial). Per channel, each kernel filters its ends up to its ``WALLS_MAX_STEPS_PER_CHANNEL`` and
    walks them above (at 8 steps: the causal forward and the bidirectional backward filter)."""
    from cta import triton_cta

    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", {})
    for kind in ("fwd", "bwd"):
        triton_cta._STREAM_TUNE[(kind, causal, steps)] = (16, 16, 1, 3, 2)
        for walls in (1, 2):  # with a walk for short sequences, and without
            src = triton_cta._stream_source("k", kind, pde, causal, steps, 3, False, False, False, False, False, True,
                                            2, 0, walls)
            assert ("elif " in src) == (walls == 1)  # the end programs' branch, under a condition
            assert ("for j in range(0, n_it)" in src) == (walls == 1)  # the walk
            assert ("other=0.0)" if causal else "2 * L - 1 -") in src  # the walls' extension
    launched_kernels.clear()
    check_parity(pde, causal, seq, 16, steps, "none", True, batch=2, seed=steps)
    walls = {key[0]: key[13] for key in launched_kernels}
    for kind in ("fwd", "bwd"):
        filters = steps <= triton_cta.WALLS_MAX_STEPS_PER_CHANNEL[(kind, causal)] and (causal or seq >= steps)
        assert (walls[kind] > 0) == filters, (kind, walls)
    check_parity(pde, causal, seq, 16, steps, "none", False, batch=2, seed=steps + 1)


@needs_kernels
@pytest.mark.parametrize("pde,causal,steps,seq", _walls_cases())
def test_stream_walls_one_copy(monkeypatch, launched_kernels, pde, causal, steps, seq):
    """Forwards whose every program runs one copy of the filter on the walls' extension (``WALLS_ONE_COPY``, here
    every entry: the register filter's loop over all rows with masked stores, and the tensor-core filter): outputs
    and gradients vs the reference, per-channel and scalar, fp32 and fp16 (tensor cores where the program fits),
    with 16- and 32-row programs; the forward kernel has that one copy and no walk, except for bidirectional
    sequences shorter than the steps, which walk."""
    from cta import triton_cta

    monkeypatch.setattr(triton_cta, "WALLS_ONE_COPY", {(c, m) for c in (False, True) for m in (False, True)})
    monkeypatch.setattr(triton_cta, "MMA_MIN_STEPS", {key: 1 for key in triton_cta.MMA_MIN_STEPS})
    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", {})
    for kind in ("fwd", "bwd"):
        triton_cta._STREAM_TUNE[(kind, causal, steps)] = (16, 16, 1, 3, 2)
        triton_cta._STREAM_TUNE[(kind + "_mma", causal, steps)] = (32, 16, 1, 2, 1)
    for mma in (0, 2):
        src = triton_cta._stream_source("k", "fwd", pde, causal, steps, 3, False, False, False, False, False, True,
                                        2, mma, 3)
        assert "if interior:" not in src and "for j in range(0, n_it)" not in src  # one copy, no walk
        assert ("other=0.0)" if causal else "2 * L - 1 -") in src  # the walls' extension
    want = 0 if (not causal and seq < steps) else 3
    for dtype, per_channel in ((torch.float32, True), (torch.float32, False), (torch.float16, False)):
        launched_kernels.clear()
        check_parity(pde, causal, seq, 32, steps, "none", per_channel, batch=2, dtype=dtype, seed=steps)
        forward = launched_kernels[0]
        assert forward[0] == "fwd" and forward[13] == want
        if dtype == torch.float16 and seq > 32:  # two channel blocks, programs of two MMA tiles
            assert forward[12] > 0


@needs_kernels
@pytest.mark.parametrize("causal", (False, True), ids=("bidi", "causal"))
def test_stream_walls_filter_runs(monkeypatch, causal):
    """The end programs take the filter, not the walk: with the walls' extension replaced by repeating the end rows
    (wrong for both schemes), the rows near the ends no longer match the reference, while ``USE_WALLS=False`` (the
    walk) still does."""
    from cta import triton_cta

    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", {(kind, causal, 3): (16, 16, 1, 3, 2) for kind in ("fwd", "bwd")})
    monkeypatch.setattr(triton_cta, "_GEN_CACHE", {})
    monkeypatch.setattr(triton_cta, "_wall_load", lambda ptr, r, stride, wall, vector=False: (
        f"tl.load({ptr} + tl.minimum(tl.maximum({r}, 0), L - 1) * {stride})"))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 16, generator=gen).to(DEVICE)
    grad = torch.randn(2, 40, 16, generator=gen).to(DEVICE)
    alpha = torch.tensor(0.1, device=DEVICE)
    want = _run(pde_refine_reference, x, alpha, None, grad, pde_type="diffusion", steps=3, causal=causal)
    for use_walls in (True, False):
        monkeypatch.setattr(triton_cta, "USE_WALLS", use_walls)
        got = _run(pde_refine_triton, x, alpha, None, grad, pde_type="diffusion", steps=3, causal=causal)
        for name, a, b in zip(("output", "input gradient"), got[:2], want[:2]):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5) != use_walls, name


def check_mma_parity(monkeypatch, launched, dtype, pde, causal, steps, shape, seed=0):
    """The tensor-core filter (interior tiles of a 16-bit input with a scalar coefficient) against the fp64
    reference and against the register filter on the same input: outputs and input gradients within one rounding
    of the 16-bit result, the coefficient gradients to fp32 accuracy (the upstream gradient is 16-bit exact, so
    the reference sees the kernels' inputs). Checks that the forward and backward launches took the path asked for
    (``launched``: the ``launched_kernels`` fixture)."""
    from cta import triton_cta

    monkeypatch.setattr(triton_cta, "MMA_MIN_STEPS", {key: 1 for key in triton_cta.MMA_MIN_STEPS})
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    alpha = (0.02 + 0.2 * torch.rand((), generator=gen)).to(DEVICE)
    beta = (0.3 * torch.rand((), generator=gen)).to(DEVICE) if pde == "advection_diffusion" else None
    grad_out = torch.randn(shape, generator=gen).to(DEVICE, dtype).float()
    kwargs = dict(pde_type=pde, steps=steps, causal=causal)
    runs = {}
    for use_mma in (True, False):
        monkeypatch.setattr(triton_cta, "USE_MMA", use_mma)
        launched.clear()
        runs[use_mma] = _run(pde_refine_triton, x, alpha, beta, grad_out, **kwargs)
        assert [bool(key[12]) for key in launched] == [use_mma, use_mma]  # forward and backward kernels (mma)
    ref = _run(pde_refine_reference, x.double(), alpha.double(), beta.double() if beta is not None else None,
               grad_out.double(), **kwargs)
    one_rounding = dict(rtol=2 ** -7, atol=2 ** -7) if dtype == torch.bfloat16 else dict(rtol=2 ** -10, atol=2 ** -10)
    tensor_cores, registers = runs[True], runs[False]
    if dtype == torch.float16 or ON_GPU:  # (the interpreter truncates fp32 -> bf16 instead of rounding)
        # An fp32-accurate filter rounds to the same 16-bit value as the exact result except within ~1e-6 of a
        # rounding boundary; a filter whose taps kept only 16 bits would miss the exact rounding far more often.
        for got, want in ((tensor_cores[0], ref[0]), (tensor_cores[1], ref[1])):
            assert (got != want.to(dtype)).double().mean() < 0.01
    for want in (ref, registers):
        torch.testing.assert_close(tensor_cores[0].double(), want[0].double(), **one_rounding)
        torch.testing.assert_close(tensor_cores[1].double(), want[1].double(), **one_rounding)
        for got, expect in zip(tensor_cores[2:4], want[2:4]):
            if expect is not None:
                torch.testing.assert_close(got.double(), expect.double(), rtol=1e-3, atol=1e-3)


def _mma_cases():
    cases = []
    for i, (pde, causal) in enumerate([("diffusion", False), ("diffusion", True), ("advection_diffusion", True)]):
        for j, steps in enumerate((1, 3, 8)):
            ahead = (i + j) % 3
            cases.append(pytest.param(torch.float16, pde, causal, steps, ahead,
                                      id=f"fp16-{pde}-{'causal' if causal else 'bidi'}-{steps}-ahead{ahead}"))
        cases.append(pytest.param(torch.bfloat16, pde, causal, 8, 1,
                                  id=f"bf16-{pde}-{'causal' if causal else 'bidi'}-8-ahead1"))
    return cases


@needs_kernels
@pytest.mark.parametrize("dtype,pde,causal,steps,ahead", _mma_cases())
def test_mma_interior_path(monkeypatch, launched_kernels, dtype, pde, causal, steps, ahead):
    """Interior tiles on tensor cores (16-row MMA tiles, two input blocks each, filter matrices split into two 16-bit
    parts) vs the fp64 reference and the register filter, with short programs so that a 137-row sequence has
    end programs (on the walls' extension, the last one partial) and MMA programs between them: three programs of
    two tiles, or with two
    blocks loaded ahead one of four tiles (0-2 blocks ahead: the unrolled forward loop and the backward's loop),
    and two channel blocks. The interpreter's bf16 ``tl.dot`` is broken, so there the same 16-bit operands are
    multiplied in fp32 (exact); the GPU test below runs the MMA instructions."""
    from cta import triton_cta

    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", {})
    for kind in ("fwd", "bwd"):
        rows = 64 if ahead == 2 else 32
        triton_cta._STREAM_TUNE[(kind + "_mma", causal, steps)] = (rows, 16, 1, 2, ahead)
        triton_cta._STREAM_TUNE[(kind, causal, steps)] = (rows, 16, 1, 2, 1)
        src = triton_cta._stream_source("k", kind, pde, causal, steps, 2, False, False, False, False, False, True, 1,
                                        1 + ahead)
        assert "tl.dot(" in src and "interior" in src
    check_mma_parity(monkeypatch, launched_kernels, dtype, pde, causal, steps, (2, 137, 32), seed=steps)


@needs_kernels
def test_mma_walls_final_state(monkeypatch, launched_kernels):
    """A causal prefill that returns its final state (what a patched decoder caches) on the tensor-core filter: the
    first program filters its end (zeros before the first row), the last one walks and writes the state; output and
    state vs the fp64 reference, to one fp16 rounding."""
    from cta import triton_cta

    monkeypatch.setattr(triton_cta, "MMA_MIN_STEPS", {key: 1 for key in triton_cta.MMA_MIN_STEPS})
    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", {("fwd_mma", True, 3): (32, 16, 1, 2, 1)})
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 137, 32, generator=gen).to(DEVICE, torch.float16)
    kwargs = dict(pde_type="diffusion", steps=3, alpha=0.15, causal=True, return_final_state=True)
    out, state = pde_refine_triton(x, **kwargs)
    ref, ref_state = pde_refine_reference(x.double(), **kwargs)
    assert [(key[12], key[13]) for key in launched_kernels] == [(2, 1)]  # the tensor-core filter, ends filtered and walked
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -10, atol=2 ** -10)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_stream_tiles_streaming_state(small_stream_tiles):
    """Initial / final causal state through tiled streaming kernels (the state lives in the first / last tile; with
    whole channel blocks (16) the other end programs filter, the ones the state reaches walk)."""
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
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("pde,causal", [("diffusion", False), ("diffusion", True), ("advection_diffusion", True)])
@pytest.mark.parametrize("steps", range(1, 9))
def test_mma_interior_gpu(monkeypatch, launched_kernels, dtype, pde, causal, steps):
    """The tensor-core filter at every step count it takes, with its default programs, on a GPU (MMA instructions)."""
    check_mma_parity(monkeypatch, launched_kernels, dtype, pde, causal, steps, (2, 1037, 256), seed=steps)

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", (False, True))
def test_direct_launch_gpu(monkeypatch, causal):
    """Repeated calls of one configuration go through the compiled kernels' launchers (``_launch``'s fast path);
    their outputs and gradients equal Triton's generic launch, bit for bit, and a misaligned view (not cached)
    still matches the reference."""
    import cta.triton_cta as kernels

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 333, 96, generator=gen).to(DEVICE, torch.bfloat16)
    alpha = torch.full((96,), 0.15, device=DEVICE, requires_grad=True)
    grad = torch.randn(x.shape, generator=gen).to(DEVICE, torch.bfloat16)

    def run():
        xx = x.detach().requires_grad_(True)
        alpha.grad = None
        y = pde_refine_triton(xx, pde_type="diffusion", steps=3, alpha=alpha, causal=causal)
        y.backward(grad)
        return y.detach(), xx.grad, alpha.grad

    for deterministic in (True, False):  # the coefficient gradient's partial sums, then its atomics
        with deterministic_algorithms(deterministic):
            monkeypatch.setattr(kernels, "DIRECT_LAUNCH", False)
            generic = run()
            monkeypatch.setattr(kernels, "DIRECT_LAUNCH", True)
            kernels._COMPILED.clear()
            run()  # compiles (or finds) the kernels through Triton and caches them
            cached = [key[0] for key in kernels._COMPILED]
            # fwd and bwd, and with the atomics the sum of their rows (96 channels: several rows)
            streaming = [k for k in cached if k is not kernels._sum_rows_kernel]
            assert len(streaming) == 2 and all(k is not kernels._pde_decode_kernel for k in streaming)
            assert (kernels._sum_rows_kernel in cached) == (not deterministic)
            direct = run()
        assert torch.equal(direct[0], generic[0]) and torch.equal(direct[1], generic[1])
        if deterministic:
            assert torch.equal(direct[2], generic[2])
        else:  # atomics add in no fixed order: equal up to fp32 rounding
            torch.testing.assert_close(direct[2], generic[2], rtol=1e-5, atol=1e-4)
    base = torch.randn(1, 2 * 65 * 96 + 1, generator=gen).to(DEVICE, torch.bfloat16)
    odd = base[:, 1:].view(2, 65, 96)  # 2-byte offset: not 16-byte aligned, never cached
    before = len(kernels._COMPILED)
    out = pde_refine_triton(odd, pde_type="diffusion", steps=3, alpha=alpha.detach(), causal=causal)
    assert len(kernels._COMPILED) == before
    ref = pde_refine_reference(odd.float(), pde_type="diffusion", steps=3, alpha=alpha.detach(), causal=causal)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)

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


def _decode_module_pair(channels, pde, steps):
    """A one-layer hybrid cache config and two identical causal PDERefinement modules (per-channel alpha),
    ``{"triton": ..., "torch": ...}``, on DEVICE."""
    from transformers import LlamaConfig

    from cta.pde_cta import PDERefinement

    config = LlamaConfig(num_hidden_layers=1, layer_types=["hybrid"], number_of_conv_states=1,
                         hidden_size=64, num_attention_heads=1)
    modules = {}
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        modules[backend] = PDERefinement(channels, pde, steps, causal=True, alpha=0.1, per_channel=True,
                                         backend=backend, layer_idx=0).to(DEVICE)
    return config, modules


@needs_kernels
@pytest.mark.parametrize("pde", PDE_TYPES)
def test_module_fast_decode_matches_reference_module(pde):
    """PDERefinement's lean decode path (Triton update kernel, cached coefficients) against the reference module
    through a real hybrid cache: outputs and states per token, padding tokens, and a coefficient update between
    tokens (the cached coefficients must follow it)."""
    from transformers import DynamicCache

    channels, steps = 37, 3
    config, modules = _decode_module_pair(channels, pde, steps)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 30, channels, generator=gen).to(DEVICE)
    mask = torch.ones(2, 30, device=DEVICE)
    mask[1, 20] = 0  # a padding token inside the decoded part
    caches = {b: DynamicCache(config=config) for b in modules}
    with torch.no_grad():
        full = modules["torch"](x, mask)  # one full-sequence pass, before the coefficient update below
        outs = {b: [m(x[:, :16], mask[:, :16], caches[b])] for b, m in modules.items()}
        for t in range(16, 30):
            if t == 23:  # an in-place update (what an optimizer does) between two decode steps
                for m in modules.values():
                    m.alpha.mul_(0.5)
            for b, m in modules.items():
                outs[b].append(m(x[:, t:t + 1], mask[:, t:t + 1], caches[b]))
            torch.testing.assert_close(outs["triton"][-1], outs["torch"][-1], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(caches["triton"].layers[0].conv_states[0],
                                       caches["torch"].layers[0].conv_states[0], rtol=1e-5, atol=1e-6)
    assert "_cached_coefficients" in modules["triton"].__dict__  # the lean path ran
    if ON_GPU:  # and, after the first launch, through the compiled kernel's launcher directly
        import cta.triton_cta as kernels

        assert not kernels.DIRECT_LAUNCH or any(key[0] is kernels._pde_decode_kernel for key in kernels._COMPILED)
    # up to the update, prefill + decode equals the full-sequence pass
    torch.testing.assert_close(torch.cat(outs["triton"], 1)[:, :23], full[:, :23], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(torch.cat(outs["triton"], 1)[:, 23:], full[:, 23:], atol=1e-3)  # the update mattered


@needs_kernels
@pytest.mark.parametrize("pde", ["diffusion", "reaction_diffusion"])
def test_decode_plan_follows_every_change(pde, decode_plan_calls):
    """The prepared decode launch (``_DecodePlan``, GPU only) against the reference module, token by token, across
    everything that must make it stand aside: a coefficient updated in place and one replaced, a second cache, a
    beam reorder of the state, another batch size, strided tokens, and a step under autograd. On GPU it must also
    have run."""
    import gc

    from torch import nn
    from transformers import DynamicCache

    import cta.triton_cta as kernels

    channels, steps = 40, 4
    config, modules = _decode_module_pair(channels, pde, steps)
    planned = decode_plan_calls
    gen = torch.Generator().manual_seed(5)

    def generation(batch, tokens, edit=None, reorder_at=None, strided=False):
        x = torch.randn(batch, 8 + tokens, channels, generator=gen).to(DEVICE)
        caches = {b: DynamicCache(config=config) for b in modules}
        for b, m in modules.items():
            m(x[:, :8], None, caches[b])
        for t in range(8, 8 + tokens):
            if t == 10 and edit is not None:
                for m in modules.values():
                    edit(m)
            if t == reorder_at:
                beams = torch.arange(batch - 1, -1, -1, device=DEVICE)
                for cache in caches.values():
                    cache.reorder_cache(beams)
            token = x[:, t:t + 1] if strided else x[:, t:t + 1].contiguous()  # a strided view never plans
            outs = {b: m(token, None, caches[b]) for b, m in modules.items()}
            torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(caches["triton"].layers[0].conv_states[0],
                                       caches["torch"].layers[0].conv_states[0], rtol=1e-5, atol=1e-6)

    with torch.no_grad():
        generation(2, 5, edit=lambda m: m.alpha.mul_(0.5))  # in-place update (what an optimizer does)
        generation(2, 5, edit=lambda m: setattr(m, "alpha", nn.Parameter(m.alpha.detach() * 0.5)))
        generation(3, 6, reorder_at=11)  # a new cache and batch size, then a beam reorder
        generation(3, 4, strided=True)
    x = torch.randn(3, 9, channels, generator=gen).to(DEVICE)
    caches = {b: DynamicCache(config=config) for b in modules}
    grads = {}
    for b, m in modules.items():  # autograd: never the plan, and the gradient flows
        with torch.no_grad():
            m(x[:, :8], None, caches[b])
        token = x[:, 8:].clone().requires_grad_(True)
        m(token, None, caches[b]).square().sum().backward()
        grads[b] = token.grad
    torch.testing.assert_close(grads["triton"], grads["torch"], rtol=1e-5, atol=1e-6)
    plan = modules["triton"].__dict__.get("_decode_plan")
    if ON_GPU and kernels.DIRECT_LAUNCH:
        assert sum(planned) >= 8, planned  # most decode steps took the prepared launch
        launchers = [launcher for key, (_, launcher) in kernels._COMPILED.items()
                     if key[0] is kernels._pde_decode_kernel]
        # Triton 3.6: through the launcher's C function (RAW_C_LAUNCH); the parity above is then that path's.
        assert launchers and all(hasattr(launcher, "c_launch") == kernels.RAW_C_LAUNCH for launcher in launchers)
        assert not all(planned)  # and it stood aside where it had to
        gc.collect()
        assert plan is not None and plan.state() is None  # the finished caches' states were not kept alive
        modules["triton"].steps = steps  # setting any attribute of the module drops its plan
        assert "_decode_plan" not in modules["triton"].__dict__
        # A Triton launch hook (what profilers install) added while plans are bound sees every prepared launch,
        # and once removed, the prepared launches skip the hooks again.
        runtime, names = kernels.triton.knobs.runtime, []

        def hook(metadata):
            names.append(getattr(metadata, "data", {}).get("name"))

        chain = runtime.launch_enter_hook
        with torch.no_grad():
            generation(2, 4)
            if hasattr(chain, "add"):
                chain.add(hook)
            else:
                runtime.launch_enter_hook = hook
            try:
                generation(2, 4)
            finally:
                if hasattr(chain, "add"):
                    chain.remove(hook)
                else:
                    runtime.launch_enter_hook = chain
            decode_launches = names.count(kernels._pde_decode_kernel.__name__)
            generation(2, 4)
        assert decode_launches >= 3, names
        assert names.count(kernels._pde_decode_kernel.__name__) == decode_launches
    else:
        assert plan is None and not any(planned)  # no direct launch on the interpreter: no plan


def test_stream_config_per_channel_entries():
    """On CUDA the launch configuration comes from the tuned table at the nearest tuned step count, with the
    per-channel table's entry instead where it has one (and only for a per-channel coefficient); the interpreter
    ignores both. (Only the table lookup: no kernel runs.)"""
    from cta import triton_cta

    cuda = torch.device("cuda")
    shared = triton_cta._STREAM_DEFAULTS[("bwd", False)]
    for steps, tuned in ((3, 2), (4, 4), (5, 4), (6, 4), (7, 8)):  # (ties: the smaller)
        own = triton_cta._STREAM_DEFAULTS_PER_CHANNEL.get(("bwd", False), {}).get(tuned, shared[tuned])
        assert triton_cta._stream_config(16384, 4096, steps, False, "bwd", cuda)[:4] == shared[tuned][:4]
        assert triton_cta._stream_config(16384, 4096, steps, False, "bwd", cuda, per_channel=True)[:4] == own[:4]
    assert triton_cta._STREAM_DEFAULTS_PER_CHANNEL[("bwd", False)][4] != shared[4]  # the entry that differs
    cpu = triton_cta._stream_config(100, 60, 4, False, "bwd", torch.device("cpu"), per_channel=True)
    assert cpu[:2] == (100, 64)


def test_walk_prefetch_depth_is_capped():
    """A configuration's prefetch depth above ``WALK_MAX_PREFETCH`` (measured on the filters' unrolled loops) reaches
    the filters only: the walk (a padding mask, every program) is generated as with the cap, while the filter's
    loop (no mask) prefetches the configured rows."""
    from cta import triton_cta

    cap = triton_cta.WALK_MAX_PREFETCH
    for kind in ("fwd", "bwd"):
        walk = [triton_cta._stream_source("k", kind, "diffusion", False, 4, d, True, True, False, False, False, True, 8)
                for d in (cap, cap + 5)]
        assert walk[0] == walk[1]
        fir = triton_cta._stream_source("k", kind, "diffusion", False, 4, cap + 5, False, True, False, False, False,
                                        True, 8, 0, 2)
        assert f"xf{cap + 4} = " in fir and f"xf{cap + 5} = " not in fir


@needs_kernels
@pytest.mark.parametrize("causal", [False, True], ids=["bidi", "causal"])
def test_fir_pointer_steps_match_indexed(monkeypatch, launched_kernels, causal):
    """The interior filters that step their row pointers (``FIR_POINTER_STEPS``) give the same outputs and gradients,
    bit for bit, as those that address rows by index (only the addressing differs), over several interior programs
    per sequence; the default steps per channel in the forwards and the bidirectional backward only."""
    from cta import triton_cta

    tune = {(kind, causal, 3): (8, 16, 1, 2, 8) for kind in ("fwd", "bwd")}
    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", tune)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 61, 32, generator=gen).to(DEVICE)
    grad = torch.randn(2, 61, 32, generator=gen).to(DEVICE)
    every = {(kind, c, vec) for kind in ("fwd", "bwd") for c in (False, True) for vec in (False, True)}
    for per_channel in (True, False):
        alpha = (0.05 + 0.2 * torch.rand((32,) if per_channel else (), generator=gen)).to(DEVICE)
        runs = []
        for steps_set in (every, set()):
            monkeypatch.setattr(triton_cta, "FIR_POINTER_STEPS", steps_set)
            launched_kernels.clear()
            runs.append(_run(pde_refine_triton, x, alpha, None, grad, pde_type="diffusion", steps=3, causal=causal))
            assert [key[15] for key in launched_kernels] == [bool(steps_set)] * 2
        for got, want in zip(runs[0][:3], runs[1][:3]):
            assert torch.equal(got, want)
    monkeypatch.undo()
    src = triton_cta._stream_source("k", "fwd", "diffusion", causal, 3, 2, False, True, False, False, False, True, 8,
                                    0, 2, False, True)
    assert "x_at += sxl" in src and "y_at += C" in src
    defaults = triton_cta.FIR_POINTER_STEPS
    assert ("fwd", causal, True) in defaults and (("bwd", causal, True) in defaults) == (not causal)
    assert ("fwd", causal, False) not in defaults and ("bwd", causal, False) not in defaults


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ends", ["walk", "filter"])
def test_static_rows_widening_and_tile_order_match(monkeypatch, launched_kernels, causal, ends):
    """Three ways of running the same register filters give the same outputs and input gradients, bit for bit: the
    channels and row strides as constexprs (``STATIC_ROWS``) or as arguments, the bf16 rows widened by
    ``_widen``'s shift and mask or by a conversion (``FIR_WIDEN_ASM``; the interpreter always converts), and the last
    row tile run second or in order (``LAST_TILE_SECOND``), with end programs that walk or that filter (the walls'
    rolled loop). The coefficient's gradient sums the programs in another order when the tiles move, so it is
    compared to rounding."""
    from cta import triton_cta

    tune = {(kind, causal, 3): (8, 16, 1, 2, 8) for kind in ("fwd", "bwd")}
    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", tune)
    limit = 0 if ends == "walk" else triton_cta.MAX_FUSED_STEPS
    monkeypatch.setattr(triton_cta, "WALLS_MAX_STEPS_PER_CHANNEL",
                        dict.fromkeys(triton_cta.WALLS_MAX_STEPS_PER_CHANNEL, limit))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 61, 32, generator=gen).to(DEVICE, torch.bfloat16)
    grad = torch.randn(2, 61, 32, generator=gen).to(DEVICE)
    alpha = (0.05 + 0.2 * torch.rand(32, generator=gen)).to(DEVICE)
    every = {(kind, causal, True) for kind in ("fwd", "bwd")}
    both = frozenset((kind, causal, True) for kind in ("fwd", "bwd"))
    runs = []
    with deterministic_algorithms(True):
        for static, widen, order in itertools.product((every, set()), (True, False), (both, frozenset())):
            monkeypatch.setattr(triton_cta, "STATIC_ROWS", static)
            monkeypatch.setattr(triton_cta, "FIR_WIDEN_ASM", widen)
            monkeypatch.setattr(triton_cta, "LAST_TILE_SECOND", order)
            launched_kernels.clear()
            runs.append(_run(pde_refine_triton, x, alpha, None, grad, pde_type="diffusion", steps=3, causal=causal))
            assert [key[16] for key in launched_kernels] == [bool(static)] * 2
            assert [key[13] for key in launched_kernels] == [0 if ends == "walk" else 2] * 2
            src = triton_cta._stream_source("k", *launched_kernels[0])  # (the module's switches as launched)
            assert ("tile = tl.where" in src) == bool(order)
            assert (", C: tl.constexpr" in src) == bool(static)
            assert ("_widen(" in src) == widen
    for got in runs[1:]:
        assert torch.equal(got[0], runs[0][0]) and torch.equal(got[1], runs[0][1])
        torch.testing.assert_close(got[2], runs[0][2], rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    assert ("fwd", False, True) in triton_cta.STATIC_ROWS and ("fwd", True, True) not in triton_cta.STATIC_ROWS
    assert triton_cta.LAST_TILE_SECOND == {("bwd", True, True), ("bwd", False, True), ("fwd", True, True)}


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_taps_table_matches_computed_taps(monkeypatch, launched_kernels, causal):
    """Per-channel filters that load their taps from the table ``_taps_kernel`` writes (``TAPS_TABLE``) give the same
    outputs and gradients, bit for bit, as those that compute the taps themselves (the same operations), at several
    step counts; with a padding mask no table is written (the walk has no taps)."""
    from cta import triton_cta

    tune = {(kind, causal, steps): (8, 16, 1, 2, 8) for kind in ("fwd", "bwd") for steps in (1, 2, 5)}
    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", tune)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 45, 32, generator=gen).to(DEVICE)
    grad = torch.randn(2, 45, 32, generator=gen).to(DEVICE)
    alpha = (0.05 + 0.2 * torch.rand(32, generator=gen)).to(DEVICE)
    every = {(kind, c) for kind in ("fwd", "bwd") for c in (False, True)}
    with deterministic_algorithms(True):
        for steps in (1, 2, 5):
            runs = []
            for table in (every, set()):
                monkeypatch.setattr(triton_cta, "TAPS_TABLE", table)
                launched_kernels.clear()
                runs.append(_run(pde_refine_triton, x, alpha, None, grad, pde_type="diffusion", steps=steps,
                                 causal=causal))
                # the backward's filter has steps - 1 levels: none at 1 step
                assert [key[17] for key in launched_kernels] == [bool(table), bool(table) and steps > 1]
            for got, want in zip(runs[0][:3], runs[1][:3]):
                assert torch.equal(got, want)
        monkeypatch.setattr(triton_cta, "TAPS_TABLE", every)
        launched_kernels.clear()
        mask = torch.ones(2, 45, dtype=torch.long, device=DEVICE)
        pde_refine_triton(x, alpha=alpha, pde_type="diffusion", steps=2, causal=causal, attention_mask=mask)
        assert [key[17] for key in launched_kernels] == [False]
    taps = triton_cta._fir_taps_table(alpha, 3, causal)
    stencil = ([1.0 - alpha.double(), alpha.double()] if causal
               else [alpha.double(), 1.0 - 2.0 * alpha.double(), alpha.double()])
    poly = torch.ones(1, 32, dtype=torch.float64, device=DEVICE)
    for _ in range(3):  # the stencil convolved with itself three times, per channel
        nxt = torch.zeros(poly.shape[0] + len(stencil) - 1, 32, dtype=torch.float64, device=DEVICE)
        for i, weight in enumerate(stencil):
            nxt[i:i + poly.shape[0]] += weight * poly
        poly = nxt
    want = poly if causal else poly[3:]  # causal: taps at offsets 0..-3; bidirectional: offsets 0..3 of a symmetric one
    torch.testing.assert_close(taps.double(), want, rtol=1e-6, atol=1e-7)


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
    args = (gy, x, alpha, b, None, None, triton_cta._PDE_IDS[pde], 3, causal)
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
def test_per_channel_coefficient_gradient_paths(monkeypatch, launched_kernels, pde, causal, deterministic):
    """A per-channel coefficient's gradient is summed with atomics into a few rows, or, under
    ``torch.use_deterministic_algorithms(True)`` (or ``COEF_GRAD_ATOMIC`` off), as partial sums per program reduced
    afterwards: both equal the reference's gradient, over several programs per sequence (8-row tiles: 10 programs
    with a batch of two) sharing one row, 4 rows in turn, or one row each; a scalar coefficient never takes the
    atomics."""
    from cta import triton_cta

    monkeypatch.setattr(triton_cta, "_STREAM_TUNE", {("bwd", causal, 3): (8, 16, 1, 2, 1)})
    monkeypatch.setattr(triton_cta, "COEF_GRAD_ATOMIC", True)
    with deterministic_algorithms(deterministic):
        for spread, rows in ((16, 1), (48, 4), (8192, 10)):
            monkeypatch.setattr(triton_cta, "COEF_GRAD_ATOMIC_SPREAD", spread)
            assert triton_cta._coef_grad_groups(16, 10) == rows
            for per_channel in (True, False):
                launched_kernels.clear()
                check_parity(pde, causal, 37, 16, 3, "none", per_channel, batch=2, seed=11)
                atomic = [key[14] for key in launched_kernels if key[0] == "bwd"]
                assert atomic == [per_channel and not deterministic], atomic
    monkeypatch.setattr(triton_cta, "COEF_GRAD_ATOMIC", False)
    launched_kernels.clear()
    check_parity(pde, causal, 37, 16, 3, "left", True, batch=2, seed=12)  # (the walk's programs, with a mask)
    assert [key[14] for key in launched_kernels if key[0] == "bwd"] == [False]


@needs_kernels
@pytest.mark.parametrize("rows,channels", [(1, 1), (3, 129), (8, 700)])
def test_sum_rows_kernel_matches_torch(rows, channels):
    """``_sum_rows`` (the coefficient gradient's atomic rows summed by ``_sum_rows_kernel``, over one or more blocks of
    channels) equals the float64 sum of the rows to fp32 rounding, and torch's ``sum(0)`` likewise."""
    from cta import triton_cta

    gen = torch.Generator().manual_seed(rows * 1000 + channels)
    values = torch.randn(rows, channels, generator=gen).to(DEVICE)
    got = triton_cta._sum_rows(values)
    assert got.shape == (channels,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), values.double().sum(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, values.sum(0), rtol=1e-6, atol=1e-6)


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
    rows=st.sampled_from([8, 16, 32]),
    unroll=st.sampled_from([1, 2]),
    per_channel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parity_hypothesis_filters(pde_causal, batch, seq, channels, steps, rows, unroll, per_channel, seed):
    """The banded filters, interior and at the sequence ends (whole channel blocks, no padding: the inputs the
    randomised test above seldom draws), with random program lengths, so that the ends fall anywhere in a program."""
    from cta import triton_cta

    tune = {(kind, causal, s): (rows, 16, 1, 2, unroll)
            for kind in ("fwd", "bwd") for causal in (False, True) for s in range(1, 17)}
    pde, causal = pde_causal
    with pytest.MonkeyPatch.context() as patch:  # (hypothesis runs the body several times per fixture)
        patch.setattr(triton_cta, "_STREAM_TUNE", tune)
        check_parity(pde, causal, seq, channels, steps, "none", per_channel, batch=batch, seed=seed)
