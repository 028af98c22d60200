# coding=utf-8
"""A causal PDE site over a serving engine's flat batch (vLLM's layout; no engine imported here): the tokens of many
sequences in one ``[tokens, channels]`` tensor, one-token decodes first, then prefill chunks, and each sequence's
state ``[steps, channels]`` (fp32) in a slot of a state table ``[slots, steps, channels]``.

* decodes: one :func:`pde_cta.pde_decode_update` for all of them on their gathered states (the fused Triton decode
  kernel on CUDA), written back to their slots;
* prefill chunks: each refined by :func:`pde_cta.pde_refine` from its slot's state where the chunk continues its
  sequence (chunked prefill, a prefix-cache hit) and from the wall otherwise; the final state is written to the slot.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .pde_cta import pde_decode_update, pde_refine


def refine_flat_batch(hidden_states: torch.Tensor, output: torch.Tensor, states: torch.Tensor, *,
                      decode_slots: Optional[torch.Tensor], prefill_starts: Sequence[int],
                      prefill_slots: Sequence[int], prefill_continues: Sequence[bool], pde_type: str, steps: int,
                      alpha, beta=None) -> None:
    """Writes the refined ``hidden_states`` ``[tokens, channels]`` into ``output`` (tokens outside the batch's
    sequences are copied) and updates ``states`` in place.

    ``decode_slots``: the slots of the first ``len(decode_slots)`` tokens (one decoded token each), or None;
    ``prefill_starts``: token offsets of the prefill chunks and the end of the last (``len(prefill_slots) + 1``
    numbers); ``prefill_continues``: whether each chunk starts from its slot's state. ``alpha`` / ``beta``: the
    coefficients, inside the causal scheme's bounds."""
    decodes = 0 if decode_slots is None else decode_slots.numel()
    end = prefill_starts[-1] if len(prefill_starts) else decodes
    if end < hidden_states.shape[0]:
        output[end:] = hidden_states[end:]  # (tokens that pad the batch to a captured size)
    operator = dict(pde_type=pde_type, steps=steps, alpha=alpha, beta=beta)
    if decodes == 1 and states.device.type == "cpu":  # (one sequence: its slot as a view, updated in place)
        slot = int(decode_slots.reshape(-1)[0])
        output[:1] = pde_decode_update(hidden_states[:1], states[slot:slot + 1], **operator)
    elif decodes:
        state = states[decode_slots]  # [decodes, steps, channels], gathered: updated in place, then scattered back
        output[:decodes] = pde_decode_update(hidden_states[:decodes], state, **operator)
        states[decode_slots] = state
    for start, stop, slot, continues in zip(prefill_starts, prefill_starts[1:], prefill_slots, prefill_continues):
        initial = states[slot].unsqueeze(0) if continues else None
        refined, final = pde_refine(hidden_states[start:stop].unsqueeze(0), causal=True, initial_state=initial,
                                    return_final_state=True, **operator)
        output[start:stop] = refined[0]
        states[slot] = final[0]
