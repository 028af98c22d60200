# coding=utf-8
"""The Continuous-Time Attention PDE operator.

One definition, several backends. This file holds the readable PyTorch reference (the ground truth for every
other backend), the stability-guaranteeing coefficient parametrisation, the learnable refinement module and the
causal decode state that lives in transformers' Cache API.

Layout: ``u`` is ``[batch, seq, channels]``; an optional ``attention_mask`` ``[batch, seq]`` marks real tokens with 1.
Everything is accumulated in fp32 and returned in the input dtype. ``steps == 0`` is the identity.

Schemes (explicit pseudo-time steps, written in flux form so that walls are exact)
-------------------------------------------------------------------------------
Let ``e(i, i+1)`` be 1 when the edge between positions ``i`` and ``i+1`` is open (both are real tokens inside the
sequence) and 0 otherwise: sequence ends and padding are *walls*. A padded position never changes and is never read.

Bidirectional (encoders), zero-flux walls. With the edge flux into ``i`` from its right neighbour
``G(i+1/2) = e(i,i+1) * (a * (u[i+1] - u[i]) - b+ * u[i] - b- * u[i+1])`` (``b+ = max(b, 0)``, ``b- = min(b, 0)``):

* ``diffusion``:            ``u[i] += G(i+1/2) - G(i-1/2)`` with ``b = 0`` (the 3-point Laplacian).
* ``advection_diffusion``:  the same with ``b != 0``: upwind transport with velocity ``b`` (``b > 0`` moves
  information towards later positions), mass-conservative at walls.
* ``reaction_diffusion``:   diffusion plus ``b * R(u)`` with the bounded reaction ``R(u) = -tanh(u)`` (a saturating
  decay towards 0: linear for small ``u``, at most ``b`` per step for large ``u``), ``b >= 0``.
* ``wave``:                 ``v = (1 - WAVE_DAMPING) * v + a * lap(u); u += v`` with ``v = 0`` at the start and
  ``a = c**2``. The damping is not optional: with any causal (one-sided) stencil the undamped scheme has a root of
  modulus > 1 (the product of the two roots is 1 and they are not on the unit circle), so it grows exponentially.

Causal (decoders), zero-inflow walls: position ``i`` reads only its left neighbour ``l = u[i-1]`` (0 at the start of
the sequence and after padding: the sequence behaves as if preceded by zeros, like causal-conv1d's zero initial
state), so after any number of steps it depends only on positions ``<= i``:

* ``diffusion``:            ``u[i] += a * (l - u[i])``                  (left flux of the 3-point Laplacian)
* ``advection_diffusion``:  ``u[i] += (a + b) * (l - u[i])``, ``b >= 0`` (the upwind stencil for causal transport is
  the same left difference, so causal advection-diffusion is diffusion with coefficient ``a + b``)
* ``reaction_diffusion``:   ``u[i] += a * (l - u[i]) - b * tanh(u[i])``
* ``wave``:                 ``v[i] = (1 - WAVE_DAMPING) * v[i] + a * (l - u[i]); u[i] += v[i]``

Stability (the bounds in ``COEFFICIENT_BOUNDS``): every linear scheme above, at every coefficient inside its
bounds, maps ``u`` by a matrix with non-negative entries whose rows and columns sum to at most 1 (diffusion,
advection, reaction -- for the reaction write ``tanh(u) = d * u`` with ``0 < d <= 1``), hence its L1, L2 and
L-infinity operator norms are ``<= 1``: no input grows, whatever the sequence length, padding or step count. The
amplification factor of a Fourier mode ``exp(i k x)`` is ``1 - 4 a sin^2(k/2)`` (bidirectional diffusion, ``a <= 1/2``)
and ``1 - a + a exp(-i k)`` (causal diffusion, ``|.| <= 1`` for ``0 <= a <= 1``). For the damped wave the bound was
found by computing ``max_n ||u_n|| / ||u_0||`` over 64 steps for the worst input (the spectral norm of the step
matrix power), which stays ``<= 1`` up to ``a = 1/2`` (bidirectional) and ``a = 0.15`` (causal).

The authors' public causal stencil ``u[i] += a * (u[i] - 2 u[i-1] + u[i-2])`` has amplification ``|1 + 4a| > 1`` at
the alternating mode and is deliberately not provided.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Optional

import torch
from torch import nn

from .pde_cache import cached_pde_state


PDE_TYPES = ("diffusion", "wave", "reaction_diffusion", "advection_diffusion")
PDE_TYPE_ALIASES = {
    "reaction-diffusion": "reaction_diffusion",
    "advection-diffusion": "advection_diffusion",
    "heat": "diffusion",
}
PDE_BACKENDS = ("auto", "torch", "triton")
WAVE_DAMPING = 0.5
MAX_PDE_STEPS = 64

# (alpha_min, alpha_max), (beta_min, beta_max) or None, for (pde_type, causal).
COEFFICIENT_BOUNDS = {
    ("diffusion", False): ((0.0, 0.5), None),
    ("diffusion", True): ((0.0, 0.5), None),
    ("wave", False): ((0.0, 0.5), None),
    ("wave", True): ((0.0, 0.15), None),
    ("reaction_diffusion", False): ((0.0, 0.25), (0.0, 0.5)),
    ("reaction_diffusion", True): ((0.0, 0.25), (0.0, 0.5)),
    ("advection_diffusion", False): ((0.0, 0.25), (-0.5, 0.5)),
    ("advection_diffusion", True): ((0.0, 0.25), (0.0, 0.5)),
}

# Coefficients of the paper (Zhang & Zhou 2025): alpha = 0.1 for diffusion; beta values are ours (the paper gives none).
PAPER_COEFFICIENTS = {
    "diffusion": (0.1, None),
    "wave": (0.1, None),
    "reaction_diffusion": (0.1, 0.05),
    "advection_diffusion": (0.1, 0.05),
}


def normalize_pde_type(pde_type: str, argument: str = "pde_type") -> str:
    """Returns the canonical spelling of ``pde_type`` or raises a ValueError naming ``argument``."""
    if isinstance(pde_type, str):
        name = PDE_TYPE_ALIASES.get(pde_type.lower(), pde_type.lower())
        if name in PDE_TYPES:
            return name
    raise ValueError(
        f"`{argument}` must be one of {PDE_TYPES} (aliases: {sorted(PDE_TYPE_ALIASES)}), got {pde_type!r}."
    )


def uses_beta(pde_type: str) -> bool:
    return COEFFICIENT_BOUNDS[(normalize_pde_type(pde_type), False)][1] is not None


def coefficient_bounds(pde_type: str, causal: bool):
    """``((alpha_min, alpha_max), (beta_min, beta_max) | None)`` inside which the scheme is non-expansive."""
    return COEFFICIENT_BOUNDS[(normalize_pde_type(pde_type), bool(causal))]


# ----------------------------------------------------------------------------------------------------------------
# Argument checking shared by every backend
# ----------------------------------------------------------------------------------------------------------------


def _as_coefficient(value, name: str, channels: int, device) -> Optional[torch.Tensor]:
    if value is None:
        return None
    if not torch.is_tensor(value):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"`{name}` must be a float, a 0-d tensor or a tensor of shape [channels], got {value!r}.")
        # A fill on the device, not a host-to-device copy: capturable in CUDA graphs, no synchronisation.
        value = torch.full((), float(value), dtype=torch.float64, device=device)  # cast to the compute dtype later
    if value.dim() == 1 and value.shape[0] == 1:
        value = value.reshape(())
    if value.dim() not in (0, 1) or (value.dim() == 1 and value.shape[0] != channels):
        raise ValueError(
            f"`{name}` must be a scalar or have shape [channels] = [{channels}], got shape {tuple(value.shape)}."
        )
    return value


def check_pde_arguments(
    hidden_states: torch.Tensor,
    pde_type: str,
    steps: int,
    alpha,
    beta,
    attention_mask: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor] = None,
    causal: bool = False,
):
    """Validates the arguments of :func:`pde_refine`; returns ``(pde_type, alpha, beta)`` normalised."""
    pde_type = normalize_pde_type(pde_type)
    if not torch.is_tensor(hidden_states) or hidden_states.dim() != 3:
        shape = tuple(hidden_states.shape) if torch.is_tensor(hidden_states) else type(hidden_states)
        raise ValueError(f"`hidden_states` must have shape [batch, seq, channels], got {shape}.")
    if not hidden_states.is_floating_point():
        raise ValueError(f"`hidden_states` must be a floating point tensor, got dtype {hidden_states.dtype}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0 or steps > MAX_PDE_STEPS:
        raise ValueError(f"`steps` must be an int in [0, {MAX_PDE_STEPS}], got {steps!r}.")
    batch, seq, channels = hidden_states.shape
    alpha = _as_coefficient(alpha, "alpha", channels, hidden_states.device)
    if alpha is None:
        raise ValueError("`alpha` is required.")
    beta = _as_coefficient(beta, "beta", channels, hidden_states.device)
    if uses_beta(pde_type) and beta is None:
        raise ValueError(f"`beta` is required for pde_type={pde_type!r}.")
    if not uses_beta(pde_type):
        beta = None
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, seq):
        raise ValueError(
            f"`attention_mask` must have shape [batch, seq] = [{batch}, {seq}] like `hidden_states`, "
            f"got {tuple(attention_mask.shape)}."
        )
    if initial_state is not None:
        if not causal:
            raise ValueError("`initial_state` is only defined for causal=True.")
        if tuple(initial_state.shape) != (batch, steps, channels):
            raise ValueError(
                f"`initial_state` must have shape [batch, steps, channels] = [{batch}, {steps}, {channels}], "
                f"got {tuple(initial_state.shape)}."
            )
    return pde_type, alpha, beta


# ----------------------------------------------------------------------------------------------------------------
# PyTorch reference
# ----------------------------------------------------------------------------------------------------------------


def _bidirectional_step(u, v, pde_type, alpha, beta, open_edge, valid):
    """One explicit step of the bidirectional scheme in flux form (fp32, [B, L, C])."""
    diff = u[:, 1:] - u[:, :-1]  # u[i+1] - u[i] on the L-1 edges
    if pde_type == "wave":
        lap = torch.nn.functional.pad(diff * open_edge, (0, 0, 0, 1)) - torch.nn.functional.pad(
            diff * open_edge, (0, 0, 1, 0)
        )
        v = (1.0 - WAVE_DAMPING) * v + alpha * lap
        return u + v, v
    flux = alpha * diff  # flux into the left cell of each edge
    if pde_type == "advection_diffusion":
        flux = flux - beta.clamp(min=0) * u[:, :-1] - beta.clamp(max=0) * u[:, 1:]
    flux = flux * open_edge
    update = torch.nn.functional.pad(flux, (0, 0, 0, 1)) - torch.nn.functional.pad(flux, (0, 0, 1, 0))
    if pde_type == "reaction_diffusion":
        update = update - beta * torch.tanh(u) * valid
    return u + update, v


def _causal_step(u, v, left, pde_type, alpha, beta, valid):
    """One explicit causal step; ``left`` holds u[i-1] (already zero at walls)."""
    pull = left - u
    if pde_type == "wave":
        v = (1.0 - WAVE_DAMPING) * v + alpha * pull * valid
        return u + v, v
    if pde_type == "advection_diffusion":
        update = (alpha + beta) * pull
    else:
        update = alpha * pull
    if pde_type == "reaction_diffusion":
        update = update - beta * torch.tanh(u)
    return u + update * valid, v


def pde_refine_reference(
    hidden_states: torch.Tensor,
    *,
    pde_type: str,
    steps: int,
    alpha,
    beta=None,
    causal: bool = False,
    attention_mask: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    return_final_state: bool = False,
):
    """Readable, vectorised fp32 reference of :func:`pde_refine` (the ground truth of every backend).

    ``initial_state`` / the returned final state (causal only) are ``[batch, steps, channels]``: entry ``s`` is the
    value of the step-``s`` iterate at the position just before the first one (zeros = start of sequence / wall).
    """
    pde_type, alpha, beta = check_pde_arguments(
        hidden_states, pde_type, steps, alpha, beta, attention_mask, initial_state, causal
    )
    batch, seq, channels = hidden_states.shape
    compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    u = hidden_states.to(compute_dtype)
    alpha = alpha.to(compute_dtype)
    beta = beta.to(compute_dtype) if beta is not None else None
    if attention_mask is None:
        valid = torch.ones(batch, seq, 1, device=u.device, dtype=compute_dtype)
    else:
        valid = attention_mask.to(device=u.device, dtype=compute_dtype).unsqueeze(-1)
    v = torch.zeros_like(u) if pde_type == "wave" else None
    final_state = []
    if causal:
        if initial_state is None:
            initial_state = torch.zeros(batch, steps, channels, device=u.device, dtype=compute_dtype)
        left_valid = torch.nn.functional.pad(valid[:, :-1], (0, 0, 1, 0), value=1.0)
        for step in range(steps):
            final_state.append(u[:, -1] * valid[:, -1])
            left = torch.cat([initial_state[:, step : step + 1].to(compute_dtype), u[:, :-1]], dim=1) * left_valid
            u, v = _causal_step(u, v, left, pde_type, alpha, beta, valid)
    else:
        open_edge = valid[:, 1:] * valid[:, :-1]
        for step in range(steps):
            u, v = _bidirectional_step(u, v, pde_type, alpha, beta, open_edge, valid)
    out = u.to(hidden_states.dtype)
    if return_final_state:
        state = (
            torch.stack(final_state, dim=1)
            if final_state
            else torch.zeros(batch, 0, channels, device=u.device, dtype=compute_dtype)
        )
        return out, state
    return out


def pde_decode_step_reference(
    hidden_states: torch.Tensor,
    state: torch.Tensor,
    *,
    pde_type: str,
    steps: int,
    alpha,
    beta=None,
    token_mask: Optional[torch.Tensor] = None,
):
    """One causal decode step (the ``update`` to :func:`pde_refine`'s ``fn``, as in causal-conv1d).

    ``hidden_states`` is ``[batch, channels]`` (the new token), ``state`` ``[batch, steps, channels]`` fp32 as returned
    by ``pde_refine(..., causal=True, return_final_state=True)``; it is updated in place. Returns the refined token.
    """
    out, new_state = pde_refine_reference(
        hidden_states.unsqueeze(1),
        pde_type=pde_type,
        steps=steps,
        alpha=alpha,
        beta=beta,
        causal=True,
        attention_mask=None if token_mask is None else token_mask.reshape(-1, 1),
        initial_state=state,
        return_final_state=True,
    )
    state.copy_(new_state)
    return out.squeeze(1)


# ----------------------------------------------------------------------------------------------------------------
# Backend dispatch
# ----------------------------------------------------------------------------------------------------------------


_TRITON_MODULE = []  # [cta.triton_cta] once imported and usable here (cached: decode checks it per token)


def _triton_module():
    """``cta.triton_cta`` when Triton can run here (CUDA, or the interpreter), else None; looked up once."""
    if not _TRITON_MODULE:
        try:  # a `from .x import` line: transformers' remote-code loader copies the files such lines name
            from .triton_cta import is_available

            triton_cta = sys.modules[is_available.__module__]
        except ImportError:
            triton_cta = None
        _TRITON_MODULE.append(triton_cta if triton_cta is not None and triton_cta.is_available() else None)
    return _TRITON_MODULE[0]


def triton_available() -> bool:
    """True when the Triton kernels can run here (triton importable, and CUDA or ``TRITON_INTERPRET=1``)."""
    return _triton_module() is not None


def _use_triton(backend: str, tensor: torch.Tensor) -> bool:
    if backend not in PDE_BACKENDS:
        raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {backend!r}.")
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise ValueError("`backend='triton'` was requested but triton (or cta.triton_cta) cannot be imported.")
        return True
    return tensor.is_cuda and triton_available()


def pde_refine(
    hidden_states: torch.Tensor,
    *,
    pde_type: str,
    steps: int,
    alpha,
    beta=None,
    causal: bool = False,
    attention_mask: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    return_final_state: bool = False,
    backend: str = "auto",
):
    """Refines ``hidden_states`` ``[batch, seq, channels]`` with ``steps`` explicit steps of the PDE ``pde_type``.

    Args:
        pde_type: ``diffusion``, ``wave``, ``reaction_diffusion`` or ``advection_diffusion`` (hyphens accepted).
        steps: number of explicit pseudo-time steps (0 = identity).
        alpha: effective diffusion coefficient (``c**2`` for the wave): float, 0-d or ``[channels]`` tensor.
        beta: effective reaction / advection coefficient (``reaction_diffusion`` / ``advection_diffusion`` only).
        causal: one-sided stencil: position ``i`` depends only on positions ``<= i``.
        attention_mask: ``[batch, seq]``, 1 for tokens, 0 for padding (a wall that is returned unchanged).
        initial_state / return_final_state: causal streaming state ``[batch, steps, channels]`` (see the reference).
        backend: ``auto`` (Triton on CUDA when importable), ``torch`` (the reference) or ``triton``.

    Coefficients outside :data:`COEFFICIENT_BOUNDS` are accepted here (the functional op does not clip) but lose the
    stability guarantee; :class:`PDERefinement` keeps its coefficients inside them.
    """
    if _use_triton(backend, hidden_states):
        from .triton_cta import pde_refine_triton

        return pde_refine_triton(
            hidden_states,
            pde_type=pde_type,
            steps=steps,
            alpha=alpha,
            beta=beta,
            causal=causal,
            attention_mask=attention_mask,
            initial_state=initial_state,
            return_final_state=return_final_state,
        )
    return pde_refine_reference(
        hidden_states,
        pde_type=pde_type,
        steps=steps,
        alpha=alpha,
        beta=beta,
        causal=causal,
        attention_mask=attention_mask,
        initial_state=initial_state,
        return_final_state=return_final_state,
    )


# Under torch.compile a one-token decode step is traced as the reference's plain tensor operations, not as the Triton
# decode kernel's custom op: inductor then fuses it (coefficient clamp, the S levels, the state write) with the
# residual add before it and the norm after it, where the opaque op cost about three extra launches per site in a
# CUDA-graph step (`benchmarks/bench_compiled_decode.py`). CTA_COMPILED_DECODE=op keeps the custom op (comparison).
COMPILED_DECODE_AS_OP = os.environ.get("CTA_COMPILED_DECODE", "fused") == "op"


def pde_decode_step(hidden_states, state, *, pde_type, steps, alpha, beta=None, token_mask=None, backend="auto"):
    """Dispatching wrapper of :func:`pde_decode_step_reference` (updates ``state`` in place)."""
    traced_fused = torch.compiler.is_compiling() and not COMPILED_DECODE_AS_OP
    if _use_triton(backend, hidden_states) and not traced_fused:
        from .triton_cta import pde_decode_step_triton

        return pde_decode_step_triton(
            hidden_states, state, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, token_mask=token_mask
        )
    return pde_decode_step_reference(
        hidden_states, state, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, token_mask=token_mask
    )


# ----------------------------------------------------------------------------------------------------------------
# Learnable module
# ----------------------------------------------------------------------------------------------------------------


def check_pde_weights_loaded(loading_info: dict, model_class: str, source) -> None:
    """Raises if a checkpoint's PDE coefficients did not load exactly (``from_pretrained``'s ``loading_info``).

    A model whose PDE sites silently kept their initial coefficients (or dropped the checkpoint's) is a different
    model with no error; every other missing / unexpected weight follows transformers' own reporting (its warnings,
    ``output_loading_info``), e.g. a new task head.
    """
    problems = {
        kind: sorted(str(k) for k in loading_info.get(kind, ()) if "_pde." in str(k))
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    if any(problems.values()):
        raise ValueError(
            f"Loading {model_class} from {source!r}: the checkpoint's PDE weights do not match the config "
            f"(PDE placements / layers / steps / per-channel coefficients): missing weights {problems['missing_keys']}, "
            f"unexpected weights {problems['unexpected_keys']}, mismatched {problems['mismatched_keys']}."
        )


class _StraightThroughClamp(torch.autograd.Function):
    """Clamps in the forward pass, passes the gradient unchanged (so a coefficient at a bound can come back)."""

    @staticmethod
    def forward(ctx, raw, low, high):
        return raw.clamp(low, high)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def project_coefficient(raw: torch.Tensor, bounds) -> torch.Tensor:
    """The coefficient the scheme uses: ``raw`` projected onto ``bounds`` (straight-through gradient).

    The parameter *is* the coefficient while inside its bounds, so ``init="identity"`` (0) is exact, and no value
    the optimiser can reach leaves the stable region. (A sigmoid cannot reach 0 and saturates near its bounds.)
    """
    if not (torch.is_grad_enabled() and raw.requires_grad):
        return raw.clamp(bounds[0], bounds[1])  # inference: skip the autograd.Function (decode is latency-bound)
    return _StraightThroughClamp.apply(raw, bounds[0], bounds[1])


class PDERefinement(nn.Module):
    """Learnable PDE refinement of ``[batch, seq, channels]`` hidden states.

    Parameters ``alpha`` (and ``beta`` for reaction/advection) are scalars or per-channel vectors; the scheme always
    uses them projected onto the stable interval of :data:`COEFFICIENT_BOUNDS` (see :func:`project_coefficient`).
    For causal refinement with a transformers ``Cache`` the streaming state of this site is stored as the conv
    state ``state_idx`` of cache layer ``layer_idx`` (a contiguous fp32 ``[batch, steps, channels]`` buffer), so
    that decoding one token at a time (in place, one kernel) or prefilling in chunks gives exactly the
    full-sequence result.
    """

    def __init__(
        self,
        channels: int,
        pde_type: str = "diffusion",
        steps: int = 1,
        causal: bool = False,
        alpha: float = 0.1,
        beta: Optional[float] = None,
        per_channel: bool = False,
        backend: str = "auto",
        layer_idx: Optional[int] = None,
        state_idx: int = 0,
    ):
        super().__init__()
        self.pde_type = normalize_pde_type(pde_type)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_PDE_STEPS:
            raise ValueError(f"`steps` must be an int in [0, {MAX_PDE_STEPS}], got {steps!r}.")
        if backend not in PDE_BACKENDS:
            raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {backend!r}.")
        self.channels = channels
        self.steps = steps
        self.causal = bool(causal)
        self.backend = backend
        self.layer_idx = layer_idx
        self.state_idx = state_idx
        alpha_bounds, beta_bounds = coefficient_bounds(self.pde_type, self.causal)
        self.alpha_bounds, self.beta_bounds = alpha_bounds, beta_bounds
        shape = (channels,) if per_channel else ()
        self.alpha_init = float(alpha)
        self.alpha = nn.Parameter(torch.full(shape, self.alpha_init))
        if beta_bounds is not None:
            self.beta_init = float(PAPER_COEFFICIENTS[self.pde_type][1] if beta is None else beta)
            self.beta = nn.Parameter(torch.full(shape, self.beta_init))
        else:
            self.beta_init = None
            self.register_parameter("beta", None)

    def __setattr__(self, name, value):
        # A prepared decode step (_DecodePlan) is bound to this module's settings: any change drops it.
        self.__dict__.pop("_decode_plan", None)
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        return f"{self.pde_type}, steps={self.steps}, {kind}, channels={self.channels}, per_channel={self.alpha.dim() == 1}"

    def coefficients(self):
        """The effective (projected) ``(alpha, beta)`` used by the scheme."""
        alpha = project_coefficient(self.alpha, self.alpha_bounds)
        beta = project_coefficient(self.beta, self.beta_bounds) if self.beta is not None else None
        return alpha, beta

    def _inference_coefficients(self):
        """The projected coefficients as fp32 contiguous vectors, recomputed only when a parameter changes.

        Decoding runs this module once per token and site; recomputing the clamp would cost a launch each time.
        The key (storage address, version counter, dtype) changes with every in-place update, `.to()` or reload.
        """
        alpha, beta = self.alpha, self.beta
        key = (alpha.data_ptr(), alpha._version, alpha.dtype)
        if beta is not None:
            key += (beta.data_ptr(), beta._version, beta.dtype)
        cached = self.__dict__.get("_cached_coefficients")
        if cached is not None and cached[0] == key:
            return cached[1]
        with torch.no_grad():
            alpha, beta = self.coefficients()
            value = tuple(
                c.to(torch.float32).reshape(-1).contiguous() if c is not None else None for c in (alpha, beta)
            )
        self.__dict__["_cached_coefficients"] = (key, value)
        return value

    def _fast_decode(self, hidden_states, state, attention_mask):
        """One cached decode step through the Triton update kernel with no per-call validation, or None when this
        call needs the general path (autograd, CPU/torch backend, steps above the fused limit, odd layouts).
        It also prepares the next steps (a :class:`_DecodePlan`)."""
        # Traced (torch.compile): the general path (traced reference ops, or the custom op: COMPILED_DECODE_AS_OP).
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or not _use_triton(self.backend, hidden_states):
            return None
        kernels = _triton_module()
        if self.steps > kernels.MAX_FUSED_STEPS or state.stride(-1) != 1:
            return None
        if hidden_states.dtype == torch.float64 or state.dtype != torch.float32:
            return None
        alpha, beta = self._inference_coefficients()
        token_mask = None
        if attention_mask is not None:
            token_mask = attention_mask[:, 0].to(torch.float32).contiguous()
        pde = kernels._PDE_IDS[self.pde_type]
        out = kernels.pde_decode_update(hidden_states, state, alpha, beta, token_mask, pde, self.steps)
        if hidden_states.is_contiguous():
            plan = self.__dict__.get("_decode_plan")
            if plan is None or not plan.applies(hidden_states, state):
                plan = _DecodePlan(self, hidden_states, state)
            masked = token_mask is not None
            if plan.launches[masked] is None:  # bound once per plan and kind, not at every step the plan declines
                plan.launches[masked] = kernels.bind_decode_update(
                    hidden_states, state, alpha, beta, token_mask, pde, self.steps
                )
            if plan.launches[masked] is not None:
                self.__dict__["_decode_plan"] = plan
        return out

    def forward(self, hidden_states, attention_mask=None, cache=None):
        # Decoding: the launch an earlier token prepared, while it still applies (see _DecodePlan).
        plan = self.__dict__.get("_decode_plan")
        if plan is not None and cache is not None:
            out = plan(hidden_states, cache, attention_mask)
            if out is not None:
                return out
        if self.steps == 0:
            return hidden_states
        state = None
        if cache is not None and self.causal:
            if self.layer_idx is None:
                raise ValueError("PDERefinement needs `layer_idx` to read/write its state in a Cache.")
            state = cached_pde_state(cache, self.layer_idx, self.state_idx)
            if state is not None and hidden_states.shape[1] == 1:
                # One new token: the decode kernel updates the cache's own state buffer in place.
                fast = self._fast_decode(hidden_states, state, attention_mask)
                if fast is not None:
                    return fast
        alpha, beta = self.coefficients()
        kwargs = dict(pde_type=self.pde_type, steps=self.steps, alpha=alpha, beta=beta)
        if cache is None or not self.causal:
            return pde_refine(
                hidden_states, attention_mask=attention_mask, causal=self.causal, backend=self.backend, **kwargs
            )
        differentiable = torch.is_grad_enabled() and (
            hidden_states.requires_grad or alpha.requires_grad or (beta is not None and beta.requires_grad)
        )
        # The decode kernels have no backward: under autograd a one-token step takes the chunked path below.
        if state is not None and hidden_states.shape[1] == 1 and not differentiable:
            token_mask = None if attention_mask is None else attention_mask[:, 0]
            out = pde_decode_step(hidden_states[:, 0], state, token_mask=token_mask, backend=self.backend, **kwargs)
            return out[:, None]
        if differentiable and state is not None:
            state = state.clone()  # autograd may save it, and the cache's buffer is overwritten below
        out, final_state = pde_refine(
            hidden_states,
            attention_mask=attention_mask,
            initial_state=state,
            return_final_state=True,
            causal=True,
            backend=self.backend,
            **kwargs,
        )
        # Stored as the layer's conv state with the channels as its last ("kernel") axis, so the buffer is the
        # contiguous [batch, steps, channels] tensor the decode kernel updates in place.
        cache.update_conv_state(final_state.detach().float(), self.layer_idx, state_idx=self.state_idx)
        return out


class _DecodePlan:
    """The next decode steps of one :class:`PDERefinement`, prepared by the step before: the token layout, the cache
    slot and state buffer, the coefficients, and bound Triton launches (``triton_cta.bind_decode_update``), one
    without and one with a token mask, each bound once that kind of step has run.

    A batch-1 decode step is host-bound, and a patched model runs one step per site and token; re-checking and
    re-building all of this each time cost several times the launch. ``__call__`` checks only what can change
    between tokens and returns None when anything differs (autograd or tracing on, another cache, a replaced or
    reset state, another token layout, a token mask other than fp32 ``[batch, 1]``, updated or replaced
    coefficients); the caller then takes the general path, which prepares a new plan. The module's own settings
    are not re-checked: setting any attribute of the module drops its plan. The state is held weakly: a finished
    generation's cache is not kept alive.
    """

    __slots__ = ("layer_idx", "state_idx", "state", "shape", "mask_shape", "dtype", "device", "parameters", "alpha",
                 "beta", "alpha_ptr", "alpha_version", "beta_ptr", "beta_version", "launches")

    def __init__(self, module, hidden_states, state):
        self.layer_idx, self.state_idx = module.layer_idx, module.state_idx
        self.state = weakref.ref(state)
        self.shape, self.dtype, self.device = hidden_states.shape, hidden_states.dtype, hidden_states.get_device()
        self.mask_shape = (hidden_states.shape[0], 1)  # of a token mask
        self.parameters = module._parameters  # the module's own dict: a replaced parameter is seen here
        self.alpha, self.beta = module.alpha, module.beta
        # An in-place update bumps the version, a `.data` swap moves the storage, a new Parameter replaces the object.
        self.alpha_ptr, self.alpha_version = self.alpha.data_ptr(), self.alpha._version
        self.beta_ptr, self.beta_version = (0, 0) if self.beta is None else (self.beta.data_ptr(), self.beta._version)
        self.launches = [None, None]  # [without, with] a token mask

    def applies(self, hidden_states, state) -> bool:
        """Whether this plan holds for this token and state buffer (everything but the cache slot and grad mode)."""
        if state is None or state is not self.state():
            return False
        if (
            hidden_states.shape != self.shape
            or hidden_states.dtype is not self.dtype
            or hidden_states.get_device() != self.device
            or not hidden_states.is_contiguous()
            or hidden_states.data_ptr() % 16
        ):
            return False
        alpha, beta, parameters = self.alpha, self.beta, self.parameters
        if (
            parameters["alpha"] is not alpha or alpha._version != self.alpha_version
            or alpha.data_ptr() != self.alpha_ptr
        ):
            return False
        return beta is None or (
            parameters["beta"] is beta and beta._version == self.beta_version and beta.data_ptr() == self.beta_ptr
        )

    def __call__(self, hidden_states, cache, attention_mask=None, in_place=False):
        """The refined token (a new tensor; with ``in_place``, written over ``hidden_states``, which the caller then
        must own: nothing else may read it afterwards), or None where the general path must run."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        launch = self.launches[attention_mask is not None]
        if launch is None:
            return None
        if attention_mask is not None:
            if (
                attention_mask.dtype is not torch.float32
                or attention_mask.shape != self.mask_shape
                or attention_mask.get_device() != self.device
                or not attention_mask.is_contiguous()
                or attention_mask.data_ptr() % 16
            ):
                return None
        try:  # the state buffer of a hybrid cache layer that holds one; any other cache takes the general path
            layer = cache.layers[self.layer_idx]
            state = layer.conv_states[self.state_idx] if layer.has_previous_state[self.state_idx] else None
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        if not self.applies(hidden_states, state):
            return None
        # The kernel reads each element before it writes it: in place is exact.
        out = hidden_states if in_place else torch.empty_like(hidden_states)
        launch(hidden_states, out, state, attention_mask)
        return out
