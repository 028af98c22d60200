# coding=utf-8
"""A causal PDE site over a serving engine's flat batch (vLLM's layout; no engine imported here): the tokens of many
sequences in one ``[tokens, channels]`` tensor, one-token decodes first, then prefill chunks, and each sequence's
state ``[steps, channels]`` (fp32) in a slot of a state table ``[slots, steps, channels]``.

* decodes: one :func:`pde_cta.pde_decode_update` for all of them, given their slots (``state_indices``): the C++
  kernel on the CPU reads and writes the slots in place; the fused Triton decode kernel on CUDA runs on the gathered
  states, written back;
* prefill chunks: each refined by :func:`pde_cta.pde_refine` from its slot's state where the chunk continues its
  sequence (chunked prefill, a prefix-cache hit) and from the wall otherwise; the final state is written to the slot.

What a step's batch holds (:class:`FlatBatch`) is read from the engine's metadata once per step, for every site.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .pde_cta import pde_decode_update, pde_refine


@dataclass(frozen=True)
class FlatBatch:
    """The sequences of one flat batch. ``decode_slots``: the state slots (int64) of the first ``decodes`` tokens (one
    decoded token each), or None. ``prefill_starts``: token offsets of the prefill chunks and the end of the last;
    ``prefill_slots`` / ``prefill_continues``: each chunk's slot and whether it starts from the slot's state."""

    decodes: int = 0
    decode_slots: Optional[torch.Tensor] = None
    prefill_starts: Tuple[int, ...] = ()
    prefill_slots: Tuple[int, ...] = ()
    prefill_continues: Tuple[bool, ...] = ()

    @classmethod
    def of(cls, decode_slots: Optional[torch.Tensor], prefill_starts=(), prefill_slots=(), prefill_continues=()):
        """The batch of these slots and chunks (host reads happen here, once per step)."""
        decodes = 0 if decode_slots is None else decode_slots.numel()
        slots = decode_slots.reshape(-1).long() if decodes else None
        return cls(decodes, slots, tuple(int(s) for s in prefill_starts), tuple(int(s) for s in prefill_slots),
                   tuple(bool(c) for c in prefill_continues))

    @property
    def end(self) -> int:
        """The tokens that belong to sequences (the rest pad the batch)."""
        return self.prefill_starts[-1] if self.prefill_starts else self.decodes


def refine_flat_batch(hidden_states: torch.Tensor, states: torch.Tensor, batch: FlatBatch, *, pde_type: str,
                      steps: int, alpha, beta=None, coefficient_bounds=None, out: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """The refined ``hidden_states`` ``[tokens, channels]`` (tokens outside the batch's sequences unchanged), in
    ``out`` where given (the engine's output buffer: no second copy); ``states`` updated in place. ``alpha`` /
    ``beta``: the coefficients, projected onto ``coefficient_bounds``."""
    operator = dict(pde_type=pde_type, steps=steps, alpha=alpha, beta=beta, coefficient_bounds=coefficient_bounds)
    if batch.decodes == hidden_states.shape[0] and not batch.prefill_slots:  # (decodes alone: the common step)
        return pde_decode_update(hidden_states, states, state_indices=batch.decode_slots, out=out, **operator)
    out = torch.empty_like(hidden_states) if out is None else out
    if batch.decodes:
        pde_decode_update(hidden_states[:batch.decodes], states, state_indices=batch.decode_slots,
                          out=out[:batch.decodes], **operator)
    starts = batch.prefill_starts
    for start, stop, slot, continues in zip(starts, starts[1:], batch.prefill_slots, batch.prefill_continues):
        initial = states[slot].unsqueeze(0) if continues else None
        _, final = pde_refine(hidden_states[start:stop].unsqueeze(0), causal=True, initial_state=initial,
                              return_final_state=True, out=out[start:stop].unsqueeze(0), **operator)
        states[slot] = final[0]
    if batch.end < hidden_states.shape[0]:  # (tokens that pad the batch: unchanged)
        out[batch.end:] = hidden_states[batch.end:]
    return out
