# coding=utf-8
"""The CPU kernel of :func:`pde_cta.pde_decode_update`: one decoded token of every sequence in one C++ call.

On the CPU a decoded token is host-bound: each torch op of the decode step costs it microseconds, and inside a model
(vLLM's engine, ``generate()``) several times what it costs in a tight loop. This kernel runs a site's whole update
in one call: read each sequence's state (a slot of a state table where ``state_indices`` is given, as vLLM keeps it),
the ``steps`` levels of the scheme's causal recurrence, the state written back, the refined token returned.

* The C++ source is generated from the registered :class:`pde_spec.PDEScheme` s, as the Triton kernels are. The
  recurrence is :func:`pde_decode.decode_update_torch`'s, with ``torch.lerp``'s formula (``fma``, as ATen's vectorized
  lerp), so the result equals the torch ops' to the last bit or one rounding. A reaction is written in C++ from its
  expression (:func:`cpp_reaction`), ``tanh(u)`` computed by ATen's vectorized ``tanh`` once per level for the whole
  batch (libm's scalar ``tanh`` would cost more than the kernel saves); a reaction it cannot write keeps the torch ops
  (:func:`runs`).
* The coefficients are projected onto their bounds inside the call (no clamp op per token).
* Built on first use with ``torch.utils.cpp_extension`` (about 30 s once; cached by torch, per source and CPU
  capability), vectorized for the CPU torch reports (AVX2 / AVX-512 with FMA). ``CTA_CPU_KERNEL=0`` turns it off;
  where it cannot build (no C++ compiler), the torch ops serve and a warning says so once.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import re
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

// Every sequence's levels u_1 .. u_S, level by level: y holds u (x on entry, the refined tokens on exit); cell s of a
// sequence holds its step-s iterate at the previous position and receives u_s. A scheme whose reaction reads f = tanh(u)
// gets it from ATen's vectorized tanh, once per level for the whole batch (its result is the torch step's). A cell with
// contiguous channels is swapped and stepped in one pass (a served token's states are cold: each pass over them
// costs); a strided one (a transformers cache's view) is copied to `value` first.
template <typename T, typename Scheme, bool PER_CHANNEL>
static void run(const T* x, int64_t x_stride, at::Tensor& out, const std::vector<T*>& bases,
                const std::vector<int64_t>& seq, const std::vector<int64_t>& chan, const int64_t* indices,
                const T* mask, const T* __restrict__ w, const T* __restrict__ b, int64_t batch, int64_t steps,
                int64_t channels) {
  T* y = out.data_ptr<T>();
  at::Tensor tanh_u = Scheme::reads_tanh ? at::empty_like(out) : at::Tensor();
  const T* f = Scheme::reads_tanh ? tanh_u.data_ptr<T>() : nullptr;
  std::vector<T> value, velocity(Scheme::wave ? batch * channels : 0);  // (value: strided cells only)
  const T w0 = w[0], b0 = b[0];
  for (int64_t i = 0; i < batch; ++i) {
    const T* xi = x + i * x_stride;
    std::copy(xi, xi + channels, y + i * channels);
    if (mask && mask[i] == T(0)) {  // padding: returned unchanged, a wall as its state
      const int64_t slot = indices ? indices[i] : i;
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t c = 0; c < channels; ++c) bases[s][slot * seq[s] + c * chan[s]] = T(0);
    }
  }
  for (int64_t s = 0; s < steps; ++s) {
    if (Scheme::reads_tanh) at::tanh_out(tanh_u, out);
    const bool first = s == 0;
    for (int64_t i = 0; i < batch; ++i) {
      if (mask && mask[i] == T(0)) continue;
      T* __restrict__ u = y + i * channels;
      T* cell = bases[s] + (indices ? indices[i] : i) * seq[s];
      const int64_t stride = chan[s];
      const T* __restrict__ fi = Scheme::reads_tanh ? f + i * channels : nullptr;
      T* __restrict__ vi = Scheme::wave ? velocity.data() + i * channels : nullptr;
      if (stride == 1) {  // (the cell and the tokens never overlap: one pass swaps the row and steps)
        T* __restrict__ stored = cell;
        for (int64_t c = 0; c < channels; ++c) {
          const T old = u[c], previous = stored[c];
          stored[c] = old;
          u[c] = Scheme::step(old, previous, PER_CHANNEL ? w[c] : w0, PER_CHANNEL ? b[c] : b0,
                              Scheme::wave ? vi[c] : u[c], first, Scheme::reads_tanh ? fi[c] : T(0));
        }
        continue;
      }
      value.resize(channels);
      for (int64_t c = 0; c < channels; ++c) { value[c] = cell[c * stride]; cell[c * stride] = u[c]; }
      const T* __restrict__ v = value.data();
      for (int64_t c = 0; c < channels; ++c)
        u[c] = Scheme::step(u[c], v[c], PER_CHANNEL ? w[c] : w0, PER_CHANNEL ? b[c] : b0,
                            Scheme::wave ? vi[c] : u[c], first, Scheme::reads_tanh ? fi[c] : T(0));
    }
  }
}

%(schemes)s

// hidden: [batch, channels] or [batch, 1, channels], any floating dtype (computed in the state's). levels: one tensor
// [rows, steps, channels(, 1)] (whole) or `steps` tensors [rows, 1, channels(, 1)]. indices: integers, mask: numbers
// (0: padding), one per sequence. alpha, beta: the raw coefficients (1 or `channels` values; beta = alpha where the
// scheme has none), in the state's dtype, projected here onto their bounds; advection steps with alpha + beta.
// Returns the refined tokens in hidden's shape and dtype, written into `out_in` where given (hidden's shape and dtype,
// not overlapping it). (Every conversion is here, not in Python: on the CPU each Python-side op costs a decoded token
// microseconds.)
at::Tensor decode_update(at::Tensor hidden, std::vector<at::Tensor> levels, bool whole,
                         c10::optional<at::Tensor> indices_in, c10::optional<at::Tensor> mask_in, at::Tensor alpha,
                         at::Tensor beta, double alpha_low, double alpha_high, double beta_low, double beta_high,
                         bool advection, int64_t scheme, int64_t steps, c10::optional<at::Tensor> out_in) {
  const at::Tensor& first = levels[0];
  const int64_t batch = hidden.size(0), channels = hidden.size(-1), table = first.size(0);
  // (each conversion only where it changes something: a dispatched no-op costs a served token microseconds per site)
  at::Tensor x = hidden.dim() == 2 ? hidden : hidden.reshape({batch, channels});
  if (x.scalar_type() != first.scalar_type()) x = x.to(first.scalar_type());
  if (x.stride(1) != 1) x = x.contiguous();
  alpha = alpha.contiguous();
  beta = beta.contiguous();
  c10::optional<at::Tensor> indices, mask;
  if (indices_in) indices = indices_in->scalar_type() == at::kLong ? indices_in->contiguous()
                                                                    : indices_in->to(at::kLong).contiguous();
  if (mask_in) {
    at::Tensor m = mask_in->dim() == 1 ? *mask_in : mask_in->reshape({batch});
    mask = (m.scalar_type() == first.scalar_type() ? m : m.to(first.scalar_type())).contiguous();
  }
  // (u while the levels run: the caller's buffer where it can hold it, a served site's output)
  const bool direct = out_in && out_in->scalar_type() == x.scalar_type() && out_in->is_contiguous();
  at::Tensor y = direct ? out_in->view({batch, channels}) : at::empty({batch, channels}, x.options());
  std::vector<int64_t> seq(steps), chan(steps);
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
  if (out_in) {
    if (!direct) out_in->copy_(y.view(hidden.sizes()));
    return *out_in;
  }
  if (y.scalar_type() != hidden.scalar_type()) y = y.to(hidden.scalar_type());
  return hidden.dim() == 2 ? y : y.view(hidden.sizes());
}

// The causal filter schemes' prefill (pde_filters): out[b, t] = sum_k taps[S][k] x[b, t - k] over k <= t, accumulated
// in the order of the torch ops it replaces (x * taps[0], then one fused multiply-add per tap: ATen's vectorized add_
// with alpha), in one pass over x instead of one per tap; and, where `final_state`, the levels 0 .. S-1 at the last
// position (level s: taps[s]), as [batch, S, channels]. x: [batch, length, channels], fp32 or fp64, length > S.
// out_in: where given, the output (x's shape and dtype, contiguous, not overlapping x).
std::vector<at::Tensor> causal_filter(at::Tensor x, std::vector<std::vector<double>> taps, bool final_state,
                                      c10::optional<at::Tensor> out_in) {
  x = x.contiguous();
  const int64_t batch = x.size(0), length = x.size(1), channels = x.size(2);
  const int64_t steps = static_cast<int64_t>(taps.size()) - 1;
  at::Tensor out = out_in ? *out_in : at::empty_like(x);
  at::Tensor state = final_state ? at::empty({batch, steps, channels}, x.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "cta_causal_filter", [&] {
    // one output row from the rows at and before xt: level `level`'s taps, k <= reach
    auto filtered = [&](const scalar_t* __restrict__ xt, scalar_t* __restrict__ o, int64_t level, int64_t reach) {
      const std::vector<double>& w = taps[level];
      const scalar_t w0 = scalar_t(w[0]);
      for (int64_t c = 0; c < channels; ++c) o[c] = xt[c] * w0;
      for (int64_t k = 1; k <= std::min(reach, level); ++k) {
        const scalar_t* __restrict__ xk = xt - k * channels;
        const scalar_t wk = scalar_t(w[k]);
        for (int64_t c = 0; c < channels; ++c) o[c] = std::fma(xk[c], wk, o[c]);
      }
    };
    for (int64_t b = 0; b < batch; ++b) {
      const scalar_t* xb = x.data_ptr<scalar_t>() + b * length * channels;
      scalar_t* ob = out.data_ptr<scalar_t>() + b * length * channels;
      for (int64_t t = 0; t < length; ++t) filtered(xb + t * channels, ob + t * channels, steps, t);
      for (int64_t s = 0; final_state && s < steps; ++s)
        filtered(xb + (length - 1) * channels, state.data_ptr<scalar_t>() + (b * steps + s) * channels, s,
                 length - 1);
    }
  });
  return {out, state};
}
"""

_CASE = """      case %(id)d:
        if (per_channel)
          run<scalar_t, Scheme%(id)d, true>(x.data_ptr<scalar_t>(), x.stride(0), y, bases, seq, chan, index, keep,
                                            wp, bp, batch, steps, channels);
        else
          run<scalar_t, Scheme%(id)d, false>(x.data_ptr<scalar_t>(), x.stride(0), y, bases, seq, chan, index, keep,
                                             wp, bp, batch, steps, channels);
        break;"""


def _scheme_struct(index: int, scheme, reaction: Optional[str]) -> str:
    """One scheme's causal step ``u_{s+1}(u_s, stored value, w, b, f = tanh(u_s))`` in C++: the recurrence of
    ``pde_decode._levels`` (``w`` already ``alpha + beta`` for advection); ``reaction``: ``R(u, b)`` in C++."""
    if scheme.wave:
        body = (f"const T pull = value - old;\n"
                f"    velocity = first ? w * pull : T({1.0 - WAVE_DAMPING!r}) * velocity + w * pull;\n"
                f"    return old + velocity;")
    elif reaction is not None:  # (the compiler contracts the product and sum to the fma the torch step's add_ is)
        body = f"const T u = old;\n    (void)u;\n    return lerp(old, value, w) + {reaction};"
    else:
        body = "return lerp(old, value, w);"
    reads_tanh = "true" if reaction is not None and re.search(r"\bf\b", reaction) else "false"
    return (f"struct Scheme{index} {{  // {scheme.name}\n"
            f"  static constexpr bool wave = {'true' if scheme.wave else 'false'}, reads_tanh = {reads_tanh};\n"
            f"  template <typename T>\n"
            f"  static CTA_INLINE T step(T old, T value, T w, T b, T& velocity, bool first, T f) {{\n"
            f"    (void)b; (void)velocity; (void)first; (void)f;\n    {body}\n  }}\n}};")


_CPP_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def cpp_reaction(expression: str) -> Optional[str]:
    """A reaction ``R(u, b)`` (``PDEScheme.reaction[0]``) in C++, ``tanh(u)`` read as ``f`` (ATen's tanh of the level,
    computed once per level), or None where it uses anything else (that scheme keeps the torch ops)."""
    def emit(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _CPP_OPERATORS:
            return f"({emit(node.left)} {_CPP_OPERATORS[type(node.op)]} {emit(node.right)})"
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return f"(-{emit(node.operand)})"
        if isinstance(node, ast.Name) and node.id in ("u", "b"):
            return node.id
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return f"T({float(node.value)!r})"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "tanh"
                and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "u"):
            return "f"
        raise ValueError(ast.dump(node))

    try:
        return emit(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError):
        return None


def _kernel_schemes() -> dict:
    """scheme id -> its reaction in C++ (None: linear) for the registered schemes the kernel runs."""
    schemes = {}
    for index, scheme in enumerate(SCHEMES.values()):
        reaction = None if scheme.reaction is None else cpp_reaction(scheme.reaction[0])
        if scheme.reaction is None or reaction is not None:
            schemes[index] = reaction
    return schemes


def cpp_source() -> str:
    """The kernel's C++ source for the registered schemes it runs (scheme id = registration index)."""
    schemes = list(SCHEMES.values())
    covered = _kernel_schemes()
    structs = "\n\n".join(_scheme_struct(i, schemes[i], reaction) for i, reaction in covered.items())
    cases = "\n".join(_CASE % dict(id=i) for i in covered)
    return _KERNEL % dict(schemes=structs, cases=cases)


def runs(pde_type: str) -> bool:
    """Whether the kernel has a step for canonical ``pde_type`` (a reaction it cannot write in C++ keeps the torch
    ops)."""
    return _scheme_of(pde_type, len(SCHEMES))[2]


def _compiler_flags() -> list:
    """Vectorize for the capability torch's own CPU kernels use here (FMA included: lerp's rounding is ATen's)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fno-trapping-math"]  # (no FP traps: the per-channel selects vectorize)
    if capability.startswith("AVX512"):
        flags += ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]
    elif capability == "AVX2":
        flags += ["-mavx2", "-mfma"]
    return flags


STALE_LOCK_SECONDS = 300  # (a build takes 20-40 s on the machines measured)


def wait_for_build_lock(lock: str, what: str, stale_after: float = STALE_LOCK_SECONDS, poll: float = 1.0) -> None:
    """Waits while another process builds ``what`` (its ``lock`` file in the build directory). torch waits on that file
    without end and without a word, so a build interrupted earlier (a Ctrl-C during the first step) would hang every
    later run: a lock older than any build takes is removed, with a warning."""
    warned = False
    while True:
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:
            return  # (no lock: nobody is building)
        if age > stale_after:
            logger.warning("cta: removing %s, left %.0f s ago by a build of %s that did not finish (an interrupted "
                           "process); building it again.", lock, age, what)
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass
            return
        if not warned and age > 30:
            logger.warning("cta: waiting for another process building %s (%s); a lock older than %.0f s is taken for "
                           "an interrupted build and removed.", what, lock, stale_after)
            warned = True
        time.sleep(poll)


def build_directory(name: str, what: str) -> str:
    """The folder torch builds extension ``name`` in (under ``TORCH_EXTENSIONS_DIR``, torch's own setting, else its
    default root), made, once no other process is building ``what`` there (:func:`wait_for_build_lock`)."""
    from torch.utils.cpp_extension import get_default_build_root

    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    directory = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), python, name)
    os.makedirs(directory, exist_ok=True)
    wait_for_build_lock(os.path.join(directory, "lock"), what)
    return directory


@lru_cache(maxsize=4)
def _build(source: str, flags: tuple):
    """The extension module of ``source`` (built once per source and flags; torch caches the build on disk), or None
    with a warning where it cannot build."""
    from torch.utils.cpp_extension import load_inline

    digest = hashlib.sha256((source + repr(flags) + torch.__version__).encode()).hexdigest()[:12]
    name = f"cta_cpu_decode_{digest}"
    start = time.time()
    logger.info("cta: building the CPU decode kernel (once, about 30 s; %s=0 skips it)", ENV_SWITCH)
    try:
        module = load_inline(name, cpp_sources=source, functions=["decode_update", "causal_filter"],
                             extra_cflags=list(flags), verbose=False,
                             build_directory=build_directory(name, "the CPU decode kernel"))
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
                  state_indices: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's call behind :func:`pde_cta.pde_decode_update` (arguments checked there, ``pde_type`` canonical;
    ``state`` fp32 / fp64 on the CPU, a tensor or its level buffers; :func:`kernel` built). Returns the refined token in
    the input's shape and dtype (``out``, where given)."""
    whole = isinstance(state, torch.Tensor)
    dtype = state.dtype if whole else state[0].dtype
    if alpha.dtype != dtype:  # (projected in their own dtype first, as the torch step does)
        alpha, beta = project_coefficients(alpha, beta, bounds)
        alpha, beta, bounds = alpha.to(dtype), (None if beta is None else beta.to(dtype)), None
    return kernel().decode_update(hidden_states, [state] if whole else list(state), whole, state_indices, token_mask,
                                  alpha, alpha if beta is None else beta, *_call_constants(pde_type, bounds,
                                                                                           len(SCHEMES)), steps, out)


@lru_cache(maxsize=None)  # (one entry per registered scheme)
def _scheme_of(pde_type: str, schemes: int):
    """``(scheme id, advection, in the kernel)`` of a canonical ``pde_type``: its registration index, as the source
    numbers it."""
    index = list(SCHEMES).index(pde_type)
    return index, SCHEMES[pde_type].advection, index in _kernel_schemes()


@lru_cache(maxsize=64)  # (a model's sites share a few settings)
def _call_constants(pde_type: str, bounds, schemes: int):
    """The kernel's trailing arguments but ``steps``: ``(alpha_low, alpha_high, beta_low, beta_high, advection, scheme
    id)``, the bounds as numbers (infinite where unbounded)."""
    scheme_id, advection, _ = _scheme_of(pde_type, schemes)
    if bounds is None:
        return (*_UNBOUNDED, advection, scheme_id)
    alpha, beta = bounds
    return (alpha[0], alpha[1], *(_UNBOUNDED[:2] if beta is None else (beta[0], beta[1])), advection, scheme_id)


_UNBOUNDED = (-float("inf"), float("inf"), -float("inf"), float("inf"))
