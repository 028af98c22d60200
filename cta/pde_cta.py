# coding=utf-8
"""The CTA PDE operator's backend dispatch (PyTorch reference or Triton kernels) and its learnable module,
:class:`PDERefinement`. The schemes and their stability: ``pde_reference``; the bounds: ``pde_spec``."""

from __future__ import annotations

import importlib.util
import sys
import warnings
import weakref
from functools import lru_cache
from typing import Optional

import torch
from torch import nn

from .kernels_config import MAX_FUSED_STEPS
from .kernels_cpu import STATE_DTYPES as CPU_STATE_DTYPES
from .kernels_cpu import decode_update as cpu_decode_update
from .kernels_cpu import kernel as cpu_kernel
from .kernels_cpu import runs as cpu_kernel_runs
from .pde_cache import cached_pde_state, conv_state_block, records_past, store_pde_state
from .pde_decode import decode_update_torch
from .pde_filters import filtered_refine
from .pde_reference import (causal_state_history, pde_decode_step_reference, pde_refine_reference,  # noqa: F401
                            reference_refine)
# (the operator's public names are re-exported here too)
from .pde_spec import (COEFFICIENT_BOUNDS, MAX_PDE_STEPS, PAPER_COEFFICIENTS, PDE_BACKENDS, PDE_TYPE_ALIASES,  # noqa
                       PDE_TYPES, WAVE_DAMPING, check_bounds, check_decode_arguments, check_out, check_pde_arguments,
                       check_steps, coefficient_bounds, normalize_pde_type, project_coefficient, project_coefficients,
                       scheme_of, uses_beta, written_into, SCHEMES)


# A site's settings after construction (issue 69): ``steps`` and ``backend`` may change, every path reading them at the
# call; these cannot.
_FIXED_SETTINGS = {
    "pde_type": "its coefficients (beta or not), their stable bounds and its kernels follow from it",
    "causal": "its stable bounds and its cache state follow from it",
    "alpha_bounds": "they are the scheme's stable interval for its type and causality (pde_spec.coefficient_bounds)",
    "beta_bounds": "they are the scheme's stable interval for its type and causality (pde_spec.coefficient_bounds)",
}
# Dtypes the Triton backend takes: fp32 / bf16 / fp16 run fused, fp64 runs the reference inside it.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@lru_cache(maxsize=1)
def _triton_lookup():
    """``(cta.triton_cta, None)`` when Triton can run here, else ``(None, the missing requirement)``; looked up once
    per process. Traced code reads it through the constant results below, never through this cache."""
    try:  # a `from .x import` line: transformers' remote-code loader copies the files such lines name
        from .triton_cta import refine

        module = sys.modules[refine.__module__]
    except ImportError as error:
        return None, f"cta.triton_cta does not import ({error})"
    if importlib.util.find_spec("triton") is None:  # kernels_jit imports without triton; tell that case apart
        return None, "Triton is not installed (`pip install triton`)"
    if not module.is_available():
        return None, ("there is no CUDA device (torch.cuda.is_available() is False) and Triton's interpreter is off "
                      "(TRITON_INTERPRET=1, set before triton is imported, runs the kernels on CPU)")
    return module, None


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """True when the Triton kernels can run here (triton importable, and CUDA or ``TRITON_INTERPRET=1``)."""
    return _triton_lookup()[0] is not None


@torch.compiler.assume_constant_result
def _triton_interprets() -> bool:
    module = _triton_lookup()[0]
    return bool(module is not None and module.INTERPRET)


@torch.compiler.assume_constant_result
def _triton_missing() -> str:
    return _triton_lookup()[1] or ""


def triton_missing_requirement(tensor: torch.Tensor) -> Optional[str]:
    """Why ``backend="triton"`` cannot refine ``tensor`` here, or None when it can (host-side checks only)."""
    missing = _triton_missing()
    if missing:
        return missing
    if not (tensor.is_cuda or _triton_interprets()):
        return (f"`hidden_states` is on {tensor.device}: the kernels run on CUDA tensors (on CPU only through Triton's "
                "interpreter, TRITON_INTERPRET=1, which is off)")
    if tensor.dtype not in (*TRITON_DTYPES, torch.float64):
        return (f"`hidden_states` has dtype {tensor.dtype}; the Triton backend takes "
                f"{[str(d) for d in (*TRITON_DTYPES, torch.float64)]}")
    return None


def choose_backend(backend: str, hidden_states: torch.Tensor, steps: int, state=None,
                   pde_type: Optional[str] = None) -> str:
    """``"triton"``, ``"cpu"`` or ``"torch"``: the implementation that runs a call (of :func:`pde_refine`, or of
    :func:`pde_decode_update` on ``state``), the one place it is chosen. ``auto`` takes Triton for CUDA tensors where
    it runs, and the C++ kernel for an eager CPU decode where it builds and has the scheme
    (:func:`kernels_cpu.runs`); ``triton`` raises where it cannot run, naming the missing requirement. The fused
    kernels take 1 to ``MAX_FUSED_STEPS`` steps in fp32, bf16 or fp16 (a decode: an fp32 state with contiguous
    channels, eager); the PyTorch code runs the rest."""
    if backend == "torch":
        return "torch"
    if backend not in PDE_BACKENDS:
        raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {backend!r}.")
    if (backend == "auto" and state is not None and hidden_states.device.type == "cpu"
            and not torch.compiler.is_compiling()):  # a CPU decode: the C++ kernel where it builds and is faster
        level = state if isinstance(state, torch.Tensor) else state[0]
        written = level.dtype in CPU_STATE_DTYPES and (pde_type is None or cpu_kernel_runs(pde_type))
        return "cpu" if written and cpu_kernel() is not None else "torch"
    if backend == "triton":
        missing = triton_missing_requirement(hidden_states)
        if missing is not None:
            raise ValueError(f"`backend='triton'` cannot run here: {missing}. Use backend='auto' or 'torch'.")
    elif not (hidden_states.is_cuda and hidden_states.dtype in TRITON_DTYPES and triton_available()):
        return "torch"
    if not 1 <= steps <= MAX_FUSED_STEPS or hidden_states.dtype not in TRITON_DTYPES:
        return "torch"
    if state is not None:  # a decode: the kernel writes fp32 level buffers with contiguous channels, and is not traced
        levels = (state,) if isinstance(state, torch.Tensor) else state
        if (levels[0].dtype != torch.float32 or torch.compiler.is_compiling()
                or any(level.stride(2) != 1 for level in levels)):
            return "torch"
    return "triton"


def pde_refine(hidden_states: torch.Tensor, *, pde_type: str, steps: int, alpha, beta=None, causal: bool = False,
               attention_mask: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
               return_final_state: bool = False, backend: str = "auto", coefficient_bounds=None, out=None):
    """Refines ``hidden_states`` ``[batch, seq, channels]`` with ``steps`` explicit steps of the PDE ``pde_type``
    (causal-conv1d's ``fn``; one token at a time: :func:`pde_decode_update`).

    Args:
        pde_type: ``diffusion``, ``wave``, ``reaction_diffusion`` or ``advection_diffusion`` (hyphens accepted).
        steps: number of explicit pseudo-time steps (0 = identity).
        alpha: effective diffusion coefficient (``c**2`` for the wave): float, 0-d or ``[channels]`` tensor.
        beta: effective reaction / advection coefficient (``reaction_diffusion`` / ``advection_diffusion`` only).
        causal: one-sided stencil: position ``i`` depends only on positions ``<= i``.
        attention_mask: ``[batch, seq]``, 1 for tokens, 0 for padding (a wall that is returned unchanged).
        initial_state / return_final_state: causal streaming state ``[batch, steps, channels]`` (see the reference).
        backend: ``auto`` (Triton on CUDA when importable), ``torch`` (the reference) or ``triton`` (raises,
            naming the missing requirement, where it cannot run).
        coefficient_bounds: ``((alpha_min, alpha_max), (beta_min, beta_max) | None)``: ``alpha`` / ``beta`` are raw
            values projected onto them, gradient passed straight through (:class:`PDERefinement`'s parameters).
        out: a tensor like ``hidden_states`` (not sharing its memory) that receives the refined tokens and is
            returned (no gradient; a serving engine's output buffer).

    A Python-number ``alpha`` / ``beta`` outside its stable interval (``coefficient_bounds``) raises a ValueError;
    tensors are checked for shape and dtype, not range-checked (reading values would synchronise with the device).
    """
    pde_type, alpha, beta = check_pde_arguments(hidden_states, pde_type, steps, alpha, beta, attention_mask,
                                                initial_state, causal)
    bounds = check_bounds(coefficient_bounds)
    needs_grad = _needs_grad(hidden_states, initial_state, alpha, beta)
    check_out(out, hidden_states, needs_grad)
    if choose_backend(backend, hidden_states, steps) == "triton":
        from .triton_cta import refine

        return written_into(refine(hidden_states, alpha, beta, attention_mask, initial_state, pde_type, steps,
                                   bool(causal), bool(return_final_state), bounds), out)
    alpha, beta = project_coefficients(alpha, beta, bounds)
    kwargs = dict(pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, initial_state=initial_state,
                  return_final_state=return_final_state)
    scheme = scheme_of(pde_type)
    if (backend == "auto" and causal and attention_mask is None and steps and scheme.filters(True)
            and alpha.numel() == 1 and (beta is None or beta.numel() == 1)
            and hidden_states.device.type == "cpu" and not torch.compiler.is_compiling() and not needs_grad):
        # the constant-coefficient causal schemes as one banded filter (the CPU, without gradients)
        c = alpha.item() + (beta.item() if scheme.advection else 0.0)
        return filtered_refine(hidden_states, c, out=out, **kwargs)
    return written_into(reference_refine(hidden_states, causal=causal, attention_mask=attention_mask, **kwargs), out)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def pde_decode_update(hidden_states: torch.Tensor, state, *, pde_type: str, steps: int, alpha, beta=None,
                      token_mask: Optional[torch.Tensor] = None, state_indices: Optional[torch.Tensor] = None,
                      backend: str = "auto", coefficient_bounds=None, out=None):
    """One causal decode step (causal-conv1d's ``update`` beside :func:`pde_refine`'s ``fn``): refines one token per
    sequence and updates ``state`` in place, as :func:`pde_decode_step_reference` does; returns the refined token in
    the input's shape and dtype.

    Args:
        hidden_states: ``[batch, channels]`` or ``[batch, 1, channels]``, the new token of each sequence.
        state: fp32 (fp64 for float64 models) ``[batch, steps, channels]``, as ``pde_refine(..., causal=True,
            return_final_state=True)`` returns it; or its ``steps`` level buffers (a transformers cache's conv
            states ``[batch, 1, channels, 1]``, or ``[batch, 1, channels]`` views).
        token_mask: one entry per sequence (0: padding, returned unchanged, leaving a wall as its state).
        state_indices: ``[batch]`` integers: sequence ``i``'s state is row ``state_indices[i]`` of ``state``
            (``[rows, steps, channels]``, a serving engine's state table; causal-conv1d's ``conv_state_indices``).
        pde_type, steps, alpha, beta, backend, coefficient_bounds, out: as :func:`pde_refine`'s.

    CUDA eager: the fused Triton decode kernel. CPU eager: the C++ kernel (``kernels_cpu``, built on first use).
    Elsewhere, with ``backend="torch"`` and under ``torch.compile``: plain torch ops (``pde_decode``), which Inductor
    fuses with the norm that follows (docs/decoding.md)."""
    pde_type, alpha, beta, bounds = check_decode_arguments(hidden_states, state, pde_type, steps, alpha, beta,
                                                           token_mask, coefficient_bounds, state_indices)
    check_out(out, hidden_states, False)
    if steps == 0:
        return hidden_states.clone() if out is None else out.copy_(hidden_states)
    chosen = choose_backend(backend, hidden_states, steps, state, pde_type)
    if chosen == "cpu":
        return cpu_decode_update(hidden_states, state, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta,
                                 bounds=bounds, token_mask=token_mask, state_indices=state_indices, out=out)
    table, rows = state, None
    if state_indices is not None:  # the sequences' rows, gathered, updated in place, then written back
        rows = state_indices.reshape(-1).long()
        state = table.index_select(0, rows)
    if chosen == "triton":
        from .triton_cta import launch_decode

        levels = state.split(1, dim=1) if isinstance(state, torch.Tensor) else state
        refined = launch_decode(hidden_states, levels, alpha, beta, token_mask, pde_type, steps, bounds)
    else:
        if (hidden_states.device.type == "cpu" and alpha.numel() == 1 and (beta is None or beta.numel() == 1)
                and not torch.compiler.is_compiling()):
            # On the CPU a value is read without a device synchronisation: scalar coefficients as numbers (one fused
            # op per step, no tensor product and sum)
            alpha, beta = _projected_numbers(alpha.item(), None if beta is None else beta.item(), bounds)
        else:
            alpha, beta = project_coefficients(alpha, beta, bounds)
        refined = decode_update_torch(hidden_states, state, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta,
                                      token_mask=token_mask)
    if rows is not None:
        table.index_copy_(0, rows, state)
    return written_into(refined, out)


def pde_decode_step(*args, **kwargs):
    """Deprecated name of :func:`pde_decode_update` (0.2.0), removed in 0.4.0."""
    warnings.warn("cta.pde_decode_step is renamed cta.pde_decode_update (same arguments); the old name goes in 0.4.0.",
                  FutureWarning, stacklevel=2)
    return pde_decode_update(*args, **kwargs)


def _projected_numbers(alpha: float, beta: Optional[float], bounds):
    """Scalar coefficients as numbers, projected onto ``bounds`` (or None)."""
    if bounds is None:
        return alpha, beta
    alpha = min(max(alpha, bounds[0][0]), bounds[0][1])
    if beta is not None and bounds[1] is not None:
        beta = min(max(beta, bounds[1][0]), bounds[1][1])
    return alpha, beta


def _scalar_coefficients_as_one_element(module, state_dict, prefix, *args):
    """``load_state_dict`` pre-hook: a 0-d coefficient (how 0.1.0 saved a scalar) becomes the 1-element tensor the
    module holds now (transformers' own loader: ``checkpoint_conversion``)."""
    for name in ("alpha", "beta"):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            state_dict[prefix + name] = value.reshape(1)


class PDERefinement(nn.Module):
    """Learnable PDE refinement of ``[batch, seq, channels]`` hidden states.

    ``alpha`` (and ``beta`` for reaction/advection) are scalars or per-channel vectors, used projected onto their
    stable interval (:func:`project_coefficient`). With a transformers ``Cache`` a causal site keeps its state in the
    conv states ``state_idx .. state_idx + steps - 1`` of cache layer ``layer_idx`` (one per step), so that decoding
    token by token or prefilling in chunks gives exactly the full-sequence result.

    Settings after construction: ``steps`` and ``backend`` may be set on a built site (every path, the C++ launcher
    and the decode step included, reads them at the call; with a cache, ``steps`` may go down but not above the
    steps the site was built with: the cache holds that many states per site), and so may the coefficients (values
    or parameters). ``pde_type``, ``causal`` and the bounds raise an AttributeError: build a new site, or patch again.
    A changed ``steps`` is the site's, not the saved config's (``save_pretrained`` writes the steps it was built with).
    """

    def __init__(self, channels: int, pde_type: str = "diffusion", steps: int = 1, causal: bool = False,
                 alpha: float = 0.1, beta: Optional[float] = None, per_channel: bool = False, backend: str = "auto",
                 layer_idx: Optional[int] = None, state_idx: int = 0):
        super().__init__()
        self.pde_type = normalize_pde_type(pde_type)
        check_steps(steps)
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
        # A scalar coefficient is a 1-element tensor, not 0-d: FSDP1/2 and DeepSpeed refuse 0-d parameters. The
        # operator reads a 1-element coefficient as a scalar; 0.1.0 checkpoints (0-d) load through the pre-hook below.
        self.per_channel = bool(per_channel)
        shape = (channels,) if per_channel else (1,)
        self.alpha_init = float(alpha)
        self.alpha = nn.Parameter(torch.full(shape, self.alpha_init))
        if beta_bounds is not None:
            self.beta_init = float(PAPER_COEFFICIENTS[self.pde_type][1] if beta is None else beta)
            self.beta = nn.Parameter(torch.full(shape, self.beta_init))
        else:
            self.beta_init = None
            self.register_parameter("beta", None)
        self.register_load_state_dict_pre_hook(_scalar_coefficients_as_one_element)
        # The conv states this site owns in a cache (one per step, laid out by the model or patch at construction):
        # a later `steps` may use fewer with a cache, not more.
        self._cache_steps = steps
        if backend != "torch":
            _triton_lookup()  # (now, not in the first forward: under torch.compile its import would break the graph)
        self._built = True

    def __setattr__(self, name, value):
        """``steps`` and ``backend`` may be set after construction (an ablation, a curriculum over steps: every path
        reads them at the call); the type, causality and bounds cannot (build a new site, or patch again)."""
        if self.__dict__.get("_built"):
            if name in _FIXED_SETTINGS:
                raise AttributeError(
                    f"PDERefinement.{name} is fixed at construction ({_FIXED_SETTINGS[name]}); build a new "
                    f"PDERefinement, or unpatch the model (cta.unpatch_model) and patch it again, with the {name} you "
                    "want. `steps`, `backend` and the coefficients (alpha, beta) may be changed on a built site.")
            if name == "steps":
                value = check_steps(value)
            elif name == "backend":
                if value not in PDE_BACKENDS:
                    raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {value!r}.")
                if value != "torch":
                    _triton_lookup()
        super().__setattr__(name, value)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_cache_steps", self.steps)  # (a site pickled before 0.2.0: torch.save(model))
        self.__dict__.setdefault("_built", True)

    def __getstate__(self):
        # The weak references to a cache's state block (`_state_block`) cannot be pickled, and are found again.
        return {key: value for key, value in super().__getstate__().items() if key != "_kept_state_block"}

    @property
    def bounds(self):
        """``(alpha_bounds, beta_bounds)``, as ``coefficient_bounds`` arguments take them."""
        return self.alpha_bounds, self.beta_bounds

    def extra_repr(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        return f"{self.pde_type}, steps={self.steps}, {kind}, channels={self.channels}, per_channel={self.per_channel}"

    def coefficients(self):
        """The effective (projected) ``(alpha, beta)`` used by the scheme."""
        return project_coefficients(self.alpha, self.beta, self.bounds)

    def forward(self, hidden_states, attention_mask=None, cache=None, packed=None):
        """Refines ``hidden_states`` ``[batch, seq, channels]``; ``attention_mask`` ``[batch, seq]`` (0: padding),
        ``cache``: a Cache holding this site's causal state, ``packed``: the ``pde_packing.PackedRows`` of rows that
        hold several sequences."""
        if self.steps == 0:
            return hidden_states
        if packed is not None:
            return self._packed_forward(hidden_states, cache, packed)
        if cache is None or not self.causal:
            return self._refine(hidden_states, attention_mask)
        levels, history = self._cached_levels(cache)
        if levels is not None and hidden_states.shape[1] == 1 and not (history or self._differentiable(hidden_states)):
            return self._decode(hidden_states, levels, attention_mask)
        return self._prefill(hidden_states, attention_mask, cache, levels, history)

    def _refine(self, hidden_states, attention_mask, **streaming):
        """The whole sequence (``streaming``: ``initial_state`` / ``return_final_state``)."""
        return pde_refine(hidden_states, pde_type=self.pde_type, steps=self.steps, alpha=self.alpha, beta=self.beta,
                          causal=self.causal, attention_mask=attention_mask, backend=self.backend,
                          coefficient_bounds=self.bounds, **streaming)

    def _prefill(self, hidden_states, attention_mask, cache, levels, history):
        """Tokens after the cached ``levels`` (None: the first chunk); their final state stored in ``cache`` (every
        position's where the cache may be rolled back: assisted decoding)."""
        # ([batch, steps, channels], a copy: autograd may save it, and the cache's buffers are overwritten below)
        state = None if levels is None else torch.cat([level[..., -1] for level in levels], dim=1)
        if history:  # (the reference: the fused kernels return the last state only)
            alpha, beta = self.coefficients()
            out, states = causal_state_history(hidden_states, pde_type=self.pde_type, steps=self.steps, alpha=alpha,
                                               beta=beta, attention_mask=attention_mask, initial_state=state)
        else:
            out, final_state = self._refine(hidden_states, attention_mask, initial_state=state,
                                            return_final_state=True)
            states = final_state.unsqueeze(-1)
        self._store_states(cache, states, hidden_states.dtype)
        return out

    def _decode(self, hidden_states, levels, attention_mask):
        """One token ``[batch, 1, channels]``; this site's cached state (one conv state per step) updated in place."""
        if levels[0].dim() == 4 and levels[0].shape[-1] != 1:  # (a cache that kept several positions: the last)
            levels = [level[..., -1:] for level in levels]
        # (the CPU cache's rows as one tensor: one read and one write per token; traced, the buffers as they are)
        state = self._state_block(levels) if levels[0].is_cpu and not torch.compiler.is_compiling() else None
        return pde_decode_update(hidden_states, levels if state is None else state, pde_type=self.pde_type,
                                 steps=self.steps, alpha=self.alpha, beta=self.beta, token_mask=attention_mask,
                                 backend=self.backend, coefficient_bounds=self.bounds)

    def _differentiable(self, hidden_states) -> bool:
        """Whether this call builds a graph (the decode step has no backward: such a token takes the prefill)."""
        return torch.is_grad_enabled() and (hidden_states.requires_grad or self.alpha.requires_grad
                                            or (self.beta is not None and self.beta.requires_grad))

    def _cached_levels(self, cache):
        """``(levels, records_past)`` of this site in ``cache`` (:func:`pde_cache.cached_pde_state`)."""
        if self.steps > self._cache_steps:
            raise ValueError(
                f"This causal PDE site was built with steps={self._cache_steps} and owns that many conv states of its "
                f"cache layer (one per step); with steps={self.steps} it would use the states of another site. With a "
                f"cache, use steps <= {self._cache_steps}, or build the model (pde_steps) or patch it again with the "
                "steps you want; calls without a cache (training, full-sequence forwards) take any steps.")
        if self.layer_idx is None:
            raise ValueError("PDERefinement needs `layer_idx` to read/write its state in a Cache.")
        return cached_pde_state(cache, self.layer_idx, self.state_idx, self.steps)

    def _state_block(self, levels):
        """The tensor whose rows are the conv states ``levels`` where the CPU cache holds them so (one write per
        token), else None: :func:`pde_cache.conv_state_block`, kept while the cache keeps these same tensors (held
        weakly: a finished generation's cache is freed)."""
        kept = self.__dict__.get("_kept_state_block")
        if kept is not None and len(kept[0]) == len(levels):
            for ref, level in zip(kept[0], levels):
                if ref() is not level:
                    break
            else:
                return kept[1]()
        block = conv_state_block(levels)
        refs = tuple(weakref.ref(level) for level in levels)
        self.__dict__["_kept_state_block"] = (refs, (lambda: None) if block is None else weakref.ref(block))
        return block

    def _store_states(self, cache, states, dtype):
        """Stores ``[batch, steps, channels, positions]`` as this site's conv state: fp32 (fp64 for a float64
        model)."""
        store_pde_state(cache, self.layer_idx, self.state_idx,
                        states.detach().to(torch.promote_types(dtype, torch.float32)))

    def _packed_forward(self, hidden_states, cache, packed):
        """Rows holding several sequences, refined in the walled layout of ``packed``; with a cache (a first chunk)
        the state is the last sequence's."""
        slots = packed.pack(hidden_states)
        if cache is None or not self.causal:
            return packed.unpack(self(slots, packed.mask))
        if records_past(cache, self.layer_idx):
            self._cached_levels(cache)  # (its checks)
            alpha, beta = self.coefficients()
            out, states = causal_state_history(slots, pde_type=self.pde_type, steps=self.steps, alpha=alpha,
                                               beta=beta, attention_mask=packed.mask)
            self._store_states(cache, packed.unpack_states(states), hidden_states.dtype)
            return packed.unpack(out)
        return packed.unpack(self(slots, packed.mask, cache))
