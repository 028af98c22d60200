# coding=utf-8
"""Walls between sequences packed in one row (padding-free training), for every PDE backend.

Padding-free setups (``DataCollatorWithFlattening``) concatenate sequences in one row and restart their
``position_ids`` (or pass ``cu_seq_lens_q``); the boundary between two is a wall, as padding is. :class:`PackedRows`
lays a row out with one empty (padded) slot between consecutive sequences, so no kernel needs to know about
sequences; the layout has a fixed width (``2 * seq - 1``: no host synchronisation, traceable) and is right-aligned,
so a causal site's final state is the last sequence's.
"""

from __future__ import annotations

from typing import Optional

import torch


def sequence_starts(position_ids: Optional[torch.Tensor], token_mask: Optional[torch.Tensor], length: int,
                    cu_seq_lens: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``[batch, length]`` bool, True where a real token starts a new sequence after a real token of the same row,
    or None when no row holds two sequences (found with one host synchronisation; traced, the starts are returned)."""
    if length < 2:
        return None
    if position_ids is not None and torch.is_tensor(position_ids) and position_ids.dim() == 2:
        positions = position_ids[:, -length:]
        starts = positions[:, 1:] != positions[:, :-1] + 1
    elif cu_seq_lens is not None and torch.is_tensor(cu_seq_lens):
        # FlashAttention's varlen keywords: one row (batch 1), sequence k starting at cu_seq_lens[k]
        starts = torch.zeros(1, length + 1, dtype=torch.bool, device=cu_seq_lens.device)
        starts[0, cu_seq_lens.clamp(max=length)] = True
        starts = starts[:, 1:length]
    else:
        return None
    if token_mask is not None:
        real = token_mask[:, -length:].bool()
        starts = starts & real[:, 1:] & real[:, :-1]  # (a start after padding already has its wall)
    starts = torch.nn.functional.pad(starts, (1, 0))
    if not torch.compiler.is_compiling() and not bool(starts.any()):
        return None
    return starts


class PackedRows:
    """The layout of rows with several sequences: token ``i`` of a row goes to slot ``i + n_i + (L - 1 - n)``, with
    ``n_i`` the sequence starts at or before ``i`` and ``n`` those of the row, in ``2L - 1`` slots. The empty slots
    are padding: walls."""

    def __init__(self, starts: torch.Tensor, token_mask: Optional[torch.Tensor]):
        batch, length = starts.shape
        shift = starts.long().cumsum(-1)
        self.length = length
        self.index = torch.arange(length, device=starts.device) + shift + (length - 1 - shift[:, -1:])
        real = torch.ones(batch, length, device=starts.device) if token_mask is None else token_mask[:, -length:]
        self.mask = torch.zeros(batch, 2 * length - 1, dtype=real.dtype, device=starts.device).scatter(
            1, self.index, real)

    def pack(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[batch, L, C]`` -> ``[batch, 2L - 1, C]`` (zeros in the empty slots)."""
        batch, length, channels = hidden_states.shape
        slots = hidden_states.new_zeros(batch, 2 * length - 1, channels)
        return slots.scatter(1, self.index.unsqueeze(-1).expand(-1, -1, channels), hidden_states)

    def unpack(self, slots: torch.Tensor) -> torch.Tensor:
        """``[batch, 2L - 1, C]`` -> ``[batch, L, C]``: the tokens, in their own positions."""
        return slots.gather(1, self.index.unsqueeze(-1).expand(-1, -1, slots.shape[-1]))

    def unpack_states(self, states: torch.Tensor) -> torch.Tensor:
        """A causal state history ``[batch, steps, channels, 2L - 1]`` -> the states after each token ``[..., L]``."""
        batch, steps, channels, _ = states.shape
        return states.gather(3, self.index[:, None, None, :].expand(batch, steps, channels, -1))


def packed_rows(position_ids, token_mask, length: int, cu_seq_lens=None, past_length: int = 0) -> Optional[PackedRows]:
    """The :class:`PackedRows` of the current ``length`` tokens, or None where every row holds one sequence; raises
    for packed rows that continue a cache of ``past_length`` tokens."""
    starts = sequence_starts(position_ids, token_mask, length, cu_seq_lens)
    if starts is None:
        return None
    if past_length > 0:
        raise ValueError(
            "`position_ids` restart inside a row (packed sequences) while the cache holds past tokens; packed rows "
            "cannot continue a cache. Give each sequence its own row (or no cache)."
        )
    return PackedRows(starts, token_mask)


__all__ = ["PackedRows", "packed_rows", "sequence_starts"]
