# coding=utf-8
"""The CTA PDE operator's specification (a leaf module): its schemes (one :class:`PDEScheme` per type, added by
``register_scheme``: update rule, local terms of its vector-Jacobian product, stable coefficient bounds, paper
defaults) and argument validation. The flux form is documented in ``pde_reference``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch

PDE_BACKENDS = ("auto", "torch", "triton")
WAVE_DAMPING = 0.5
MAX_PDE_STEPS = 64


@dataclass(frozen=True)
class PDEScheme:
    """One PDE type, the single definition the reference, the decode step and every Triton kernel derive from.

    In flux form (``pde_reference``): a diffusion flux ``a * (u[i+1] - u[i])``; ``advection``: plus the upwind flux of
    velocity ``b`` (causally the same left difference: diffusion with ``a + b``); ``wave``: the flux difference drives
    ``v = (1 - WAVE_DAMPING) v + a lap(u)``, ``u += v``; ``reaction``: ``(R, dR/du, dR/db)``, expressions in ``u``,
    ``b`` (and ``tanh``) that torch and Triton both evaluate: ``R(u, b)`` joins every real token's update, its
    derivatives the backward. ``bounds[causal]``: ``((alpha_min, alpha_max), (beta_min, beta_max) | None)``, where the
    steps are non-expansive (why: ``stability``). ``linear``: the update is linear in ``u``. ``paper``: the default ``(alpha, beta)``."""

    name: str
    bounds: Tuple[tuple, tuple]
    paper: Tuple[float, Optional[float]]
    stability: str
    wave: bool = False
    advection: bool = False
    reaction: Optional[Tuple[str, str, str]] = None
    linear: bool = True
    aliases: Tuple[str, ...] = ()
    torch_reaction: Optional[Callable] = field(default=None, init=False, repr=False, compare=False)
    torch_reaction_factor: Optional[Tuple[float, Callable]] = field(default=None, init=False, repr=False,
                                                                   compare=False)

    def __post_init__(self):  # R(u, b) as a torch function, for the reference and the decode step
        react = self.reaction and _torch_function("u, b", self.reaction[0])
        object.__setattr__(self, "torch_reaction", react or None)
        object.__setattr__(self, "torch_reaction_factor", self.reaction and _factor_in_b(self.reaction[0]))

    @property
    def uses_beta(self) -> bool:
        return self.bounds[True][1] is not None

    def filters(self, causal: bool) -> bool:
        """A constant-coefficient flux stencil (``M = I + c L``): banded filters and the streaming backward apply."""
        return not self.wave and self.reaction is None and (causal or not self.advection)


def _factor_in_b(expression: str):
    """``(sign, f)`` with ``R(u, b) = sign * b * f(u)`` where the reaction is written ``b * f(u)`` or ``-b * f(u)`` (f
    without ``b``), else None: with a number ``b`` a step adds it as one fused ``add(f(u), alpha=sign * b)`` (the CPU
    decode step, where each op costs the token several microseconds)."""
    tree = ast.parse(expression, mode="eval").body
    if not (isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.Mult)):
        return None
    left, sign = tree.left, 1.0
    if isinstance(left, ast.UnaryOp) and isinstance(left.op, ast.USub):
        left, sign = left.operand, -1.0
    if not (isinstance(left, ast.Name) and left.id == "b") or any(
            isinstance(node, ast.Name) and node.id == "b" for node in ast.walk(tree.right)):
        return None
    return sign, _torch_function("u", ast.unparse(tree.right))


def _torch_function(arguments: str, expression: str) -> Callable:
    """A reaction expression (in ``u``, ``b`` and ``tanh``) as a torch function of ``arguments``."""
    return eval(f"lambda {arguments}: {expression}", {"tanh": torch.tanh})  # noqa: S307


SCHEMES = {}  # name -> PDEScheme, in registration order (a kernel's scheme id is its index)
PDE_TYPE_ALIASES = {}
COEFFICIENT_BOUNDS = {}  # (pde_type, causal) -> ((alpha_min, alpha_max), (beta_min, beta_max) or None)
PAPER_COEFFICIENTS = {}  # pde_type -> (alpha, beta or None)
PDE_IDS = {}  # pde_type -> its integer id (the custom ops' argument)


def register_scheme(scheme: PDEScheme) -> PDEScheme:
    """Makes ``scheme`` a PDE type every entry point accepts (reference, decode, Triton kernels, models)."""
    if scheme.wave and (scheme.reaction or scheme.advection):
        raise ValueError("A wave scheme takes no reaction or advection term.")
    if SCHEMES.get(scheme.name, scheme) != scheme:  # (kernels and launch plans are cached by name)
        raise ValueError(f"Another scheme is registered as {scheme.name!r}.")
    SCHEMES[scheme.name] = scheme
    PDE_IDS.setdefault(scheme.name, len(PDE_IDS))
    PDE_TYPE_ALIASES.update(dict.fromkeys(scheme.aliases, scheme.name))
    COEFFICIENT_BOUNDS.update({(scheme.name, False): scheme.bounds[False], (scheme.name, True): scheme.bounds[True]})
    PAPER_COEFFICIENTS[scheme.name] = scheme.paper
    return scheme


# Coefficients of the paper (Zhang & Zhou 2025): alpha = 0.1 for diffusion; beta values are ours (the paper gives none).
# Stability: each linear scheme inside its bounds maps u by a matrix with non-negative entries whose rows and columns
# sum to at most 1, hence operator norms (L1, L2, L-infinity) <= 1: no input grows, whatever the length, padding or
# step count.
register_scheme(PDEScheme(
    "diffusion", (((0.0, 0.5), None), ((0.0, 0.5), None)), (0.1, None), aliases=("heat",),
    stability="Fourier amplification 1 - 4 a sin^2(k/2) (bidirectional, a <= 1/2) and 1 - a + a exp(-i k) "
              "(causal, |.| <= 1 for 0 <= a <= 1); non-negative rows summing to 1."))
register_scheme(PDEScheme(
    "wave", (((0.0, 0.5), None), ((0.0, 0.15), None)), (0.1, None), wave=True,
    stability="max_n ||u_n|| / ||u_0|| over 64 steps for the worst input (the spectral norm of the step matrix "
              "power) stays <= 1 up to a = 1/2 (bidirectional) and 0.15 (causal). The damping is not optional: "
              "undamped, a causal stencil has a root of modulus > 1 (the roots' product is 1, off the unit circle)."))
register_scheme(PDEScheme(
    "reaction_diffusion", (((0.0, 0.25), (0.0, 0.5)),) * 2, (0.1, 0.05),
    reaction=("-b * tanh(u)", "-b * (1.0 - tanh(u) * tanh(u))", "-tanh(u)"), linear=False,
    aliases=("reaction-diffusion",),
    stability="The bounded reaction -b tanh(u) saturates (at most b per step); writing tanh(u) = d u with "
              "0 < d <= 1, rows 1 - 2a - b d >= 0 stay non-negative and sum to at most 1."))
register_scheme(PDEScheme(
    "advection_diffusion", (((0.0, 0.25), (-0.5, 0.5)), ((0.0, 0.25), (0.0, 0.5))), (0.1, 0.05), advection=True,
    aliases=("advection-diffusion",),
    stability="Upwind transport, mass-conservative at walls: rows 1 - 2a - |b| >= 0 (bidirectional), 1 - a - b >= 0 "
              "(causal, b >= 0: the same left difference)."))
PDE_TYPES = tuple(SCHEMES)  # the built-in types


def scheme_of(pde_type: str) -> PDEScheme:
    """The :class:`PDEScheme` of ``pde_type`` (any spelling :func:`normalize_pde_type` accepts)."""
    return SCHEMES[normalize_pde_type(pde_type)]


def normalize_pde_type(pde_type: str, argument: str = "pde_type") -> str:
    """Returns the canonical spelling of ``pde_type`` or raises a ValueError naming ``argument``."""
    if isinstance(pde_type, str):
        if pde_type in SCHEMES:  # (the canonical spelling: every call after the first in a model)
            return pde_type
        name = PDE_TYPE_ALIASES.get(pde_type.lower(), pde_type.lower())
        if name in SCHEMES:
            return name
    raise ValueError(f"`{argument}` must be one of {tuple(SCHEMES)} (aliases: {sorted(PDE_TYPE_ALIASES)}), "
                     f"got {pde_type!r}.")


def uses_beta(pde_type: str) -> bool:
    return scheme_of(pde_type).uses_beta


def coefficient_bounds(pde_type: str, causal: bool):
    """``((alpha_min, alpha_max), (beta_min, beta_max) | None)`` inside which the scheme is non-expansive."""
    return scheme_of(pde_type).bounds[bool(causal)]


def _as_coefficient(value, name: str, channels: int, device, interval=None, scheme=None) -> Optional[torch.Tensor]:
    """``value`` as a tensor: a scalar (0-d or one element, as a module holds it) or ``[channels]``. A Python number
    outside ``interval`` (that of ``scheme``, a ``(pde_type, causal)``) raises; a tensor's values are not checked
    (reading them would synchronise)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"`{name}` must be a float, a 0-d tensor or a tensor of shape [channels], got {value!r}.")
        if interval is not None and not interval[0] <= value <= interval[1]:  # NaN fails too
            kind = "causal" if scheme[1] else "bidirectional"
            raise ValueError(f"`{name}`={value!r} is outside the stable interval [{interval[0]}, {interval[1]}] of "
                             f"the {kind} {scheme[0]} scheme (`cta.coefficient_bounds(pde_type, causal)`), where the "
                             "explicit steps are not stable. Pass a value in that interval.")
        # A fill on the device, not a host-to-device copy: capturable in CUDA graphs, no synchronisation.
        value = torch.full((), float(value), dtype=torch.float64, device=device)  # cast to the compute dtype later
    if value.dim() not in (0, 1) or (value.dim() == 1 and value.shape[0] not in (1, channels)):
        raise ValueError(f"`{name}` must be a scalar or have shape [channels] = [{channels}], "
                         f"got shape {tuple(value.shape)}.")
    if not value.is_floating_point():
        raise ValueError(f"`{name}` must be a floating point tensor, got dtype {value.dtype}.")
    return value


def check_steps(steps, name: str = "steps") -> int:
    """``steps`` if it is an int in ``[0, MAX_PDE_STEPS]``; else a ValueError naming the argument ``name``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_PDE_STEPS:
        raise ValueError(f"`{name}` must be an int in [0, {MAX_PDE_STEPS}], got {steps!r}.")
    return steps


def _check_operator(pde_type, steps, alpha, beta, channels: int, device, causal: bool):
    """(pde_type, alpha, beta) normalised: the checks every entry point (reference and Triton) shares."""
    pde_type = normalize_pde_type(pde_type)
    check_steps(steps)
    scheme = (pde_type, bool(causal))
    alpha_bounds, beta_bounds = COEFFICIENT_BOUNDS[scheme]
    alpha = _as_coefficient(alpha, "alpha", channels, device, alpha_bounds, scheme)
    if alpha is None:
        raise ValueError("`alpha` is required.")
    beta = _as_coefficient(beta, "beta", channels, device, beta_bounds, scheme)
    if beta_bounds is None:
        beta = None  # the scheme has no beta: ignored
    elif beta is None:
        raise ValueError(f"`beta` is required for pde_type={pde_type!r}.")
    return pde_type, alpha, beta


def check_pde_arguments(hidden_states: torch.Tensor, pde_type: str, steps: int, alpha, beta,
                        attention_mask: Optional[torch.Tensor], initial_state: Optional[torch.Tensor] = None,
                        causal: bool = False):
    """Validates the arguments of :func:`pde_refine`; returns ``(pde_type, alpha, beta)`` normalised (a float or
    one-element coefficient as a 0-d tensor on ``hidden_states``' device; ``beta`` None for the schemes without one)."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
        raise ValueError(f"`hidden_states` must have shape [batch, seq, channels], got {shape}.")
    if not hidden_states.is_floating_point():
        raise ValueError(f"`hidden_states` must be a floating point tensor, got dtype {hidden_states.dtype}.")
    batch, seq, channels = hidden_states.shape
    pde_type, alpha, beta = _check_operator(pde_type, steps, alpha, beta, channels, hidden_states.device, causal)
    check_attention_mask(attention_mask, batch, seq)
    if initial_state is not None:
        if not causal:
            raise ValueError("`initial_state` is only defined for causal=True.")
        if initial_state.shape != (batch, steps, channels):
            raise ValueError(f"`initial_state` must have shape [batch, steps, channels] = [{batch}, {steps}, "
                             f"{channels}], got {tuple(initial_state.shape)}.")
    return pde_type, alpha, beta


def check_attention_mask(attention_mask, batch: int, seq: int) -> None:
    """Raises unless ``attention_mask`` is None or ``[batch, seq]`` like the hidden states it walls."""
    if attention_mask is not None and attention_mask.shape != (batch, seq):
        raise ValueError(f"`attention_mask` must have shape [batch, seq] = [{batch}, {seq}] like `hidden_states`, "
                         f"got {tuple(attention_mask.shape)}.")


def check_bounds(bounds):
    """``coefficient_bounds`` as a hashable ``((alpha_min, alpha_max), (beta_min, beta_max) | None)`` of floats."""
    if bounds is None or (type(bounds) is tuple and bounds in COEFFICIENT_BOUNDS.values()):
        return bounds
    try:
        alpha_bounds, beta_bounds = bounds
        pairs = tuple(None if p is None else (float(p[0]), float(p[1])) for p in (alpha_bounds, beta_bounds))
    except (TypeError, ValueError, IndexError):
        pairs = (None, None)
    if pairs[0] is None:
        raise ValueError("`coefficient_bounds` must be ((alpha_min, alpha_max), (beta_min, beta_max) or None), as "
                         f"`coefficient_bounds(pde_type, causal)` returns, got {bounds!r}.")
    return pairs


def check_out(out, hidden_states: torch.Tensor, needs_grad: bool) -> None:
    """Raises unless ``out`` is None or a tensor like ``hidden_states`` (shape, dtype, device) that does not share its
    memory (the kernels read tokens that ``out`` already holds refined) and no gradient is asked (as torch's ``out=``)."""
    if out is None:
        return
    if (not isinstance(out, torch.Tensor) or out.shape != hidden_states.shape or out.dtype != hidden_states.dtype
            or out.device != hidden_states.device):
        got = (tuple(out.shape), out.dtype, str(out.device)) if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"`out` must be a tensor like `hidden_states` ({tuple(hidden_states.shape)}, "
                         f"{hidden_states.dtype}, {hidden_states.device}), got {got}.")
    if out.untyped_storage().data_ptr() == hidden_states.untyped_storage().data_ptr():
        raise ValueError("`out` must not share memory with `hidden_states`: pass a separate buffer, or no `out`.")
    if needs_grad:
        raise ValueError("`out` is for inference: its result has no gradient. Call without `out` where the inputs or "
                         "coefficients require grad.")


def written_into(result, out):
    """``result`` (the refined tokens, or the pair with the final state) with its tokens in ``out``, where given."""
    if out is None:
        return result
    refined = result[0] if isinstance(result, tuple) else result
    if refined.data_ptr() != out.data_ptr():
        out.copy_(refined)
    return (out, result[1]) if isinstance(result, tuple) else out


_STATE_DTYPES = (torch.float32, torch.float64)


def check_decode_state(state, batch: int, steps: int, channels: int) -> None:
    """Raises unless ``state`` is the fp32 (fp64 for float64 models) ``[batch, steps, channels]`` (or ``[batch, steps,
    channels, 1]``) that a decode step reads and writes (one of another shape would be read out of bounds by the
    kernel)."""
    shape = (batch, steps, channels)
    if (not isinstance(state, torch.Tensor) or state.shape not in (shape, (*shape, 1))
            or state.dtype not in _STATE_DTYPES):
        got = (tuple(state.shape), state.dtype) if isinstance(state, torch.Tensor) else type(state)
        raise ValueError(f"`state` must be a float32 (or float64) tensor of shape [batch, steps, channels] = "
                         f"[{batch}, {steps}, {channels}], got {got}.")


def check_decode_levels(levels, batch: int, steps: int, channels: int) -> None:
    """Raises unless ``levels`` are the ``steps`` fp32 ``[batch, 1, channels]`` buffers of a cached state (one per
    step; or the ``[batch, 1, channels, 1]`` conv states that hold them) that a decode step reads and writes."""
    shapes = ((batch, 1, channels), (batch, 1, channels, 1))
    if (not isinstance(levels, (tuple, list)) or len(levels) != steps
            or any(not isinstance(level, torch.Tensor) or tuple(level.shape) not in shapes
                   or level.dtype not in _STATE_DTYPES for level in levels)):
        got = [(tuple(level.shape), level.dtype) if isinstance(level, torch.Tensor) else type(level)
               for level in levels] if isinstance(levels, (tuple, list)) else type(levels)
        raise ValueError(f"The cached PDE state must be {steps} float32 (or float64) tensors of shape [batch, 1, "
                         f"channels] = [{batch}, 1, {channels}], one per step; got {got}.")


def check_decode_arguments(hidden_states, state, pde_type, steps, alpha, beta, token_mask, coefficient_bounds=None,
                           state_indices=None):
    """Validates the arguments of :func:`pde_cta.pde_decode_update`; returns ``(pde_type, alpha, beta,
    coefficient_bounds)`` normalised as :func:`check_pde_arguments` does. ``hidden_states``: ``[batch, channels]`` or
    ``[batch, 1, channels]``; ``state``: ``[batch, steps, channels]`` (or the cache's ``[batch, steps, channels, 1]``
    block), or its ``steps`` level buffers (:func:`check_decode_levels`); with ``state_indices`` (``batch``
    integers), a table ``[rows, steps, channels]`` whose rows they name."""
    if (not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() not in (2, 3)
            or not hidden_states.is_floating_point() or (hidden_states.dim() == 3 and hidden_states.shape[1] != 1)):
        shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
        raise ValueError("`hidden_states` must be a floating point tensor of shape [batch, channels] or [batch, 1, "
                         f"channels] (one token per sequence), got {shape}.")
    batch, channels = hidden_states.shape[0], hidden_states.shape[-1]
    pde_type, alpha, beta = _check_operator(pde_type, steps, alpha, beta, channels, hidden_states.device, causal=True)
    if state_indices is not None:
        if (not isinstance(state_indices, torch.Tensor) or state_indices.numel() != batch
                or state_indices.is_floating_point() or state_indices.is_complex()
                or state_indices.device != hidden_states.device):
            got = (tuple(state_indices.shape), state_indices.dtype, str(state_indices.device)) \
                if isinstance(state_indices, torch.Tensor) else type(state_indices)
            raise ValueError(f"`state_indices` must be {batch} integers (one state row per sequence) on "
                             f"{hidden_states.device}, got {got}.")
        if not isinstance(state, torch.Tensor) or state.dim() != 3:
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state)
            raise ValueError(f"With `state_indices`, `state` must be a table [rows, steps, channels], got {got}.")
        check_decode_state(state, state.shape[0], steps, channels)
    elif isinstance(state, torch.Tensor):
        check_decode_state(state, batch, steps, channels)
    else:
        check_decode_levels(state, batch, steps, channels)
    if token_mask is not None and token_mask.numel() != batch:
        raise ValueError(f"`token_mask` must have {batch} elements (one per sequence), got {tuple(token_mask.shape)}.")
    return pde_type, alpha, beta, check_bounds(coefficient_bounds)


class _StraightThroughClamp(torch.autograd.Function):
    """Clamps in the forward pass, passes the gradient unchanged (so a coefficient at a bound can come back)."""

    @staticmethod
    def forward(ctx, raw, low, high):
        return raw.clamp(low, high)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def project_coefficient(raw: torch.Tensor, bounds) -> torch.Tensor:
    """The coefficient the scheme uses: ``raw`` projected onto ``bounds`` ``(low, high)`` (straight-through gradient).

    The parameter *is* the coefficient while inside its bounds, so ``init="identity"`` (0) is exact, and no value
    the optimiser can reach leaves the stable region. (A sigmoid cannot reach 0 and saturates near its bounds.)
    """
    if raw is None or bounds is None:
        return raw
    if not (torch.is_grad_enabled() and raw.requires_grad):
        return raw.clamp(bounds[0], bounds[1])  # (inference: no autograd.Function, whose call costs host time)
    return _StraightThroughClamp.apply(raw, bounds[0], bounds[1])


def project_coefficients(alpha, beta, bounds):
    """``(alpha, beta)`` projected onto ``bounds`` (``((alpha_min, alpha_max), (beta_min, beta_max) | None)``, or
    None: unchanged), each by :func:`project_coefficient`."""
    if bounds is None:
        return alpha, beta
    return project_coefficient(alpha, bounds[0]), project_coefficient(beta, bounds[1])
