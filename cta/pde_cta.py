# coding=utf-8
"""The CTA PDE operator's backend dispatch (PyTorch reference or Triton kernels) and its learnable module,
:class:`PDERefinement`. The schemes and their stability: ``pde_reference``; the bounds: ``pde_spec``."""

from __future__ import annotations

import importlib.util
import sys
import weakref
from typing import Optional

import torch
from torch import nn

from .kernels_config import MAX_FUSED_STEPS
from .pde_cache import cached_pde_state, conv_state_block, records_past, store_pde_state
from .pde_decode import causal_decode_map, pde_decode_update
from .pde_filters import filtered_refine
from .pde_reference import causal_state_history, pde_decode_step_reference, pde_refine_reference
# (the operator's public names are re-exported here too)
from .pde_spec import (COEFFICIENT_BOUNDS, MAX_PDE_STEPS, PAPER_COEFFICIENTS, PDE_BACKENDS, PDE_TYPE_ALIASES,  # noqa
                       PDE_TYPES, WAVE_DAMPING, check_decode_arguments, check_pde_arguments, check_steps,
                       clamp_coefficients, coefficient_bounds, normalize_pde_type, scheme_of, uses_beta)


_DECODE_KEPT = ("_kept_scalar_decode", "_kept_state_block")  # PDERefinement's per-site decode memos
# A site's settings after construction (issue 69): ``steps`` and ``backend`` may change, every path reading them at the
# call (what they derive, the C++ launcher's key and the decode memos, made again on assignment); these cannot.
_FIXED_SETTINGS = {
    "pde_type": "its coefficients (beta or not), their stable bounds and its kernels follow from it",
    "causal": "its stable bounds and its cache state follow from it",
    "alpha_bounds": "they are the scheme's stable interval for its type and causality (pde_spec.coefficient_bounds)",
    "beta_bounds": "they are the scheme's stable interval for its type and causality (pde_spec.coefficient_bounds)",
}
_TRITON = []  # [(cta.triton_cta or None, why it cannot run here)] once looked up (cached: decode asks per token)
# Dtypes the Triton backend takes: fp32 / bf16 / fp16 run fused, fp64 runs the reference inside it.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _triton_lookup():
    """``(cta.triton_cta, None)`` when Triton can run here, else ``(None, the missing requirement)``; looked up
    once."""
    if not _TRITON:
        module, missing = None, None
        try:  # a `from .x import` line: transformers' remote-code loader copies the files such lines name
            from .triton_cta import pde_refine_triton

            module = sys.modules[pde_refine_triton.__module__]
        except ImportError as error:
            missing = f"cta.triton_cta does not import ({error})"
        if importlib.util.find_spec("triton") is None:  # kernels_jit imports without triton; tell that case apart
            module, missing = None, "Triton is not installed (`pip install triton`)"
        elif module is not None and not module.is_available():
            missing = ("there is no CUDA device (torch.cuda.is_available() is False) and Triton's interpreter is off "
                       "(TRITON_INTERPRET=1, set before triton is imported, runs the kernels on CPU)")
        _TRITON.append((module if missing is None else None, missing))
    return _TRITON[0]


def triton_available() -> bool:
    """True when the Triton kernels can run here (triton importable, and CUDA or ``TRITON_INTERPRET=1``)."""
    return _triton_lookup()[0] is not None


def triton_missing_requirement(tensor: torch.Tensor) -> Optional[str]:
    """Why ``backend="triton"`` cannot refine ``tensor`` here, or None when it can (host-side checks only)."""
    module, missing = _triton_lookup()
    if missing is not None:
        return missing
    if not (tensor.is_cuda or module.INTERPRET):
        return (f"`hidden_states` is on {tensor.device}: the kernels run on CUDA tensors (on CPU only through Triton's "
                "interpreter, TRITON_INTERPRET=1, which is off)")
    if tensor.dtype not in TRITON_DTYPES:
        return f"`hidden_states` has dtype {tensor.dtype}; the Triton backend takes {[str(d) for d in TRITON_DTYPES]}"
    return None


def _use_triton(backend: str, tensor: torch.Tensor) -> bool:
    if backend not in PDE_BACKENDS:
        raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {backend!r}.")
    if backend == "torch" or not torch.is_tensor(tensor):
        return False  # (not a tensor: the reference's argument check names it)
    if backend == "triton":
        missing = triton_missing_requirement(tensor)
        if missing is not None:
            raise ValueError(f"`backend='triton'` cannot run here: {missing}. Use backend='auto' or 'torch'.")
        return True
    return tensor.is_cuda and tensor.dtype in TRITON_DTYPES and triton_available()


def pde_refine(hidden_states: torch.Tensor, *, pde_type: str, steps: int, alpha, beta=None, causal: bool = False,
               attention_mask: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
               return_final_state: bool = False, backend: str = "auto"):
    """Refines ``hidden_states`` ``[batch, seq, channels]`` with ``steps`` explicit steps of the PDE ``pde_type``.

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

    A Python-number ``alpha`` / ``beta`` outside its stable interval (``coefficient_bounds``) raises a ValueError;
    tensors are checked for shape and dtype, not range-checked (reading values would synchronise with the device).
    """
    kwargs = dict(pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, causal=causal,
                  attention_mask=attention_mask, initial_state=initial_state, return_final_state=return_final_state)
    if _use_triton(backend, hidden_states):
        return _triton_lookup()[0].pde_refine_triton(hidden_states, **kwargs)
    if backend == "auto" and causal and attention_mask is None and _on_cpu_without_grad(hidden_states, initial_state):
        pde, alpha, beta = check_pde_arguments(hidden_states, pde_type, steps, alpha, beta, None, initial_state, True)
        scheme = scheme_of(pde)
        if steps and scheme.filters(True) and alpha.numel() == 1 and (beta is None or beta.numel() == 1) \
                and not _needs_grad(alpha, beta):  # (the constant-coefficient causal schemes as one banded filter)
            c = alpha.item() + (beta.item() if scheme.advection else 0.0)
            return filtered_refine(hidden_states, c, pde_type=pde, steps=steps, alpha=alpha, beta=beta,
                                   initial_state=initial_state, return_final_state=return_final_state)
        kwargs.update(pde_type=pde, alpha=alpha, beta=beta)
    return pde_refine_reference(hidden_states, **kwargs)


def _on_cpu_without_grad(hidden_states, initial_state) -> bool:
    """A CPU call, outside ``torch.compile``, whose tensors ask no gradient (the filter paths' condition)."""
    return (torch.is_tensor(hidden_states) and hidden_states.device.type == "cpu"
            and not torch.compiler.is_compiling() and not _needs_grad(hidden_states, initial_state))


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in tensors)


def pde_decode_step(hidden_states, state, *, pde_type, steps, alpha, beta=None, token_mask=None, backend="auto",
                    coefficient_bounds=None):
    """One causal decode step, ``state`` updated in place, with :func:`pde_decode_step_reference`'s semantics: the
    Triton decode kernel on CUDA eager, else plain torch ops (``pde_decode``), which Inductor fuses with the norm that
    follows (docs/decoding.md)."""
    kwargs = dict(pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, token_mask=token_mask,
                  coefficient_bounds=coefficient_bounds)
    if _use_triton(backend, hidden_states) and not torch.compiler.is_compiling():
        return _triton_lookup()[0].pde_decode_step_triton(hidden_states, state, **kwargs)
    pde_type, alpha, beta, bounds = check_decode_arguments(hidden_states, state, pde_type, steps, alpha, beta,
                                                           token_mask, coefficient_bounds)
    alpha, beta = clamp_coefficients(alpha, beta, bounds)
    return pde_decode_update(hidden_states, state, pde_type=pde_type, steps=steps, alpha=alpha, beta=beta,
                             token_mask=token_mask)


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


def _scalar_coefficients_as_one_element(module, state_dict, prefix, *args):
    """``load_state_dict`` pre-hook: a 0-d coefficient (how 0.1.0 saved a scalar) becomes the 1-element tensor the
    module holds now (transformers' own loader: ``checkpoint_conversion``)."""
    for name in ("alpha", "beta"):
        value = state_dict.get(prefix + name)
        if torch.is_tensor(value) and value.dim() == 0:
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
        self._launch_config = (self.pde_type, steps, self.causal, self.bounds)  # (the C++ launcher's plans: kernels_cpp)
        if backend != "torch":
            _triton_lookup()  # (now, not in the first forward: under torch.compile its import would break the graph)
        self._built = True

    def __setattr__(self, name, value):
        """``steps`` and ``backend`` may be set after construction (an ablation, a curriculum over steps: every path
        reads them at the call); the type, causality and bounds cannot (build a new site, or patch again)."""
        if name in _FIXED_SETTINGS and self.__dict__.get("_built"):
            raise AttributeError(
                f"PDERefinement.{name} is fixed at construction ({_FIXED_SETTINGS[name]}); build a new "
                f"PDERefinement, or unpatch the model (cta.unpatch_model) and patch it again, with the {name} you "
                "want. `steps`, `backend` and the coefficients (alpha, beta) may be changed on a built site.")
        if name == "steps" and self.__dict__.get("_built"):
            super().__setattr__(name, check_steps(value))
            self._launch_config = (self.pde_type, value, self.causal, self.bounds)
            for kept in _DECODE_KEPT:  # (the CPU decode map has one row per step)
                self.__dict__.pop(kept, None)
            return
        if name == "backend" and self.__dict__.get("_built"):
            if value not in PDE_BACKENDS:
                raise ValueError(f"`backend` must be one of {PDE_BACKENDS}, got {value!r}.")
            super().__setattr__(name, value)
            if value != "torch":
                _triton_lookup()
            return
        super().__setattr__(name, value)

    @property
    def bounds(self):
        """``(alpha_bounds, beta_bounds)``, as ``coefficient_bounds`` arguments take them."""
        return self.alpha_bounds, self.beta_bounds

    def extra_repr(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        return f"{self.pde_type}, steps={self.steps}, {kind}, channels={self.channels}, per_channel={self.per_channel}"

    def coefficients(self):
        """The effective (projected) ``(alpha, beta)`` used by the scheme."""
        alpha = project_coefficient(self.alpha, self.alpha_bounds)
        beta = project_coefficient(self.beta, self.beta_bounds) if self.beta is not None else None
        return alpha, beta

    def _decode_step(self, hidden_states, levels, attention_mask):
        """One token ``[batch, 1, channels]``; ``levels`` (this site's cached state, one fp32 conv state per step) are
        updated in place. CUDA eager: the fused kernel on the raw parameters, projected in the kernel (decode is
        host-bound). Elsewhere and traced: ``pde_decode.pde_decode_update``'s plain torch ops."""
        compiling = torch.compiler.is_compiling()
        if (levels[0].dtype == torch.float32 and self.steps <= MAX_FUSED_STEPS and not compiling
                and _use_triton(self.backend, hidden_states)):  # (on CUDA, or Triton's interpreter on the CPU)
            if levels[0].shape[-1] != 1:  # (a cache that kept several positions: the kernel takes the last one's)
                levels = [level[..., -1] for level in levels]
            return _triton_lookup()[0].pde_decode_token_triton(
                hidden_states, levels, self.alpha, self.beta, attention_mask, self.pde_type, self.steps, self.bounds
            )
        alpha = self.alpha
        on_cpu = levels[0].is_cpu and not compiling
        if on_cpu and alpha.numel() == 1:
            # On the CPU, reading a value costs no device synchronisation: scalar coefficients are read as Python
            # floats, and what they give (projected values, the linear schemes' map) is kept while they keep their
            # values (formed again after a training step). (A step mask of ones was dropped by the site's walls.)
            beta = self.beta
            key = (alpha.item(), None if beta is None else beta.item(), levels[0].dtype)
            kept = self.__dict__.get("_kept_scalar_decode")
            if kept is None or kept[0] != key:
                kept = self.__dict__["_kept_scalar_decode"] = (key, *self._scalar_decode(*key))
            alpha, beta, decode_map = kept[1:]
        else:
            (alpha, beta), decode_map = self.coefficients(), None
        block = self._state_block(levels) if on_cpu else None
        return pde_decode_update(hidden_states, levels, pde_type=self.pde_type, steps=self.steps, alpha=alpha,
                                 beta=beta, token_mask=attention_mask, decode_map=decode_map, block=block)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_cache_steps", self.steps)  # (a site pickled before 0.2.0: torch.save(model))
        self.__dict__.setdefault("_built", True)

    def _check_cache_steps(self):
        """Raises where ``steps`` was raised after construction beyond the conv states the site owns in a cache."""
        if self.steps > self._cache_steps:
            raise ValueError(
                f"This causal PDE site was built with steps={self._cache_steps} and owns that many conv states of its "
                f"cache layer (one per step); with steps={self.steps} it would use the states of another site. With a "
                f"cache, use steps <= {self._cache_steps}, or build the model (pde_steps) or patch it again with the "
                "steps you want; calls without a cache (training, full-sequence forwards) take any steps.")

    def __getstate__(self):
        # What CPU decoding keeps per site (the coefficients' values, the cache's state block) is found again from the
        # parameters and the cache: not pickled (`torch.save(model)`), and its weak references could not be.
        return {key: value for key, value in super().__getstate__().items() if key not in _DECODE_KEPT}

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

    def _scalar_decode(self, alpha: float, beta, dtype):
        """``(alpha, beta, decode map)`` of raw scalar coefficients: projected onto their bounds, and the
        ``[S+1, S+1]`` map of a linear scheme (else None)."""
        alpha = min(max(alpha, self.alpha_bounds[0]), self.alpha_bounds[1])
        beta = None if beta is None else min(max(beta, self.beta_bounds[0]), self.beta_bounds[1])
        if not scheme_of(self.pde_type).linear:
            return alpha, beta, None
        as_tensor = lambda value: None if value is None else torch.tensor(value, dtype=dtype)  # noqa: E731
        decode_map = causal_decode_map(self.pde_type, self.steps, as_tensor(alpha), as_tensor(beta), dtype)
        return alpha, beta, decode_map[..., 0].contiguous()

    def forward(self, hidden_states, attention_mask=None, cache=None, packed=None):
        """Refines ``hidden_states`` ``[batch, seq, channels]``; ``attention_mask`` ``[batch, seq]`` (0: padding),
        ``cache``: a Cache holding this site's causal state, ``packed``: the ``pde_packing.PackedRows`` of rows that
        hold several sequences."""
        if self.steps == 0:
            return hidden_states
        if packed is not None:
            return self._packed_forward(hidden_states, cache, packed)
        if cache is None and hidden_states.is_cuda and self.backend != "torch" and not torch.compiler.is_compiling():
            # eager CUDA without a cache (training, full-sequence forwards): the C++ launcher where it has a plan
            kernels = _triton_lookup()[0]
            refined = None if kernels is None else kernels.refine_planned(self._launch_config, hidden_states,
                                                                          self.alpha, self.beta, attention_mask)
            if refined is not None:
                return refined
        state, differentiable, history = None, False, False
        if cache is not None and self.causal:
            self._check_cache_steps()
            if self.layer_idx is None:
                raise ValueError("PDERefinement needs `layer_idx` to read/write its state in a Cache.")
            # (history: a cache that may be rolled back, assisted decoding, keeps the state after every position)
            levels, history = cached_pde_state(cache, self.layer_idx, self.state_idx, self.steps)
            differentiable = torch.is_grad_enabled() and (
                hidden_states.requires_grad or self.alpha.requires_grad
                or (self.beta is not None and self.beta.requires_grad)
            )
            if levels is not None and hidden_states.shape[1] == 1 and not (differentiable or history):
                # one decoded token (the decode kernel has no backward: under autograd the chunked path below)
                return self._decode_step(hidden_states, levels, attention_mask)
            # ([batch, steps, channels], a copy: autograd may save it, and the cache's buffers are overwritten below)
            state = None if levels is None else torch.cat([level[..., -1] for level in levels], dim=1)
        if (cache is None or not self.causal) and _use_triton(self.backend, hidden_states):
            refined = _triton_lookup()[0].pde_refine_module_triton(
                hidden_states, self.alpha, self.beta, attention_mask, self.pde_type, self.steps, self.causal,
                self.bounds)
            if refined is not None:
                return refined
        alpha, beta = self.coefficients()
        kwargs = dict(pde_type=self.pde_type, steps=self.steps, alpha=alpha, beta=beta, causal=self.causal,
                      attention_mask=attention_mask)
        if cache is None or not self.causal:
            return pde_refine(hidden_states, backend=self.backend, **kwargs)
        if history:  # (the reference: the fused kernels return the last state only)
            kwargs.pop("causal")
            out, states = causal_state_history(hidden_states, initial_state=state, **kwargs)
        else:
            out, final_state = pde_refine(hidden_states, initial_state=state, return_final_state=True,
                                          backend=self.backend, **kwargs)
            states = final_state.unsqueeze(-1)
        self._store_states(cache, states, hidden_states.dtype)
        return out

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
            self._check_cache_steps()
            alpha, beta = self.coefficients()
            out, states = causal_state_history(slots, pde_type=self.pde_type, steps=self.steps, alpha=alpha,
                                               beta=beta, attention_mask=packed.mask)
            self._store_states(cache, packed.unpack_states(states), hidden_states.dtype)
            return packed.unpack(out)
        return packed.unpack(self(slots, packed.mask, cache))
