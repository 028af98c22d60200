# coding=utf-8
"""What a forward's PDE sites share, native and patched alike: :class:`SiteWalls`, built once per forward from its
padding mask, what tells packed sequences apart and the sequence sharding, and the one call that refines a site."""

from __future__ import annotations

import torch

from .pde_context_parallel import refine_sharded, refuse_untold_sites
from .pde_packing import packed_rows


class SiteWalls:
    """``mask``: the 2D padding mask ``[batch, past + seq]``; ``packing``: ``(position_ids, cu_seq_lens, past
    length)``; ``sharding``: a ``pde_context_parallel.SequenceSharding``; ``position_ids``: this rank's, sharded."""

    def __init__(self, mask=None, packing=None, sharding=None, position_ids=None):
        self.mask = mask
        self.packing = packing
        self.sharding = sharding
        self.position_ids = position_ids
        self._padded = None  # whether the mask has a padding position: asked once per forward, when needed
        self._step_mask = None  # the [batch, 1] mask column of a one-token step, taken once
        self._packed = {}  # length -> PackedRows or None
        self._shards = {}  # length -> this rank's shards of the sequence (with a sharding)

    @classmethod
    def of_forward(cls, attention_mask, position_ids=None, cu_seq_lens=None, cache=None, sharding=None,
                   model_name: str = "model", training: bool = False) -> "SiteWalls":
        """The walls of a forward called with these arguments (a 4D mask gives none); ``training``: the model's train
        mode."""
        mask = attention_mask if torch.is_tensor(attention_mask) and attention_mask.dim() == 2 else None
        if sharding is not None and sharding.training_only and not training:
            sharding = None  # (an engine that shards train mode only, as DeepSpeed reads it: whole sequences here)
        if not torch.compiler.is_compiling():
            refuse_untold_sites(sharding, training and torch.is_grad_enabled(), model_name)
        if sharding is not None:
            if cache is not None:  # (the same on every rank: refused before any collective)
                raise ValueError(
                    f"{model_name}: a cache cannot be used while the sequence is sharded across ranks (context / "
                    "sequence parallelism serves training and full-sequence forwards; decode on one rank).")
            return cls(mask, None, sharding, position_ids)
        if (position_ids is None and cu_seq_lens is None) or (cache is not None and torch.compiler.is_compiling()):
            return cls(mask)  # (traced decoding: one token per step, no packed rows and no host read of the cache)
        past_length = 0
        if cache is not None and (not torch.is_tensor(position_ids) or position_ids.shape[-1] > 1):
            # Read before the first layer appends this forward's tokens (a one-token step holds no packed row).
            past_length = int(cache.get_seq_length())
        return cls(mask, (position_ids, cu_seq_lens, past_length))

    def token_mask(self, length: int):
        """The padding walls ``[batch, length]`` of the current tokens, or None where nothing is padded."""
        mask = self.mask
        if mask is None:
            return None
        if mask.shape[1] < length:
            raise ValueError(
                f"`attention_mask` has {mask.shape[1]} columns but the current input has {length} tokens; it must "
                "cover the cached and the current tokens ([batch, past + seq])."
            )
        if length == 1 and not torch.compiler.is_compiling():
            # One decoded token: its own column is the decode kernel's token mask, made once for all sites. On an
            # accelerator, asking whether it is all ones (to drop it) would cost a device synchronisation per token;
            # on the CPU it is a cheap read, once per token, and a dropped mask saves every site its masking ops.
            if self._step_mask is None:
                column = mask[:, -1:]  # (a view: the kernel reads the mask's own dtype)
                self._step_mask = False if column.device.type == "cpu" and bool(column.all()) else column
            return self._step_mask if self._step_mask is not False else None
        if self._padded is None:
            # Traced (torch.compile): no data-dependent branch; a mask of ones gives the same walls as no mask.
            self._padded = torch.compiler.is_compiling() or not bool(mask.all())
        return mask[:, -length:] if self._padded else None

    def packed(self, length: int):
        """The :class:`pde_packing.PackedRows` of the current ``length`` tokens (made once per length), or None."""
        if self.packing is None or length < 2:
            return None
        if length not in self._packed:
            position_ids, cu_seq_lens, past_length = self.packing
            self._packed[length] = packed_rows(position_ids, self.mask, length, cu_seq_lens, past_length)
        return self._packed[length]

    def refine(self, pde, hidden_states: torch.Tensor, cache=None) -> torch.Tensor:
        """``pde`` (a ``PDERefinement``, or PEFT's wrapper of one) applied to ``hidden_states`` behind these walls,
        with the site's state in ``cache``."""
        length = hidden_states.shape[1]
        if self.sharding is not None:
            shards = self._shards.get(length)
            if shards is None:
                shards = self._shards[length] = self.sharding.shards(length)
            mask = self.mask[:, -length:] if self.mask is not None else None
            return refine_sharded(pde, hidden_states, shards, mask, self.position_ids)
        return pde(hidden_states, self.token_mask(length), cache, self.packed(length))


NO_WALLS = SiteWalls()  # a module called by itself: no padding, no packing, no shards (nothing per forward is kept)
