# coding=utf-8
"""The CPU kernel of :func:`pde_cta.pde_decode_update`: one decoded token of every sequence in one C++ call.

On the CPU a decoded token is host-bound: each torch op of the decode step costs it microseconds, and inside a model
(vLLM's engine, ``generate()``) several times what it costs in a tight loop. This kernel runs a site's whole update
in one call: read each sequence's state (a slot of a state table where ``state_indices`` is given, as vLLM keeps it),
the ``steps`` levels of the scheme's causal recurrence, the state written back, the refined token returned.

* The C++ source is generated from the registered :class:`pde_spec.PDEScheme` s without a reaction (diffusion, wave,
  advection-diffusion), as the Triton kernels are. The recurrence is :func:`pde_decode.decode_update_torch`'s, with
  ``torch.lerp``'s formula (``fma``, as ATen's vectorized lerp), so the result equals the torch ops' to the last bit or
  one rounding. A scheme with a reaction keeps the torch ops: libm's scalar ``tanh`` costs more than ATen's vectorized
  one saves (:func:`pde_cta.choose_backend`).
* The coefficients are projected onto their bounds inside the call (no clamp op per token).
* Built on first use with ``torch.utils.cpp_extension`` (about 30 s once; cached by torch, per source and CPU
  capability), vectorized for the CPU torch reports (AVX2 / AVX-512 with FMA). ``CTA_CPU_KERNEL=0`` turns it off;
  where it cannot build (no C++ compiler), the torch ops serve and a warning says so once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from functools import lru_cache
from typing import Optional

import torch

from .pde_spec import SCHEMES, WAVE_DAMPING, project_coefficients

logger = logging.getLogger(__name__)
ENV_SWITCH = "CTA_CPU_KERNEL"
STATE_DTYPES = (torch.float32, torch.float64)

_KERNEL = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <vector>

#define CTA_INLINE inline __attribute__((always_inline))

// torch.lerp as ATen's vectorized kernel computes it
template <typename T> static CTA_INLINE T lerp(T a, T b, T w) {
  const T d = b - a, low = std::fma(w, d, a), high = std::fma(w - T(1), d, b);  // (both: a select vectorizes)
  return std::abs(w) < T(0.5) ? low : high;
}

// The levels u_1 .. u_S of one sequence (u = x on entry, the refined token on exit); cell s holds the step-s iterate
// at the previous position and receives u_s. (The stored row is copied to `value` first: the arithmetic loop then
// reads and writes only local buffers, which the compiler vectorizes without aliasing checks.)
template <typename T, typename Scheme, bool PER_CHANNEL>
static void recurrence(T* __restrict__ u, T* __restrict__ value, T* __restrict__ velocity, T* const* cells,
                       const int64_t* channel_strides, const T* __restrict__ w, const T* __restrict__ b,
                       int64_t steps, int64_t channels) {
  const T w0 = w[0], b0 = b[0];
  for (int64_t s = 0; s < steps; ++s) {
    T* cell = cells[s];
    const int64_t stride = channel_strides[s];
    if (stride == 1) {
      std::copy(cell, cell + channels, value);
      std::copy(u, u + channels, cell);
    } else {
      for (int64_t c = 0; c < channels; ++c) { value[c] = cell[c * stride]; cell[c * stride] = u[c]; }
    }
    const bool first = s == 0;
    for (int64_t c = 0; c < channels; ++c)
      u[c] = Scheme::step(u[c], value[c], PER_CHANNEL ? w[c] : w0, PER_CHANNEL ? b[c] : b0, velocity[c], first);
  }
}

template <typename T, typename Scheme, bool PER_CHANNEL>
static void run(const T* x, int64_t x_stride, T* y, const std::vector<T*>& bases, const std::vector<int64_t>& seq,
                const std::vector<int64_t>& chan, const int64_t* indices, const T* mask,
                const T* w, const T* b, int64_t batch, int64_t steps, int64_t channels) {
  std::vector<T> u(channels), value(channels), velocity(channels);
  std::vector<T*> cells(steps);
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t slot = indices ? indices[i] : i;
    for (int64_t s = 0; s < steps; ++s) cells[s] = bases[s] + slot * seq[s];
    const T* xi = x + i * x_stride;
    T* yi = y + i * channels;
    if (mask && mask[i] == T(0)) {  // padding: returned unchanged, a wall as its state
      std::copy(xi, xi + channels, yi);
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t c = 0; c < channels; ++c) cells[s][c * chan[s]] = T(0);
      continue;
    }
    std::copy(xi, xi + channels, u.data());
    recurrence<T, Scheme, PER_CHANNEL>(u.data(), value.data(), velocity.data(), cells.data(), chan.data(), w, b,
                                       steps, channels);
    std::copy(u.begin(), u.end(), yi);
  }
}

%(schemes)s

// x: [batch, channels] in the state's dtype, contiguous channels. levels: one tensor [rows, steps, channels(, 1)]
// (whole) or `steps` tensors [rows, 1, channels(, 1)]. alpha, beta: the raw coefficients (1 or `channels` values,
// contiguous; beta = alpha where the scheme has none), projected here onto their bounds; advection steps with
// alpha + beta. Returns the refined tokens [batch, channels].
at::Tensor decode_update(at::Tensor x, std::vector<at::Tensor> levels, bool whole, c10::optional<at::Tensor> indices,
                         c10::optional<at::Tensor> mask, at::Tensor alpha, at::Tensor beta, double alpha_low,
                         double alpha_high, double beta_low, double beta_high, bool advection, int64_t scheme,
                         int64_t steps) {
  const int64_t batch = x.size(0), channels = x.size(1);
  at::Tensor y = at::empty({batch, channels}, x.options());
  std::vector<int64_t> seq(steps), chan(steps);
  const at::Tensor& first = levels[0];
  const int64_t table = first.size(0);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "cta_pde_decode_update", [&] {
    std::vector<scalar_t*> bases(steps);
    for (int64_t s = 0; s < steps; ++s) {
      const at::Tensor& level = whole ? first : levels[s];
      bases[s] = level.data_ptr<scalar_t>() + (whole ? s * level.stride(1) : 0);
      seq[s] = level.stride(0);
      chan[s] = level.stride(2);
    }
    const int64_t* index = indices ? indices->data_ptr<int64_t>() : nullptr;
    for (int64_t i = 0; index && i < batch; ++i)
      TORCH_CHECK(index[i] >= 0 && index[i] < table, "state_indices: entry ", i, " is ", index[i],
                  ", outside the state's ", table, " rows");
    const scalar_t* keep = mask ? mask->data_ptr<scalar_t>() : nullptr;
    const bool per_channel = alpha.numel() > 1 || beta.numel() > 1;
    const int64_t n = per_channel ? channels : 1;
    std::vector<scalar_t> w(n), b(n);
    const scalar_t* a_in = alpha.data_ptr<scalar_t>();
    const scalar_t* b_in = beta.data_ptr<scalar_t>();
    for (int64_t c = 0; c < n; ++c) {
      const scalar_t a = std::min(std::max(a_in[alpha.numel() > 1 ? c : 0], scalar_t(alpha_low)), scalar_t(alpha_high));
      b[c] = std::min(std::max(b_in[beta.numel() > 1 ? c : 0], scalar_t(beta_low)), scalar_t(beta_high));
      // (as the torch step adds them: in the tensors' dtype, or as Python numbers for scalars)
      w[c] = !advection ? a : per_channel ? scalar_t(a + b[c]) : scalar_t(double(a) + double(b[c]));
    }
    const scalar_t* wp = w.data();
    const scalar_t* bp = b.data();
    switch (scheme) {
%(cases)s
      default: TORCH_CHECK(false, "cta: no CPU decode kernel for scheme ", scheme);
    }
  });
  return y;
}
"""

_CASE = """      case %(id)d:
        if (per_channel)
          run<scalar_t, Scheme%(id)d, true>(x.data_ptr<scalar_t>(), x.stride(0), y.data_ptr<scalar_t>(), bases, seq,
                                            chan, index, keep, wp, bp, batch, steps, channels);
        else
          run<scalar_t, Scheme%(id)d, false>(x.data_ptr<scalar_t>(), x.stride(0), y.data_ptr<scalar_t>(), bases, seq,
                                             chan, index, keep, wp, bp, batch, steps, channels);
        break;"""


def _scheme_struct(index: int, scheme) -> str:
    """One linear scheme's causal step ``u_{s+1}(u_s, stored value, w)`` in C++: the recurrence of
    ``pde_decode._levels`` (``w`` already ``alpha + beta`` for advection)."""
    if scheme.wave:
        body = (f"const T pull = value - old;\n"
                f"    velocity = first ? w * pull : T({1.0 - WAVE_DAMPING!r}) * velocity + w * pull;\n"
                f"    return old + velocity;")
    else:
        body = "return lerp(old, value, w);"
    return (f"struct Scheme{index} {{  // {scheme.name}\n"
            f"  template <typename T> static CTA_INLINE T step(T old, T value, T w, T b, T& velocity, bool first) {{\n"
            f"    (void)b; (void)velocity; (void)first;\n    {body}\n  }}\n}};")


def cpp_source() -> str:
    """The kernel's C++ source for the registered schemes without a reaction (scheme id = registration index)."""
    linear = [i for i, scheme in enumerate(SCHEMES.values()) if scheme.reaction is None]
    schemes = list(SCHEMES.values())
    structs = "\n\n".join(_scheme_struct(i, schemes[i]) for i in linear)
    cases = "\n".join(_CASE % dict(id=i) for i in linear)
    return _KERNEL % dict(schemes=structs, cases=cases)


def _compiler_flags() -> list:
    """Vectorize for the capability torch's own CPU kernels use here (FMA included: lerp's rounding is ATen's)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fno-trapping-math"]  # (no FP traps: the per-channel selects vectorize)
    if capability.startswith("AVX512"):
        flags += ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]
    elif capability == "AVX2":
        flags += ["-mavx2", "-mfma"]
    return flags


@lru_cache(maxsize=4)
def _build(source: str, flags: tuple):
    """The extension module of ``source`` (built once per source and flags; torch caches the build on disk), or None
    with a warning where it cannot build."""
    from torch.utils.cpp_extension import load_inline

    digest = hashlib.sha256((source + repr(flags) + torch.__version__).encode()).hexdigest()[:12]
    start = time.time()
    logger.info("cta: building the CPU decode kernel (once, about 30 s; %s=0 skips it)", ENV_SWITCH)
    try:
        module = load_inline(f"cta_cpu_decode_{digest}", cpp_sources=source, functions=["decode_update"],
                             extra_cflags=list(flags), verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: the torch ops serve
        logger.warning("cta: the CPU decode kernel did not build (%s: %s); decoding with torch ops instead (set "
                       "%s=0 to skip the attempt).", type(error).__name__, str(error).splitlines()[0][:200],
                       ENV_SWITCH)
        return None
    logger.info("cta: CPU decode kernel ready in %.0f s", time.time() - start)
    return module


def kernel():
    """The built extension, or None where it is off (``CTA_CPU_KERNEL=0``, read once per process), unsupported (not
    Linux / macOS) or does not build."""
    return _kernel(len(SCHEMES))


@lru_cache(maxsize=4)
def _kernel(schemes: int):
    """(per number of registered schemes: a scheme registered later gets a kernel that has it)"""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not sys.platform.startswith(("linux", "darwin")):
        return None
    return _build(cpp_source(), tuple(_compiler_flags()))


def decode_update(hidden_states: torch.Tensor, state, *, pde_type: str, steps: int, alpha: torch.Tensor,
                  beta: Optional[torch.Tensor], bounds, token_mask: Optional[torch.Tensor] = None,
                  state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's call behind :func:`pde_cta.pde_decode_update` (arguments checked there, ``pde_type`` canonical;
    ``state`` fp32 / fp64 on the CPU, a tensor or its level buffers; :func:`kernel` built). Returns the refined token in
    the input's shape and dtype."""
    whole = isinstance(state, torch.Tensor)
    dtype = state.dtype if whole else state[0].dtype
    batch, channels = hidden_states.shape[0], hidden_states.shape[-1]
    x = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(batch, channels)
    if x.dtype != dtype:
        x = x.to(dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if alpha.dtype != dtype:  # (projected in their own dtype first, as the torch step does)
        alpha, beta = project_coefficients(alpha, beta, bounds)
        alpha, beta, bounds = alpha.to(dtype), (None if beta is None else beta.to(dtype)), None
    a_low, a_high, b_low, b_high = _bounds(bounds)
    mask = None if token_mask is None else token_mask.reshape(batch).to(dtype)
    if state_indices is not None and state_indices.dtype != torch.int64:
        state_indices = state_indices.long()
    scheme_id, advection = _scheme_of(pde_type, len(SCHEMES))
    refined = kernel().decode_update(x, [state] if whole else list(state), whole, state_indices, mask,
                                     alpha.contiguous(), alpha if beta is None else beta.contiguous(), a_low, a_high,
                                     b_low, b_high, advection, scheme_id, steps)
    if refined.dtype != hidden_states.dtype:
        refined = refined.to(hidden_states.dtype)
    return refined if refined.dim() == hidden_states.dim() else refined.reshape(hidden_states.shape)


@lru_cache(maxsize=None)  # (one entry per registered scheme)
def _scheme_of(pde_type: str, schemes: int):
    """``(scheme id, advection)`` of a canonical ``pde_type``: its registration index, as the source numbers it."""
    return list(SCHEMES).index(pde_type), SCHEMES[pde_type].advection


def _bounds(bounds):
    """``(alpha_low, alpha_high, beta_low, beta_high)`` as numbers (infinite where unbounded)."""
    if bounds is None:
        return _UNBOUNDED
    alpha, beta = bounds
    return (alpha[0], alpha[1]) + (_UNBOUNDED[:2] if beta is None else (beta[0], beta[1]))


_UNBOUNDED = (-float("inf"), float("inf"), -float("inf"), float("inf"))
