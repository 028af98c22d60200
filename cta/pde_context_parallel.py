# coding=utf-8
"""Causal PDE refinement of a sequence sharded across ranks (context / sequence parallelism), exact.

Under torch's ``context_parallel`` (accelerate's ``cp_size``) or DeepSpeed Ulysses each rank holds a shard. With ``S``
causal steps position ``t`` reads inputs ``t - S .. t`` only: the PDE runs on ``[halo ; chunk]`` (the ``S`` rows before
it) and keeps the chunk's rows. Layouts (:class:`SequenceShards`): ``contiguous`` (rank ``r`` holds chunk ``r`` of
``W``), torch's ``head_tail`` (``2W`` chunks, rank ``r`` holds ``r`` and ``2W - 1 - r``). No hang: all ranks run the
same collectives in order, and :func:`check_sharded_refinement` refuses what cannot be served before the first one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .pde_packing import packed_rows
from .transformers_compat import (accelerate_parallelism_config, deepspeed_sequence_parallel_group,
                                  hide_hybrid_layer_types, restore_layer_types)

LAYOUTS = ("contiguous", "head_tail")


@dataclass(frozen=True)
class SequenceShards:
    """How the global sequence is laid out over the ranks of ``group`` (None: the default group)."""

    layout: str
    world_size: int
    rank: int
    group: Any = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"`layout` must be one of {LAYOUTS}, got {self.layout!r}.")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"`world_size` must be a positive int, got {self.world_size!r}.")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"`rank` must be an int in [0, world_size={self.world_size}), got {self.rank!r}.")

    @classmethod
    def from_group(cls, layout: str, group=None) -> "SequenceShards":
        """The shards of an initialised process group (its size and this process's rank in it)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("SequenceShards.from_group needs an initialised torch.distributed process group.")
        return cls(layout, dist.get_world_size(group), dist.get_rank(group), group)

    chunks_per_rank = property(lambda self: 2 if self.layout == "head_tail" else 1)

    num_chunks = property(lambda self: self.world_size * self.chunks_per_rank)

    @property
    def local_chunks(self) -> tuple:
        """The global chunk indices this rank holds, in their order along its local sequence."""
        return (self.rank, 2 * self.world_size - 1 - self.rank) if self.layout == "head_tail" else (self.rank,)

    def owner(self, chunk: int) -> tuple:
        """``(rank, position among that rank's chunks)`` of global chunk ``chunk``."""
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} is outside [0, {self.num_chunks}).")
        if self.layout == "head_tail" and chunk >= self.world_size:
            return 2 * self.world_size - 1 - chunk, 1
        return chunk, 0

    def left_neighbour(self, position: int) -> Optional[tuple]:
        """Owner of the chunk before this rank's ``position``-th chunk; None at the global start."""
        chunk = self.local_chunks[position]
        return None if chunk == 0 else self.owner(chunk - 1)

    def global_positions(self, local_length: int) -> torch.Tensor:
        """``[local_length]`` global index of each local row (for tests and for building ``position_ids``)."""
        chunk_length = local_length // self.chunks_per_rank
        return torch.cat([torch.arange(c * chunk_length, (c + 1) * chunk_length) for c in self.local_chunks])

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full-sequence ``tensor`` (what torch's context_parallel gives each rank)."""
        if tensor.shape[dim] % self.num_chunks != 0:
            raise ValueError(f"A sequence of {tensor.shape[dim]} tokens does not split into {self.num_chunks} chunks.")
        parts = tensor.chunk(self.num_chunks, dim)
        return torch.cat([parts[chunk] for chunk in self.local_chunks], dim)


@dataclass(frozen=True)
class SequenceSharding:
    """How a model's sequences are sharded over ``group`` (None: the default group), for :func:`shard_sequences`.
    ``layout="torch"``: torch CP's default balancing (head-tail for an even local length, else contiguous; a run
    turning it off says ``contiguous``). ``training_only``: only train-mode forwards are sharded (Ulysses)."""

    layout: str = "torch"
    group: Any = None
    training_only: bool = False

    def __post_init__(self):
        if self.layout not in ("torch",) + LAYOUTS:
            raise ValueError(f"`layout` must be 'torch' (torch context_parallel's own rule) or one of {LAYOUTS}, "
                             f"got {self.layout!r}.")

    def shards(self, local_length: int) -> SequenceShards:
        """The :class:`SequenceShards` of this rank's shard of ``local_length`` tokens."""
        layout = ("head_tail" if local_length % 2 == 0 else "contiguous") if self.layout == "torch" else self.layout
        return SequenceShards.from_group(layout, self.group)

    @classmethod
    def for_accelerator(cls, accelerator) -> Optional["SequenceSharding"]:
        """The sharding of accelerate's ``parallelism_config`` (torch CP, or DeepSpeed Ulysses), or None."""
        config = getattr(accelerator, "parallelism_config", None)
        cp, sp = config is not None and config.cp_enabled, config is not None and config.sp_enabled
        if cp and sp:
            raise ValueError("`parallelism_config` enables both cp_size and sp_size: CTA serves one sequence-sharding "
                             "engine at a time (torch CP, or DeepSpeed Ulysses).")
        if cp:
            if config.cp_backend != "torch":
                raise ValueError(f"cp_backend={config.cp_backend!r} is not supported; torch's is.")
            mesh = getattr(accelerator, "torch_device_mesh", None) or accelerator.device_mesh  # (Accelerator or state)
            return cls("torch", mesh["cp"].get_group())
        if sp:
            if config.sp_backend != "deepspeed":
                raise ValueError(f"sp_backend={config.sp_backend!r} is not supported; DeepSpeed's is.")
            # (accelerate registers Ulysses with ``disable_in_eval=True``: evaluation runs on whole sequences)
            return cls("contiguous", deepspeed_sequence_parallel_group(), training_only=True)
        return None


def _site_holders(model):
    """What holds a sharding in ``model``: each patched model's per-forward context and each native CTAModel."""
    for module in model.modules():
        context = module.__dict__.get("_cta_context")
        if context is not None:
            yield context, "sharding"
        if hasattr(type(module), "pde_sharding"):  # (a native CTAModel)
            yield module, "pde_sharding"


def shard_sequences(model, sharding: Optional[SequenceSharding]):
    """Tells every PDE site of ``model`` (CTA, patched by ``cta.patch_model``, or PEFT-wrapped) how its sequences are
    sharded from now on (None: not sharded); returns ``model``. Raises where ``model`` has no PDE sites."""
    if sharding is not None and not isinstance(sharding, SequenceSharding):
        raise TypeError(f"`sharding` must be a cta SequenceSharding or None, got {type(sharding).__name__}.")
    holders = list(_site_holders(model))
    if not holders:
        raise ValueError(f"{type(model).__name__} has no CTA PDE sites: shard_sequences takes a CTA model or a model "
                         "patched with cta.patch_model.")
    for holder, name in holders:
        setattr(holder, name, sharding)
    return model


def accelerate_shards_sequences() -> bool:
    """Whether accelerate's ``parallelism_config`` shards sequences (cheap: creates and imports nothing)."""
    config = accelerate_parallelism_config()
    return config is not None and bool(config.cp_enabled or config.sp_enabled)


def refuse_untold_sites(sharding, training: bool, model_name: str = "model"):
    """Raises when accelerate shards this training forward but the model's sites were not told (``sharding`` None)."""
    if sharding is None and training and accelerate_shards_sequences():
        raise ValueError(
            f"{model_name}: accelerate's parallelism_config shards the sequence across ranks (cp_size / sp_size > 1) "
            "but the model's PDE sites were not told: pass `callbacks=[cta.ContextParallelCallback()]` to the "
            "Trainer, or call `cta.shard_sequences(model, cta.SequenceSharding.for_accelerator(accelerator))`.")


class ContextParallelCallback(TrainerCallback):
    """``Trainer(..., callbacks=[cta.ContextParallelCallback()])``: tells the model's PDE sites how a ``cp_size`` /
    ``sp_size`` ``parallelism_config`` shards sequences, at Trainer build (torch CP) and train begin (once prepared).
    They stay sharded: call ``cta.shard_sequences(model, None)`` before a plain forward or ``generate``. Else no-op."""

    _hidden_layer_types = None  # (the native config and its layer_types while the Trainer prepares the model)

    def _tell(self, model, prepared=True):
        from accelerate.state import AcceleratorState

        state = AcceleratorState()  # (the Trainer's: it builds its Accelerator in __init__, before any callback)
        config = getattr(state, "parallelism_config", None)
        if not prepared and config is not None and config.sp_enabled:
            return None  # (DeepSpeed's sequence-parallel group exists once the Trainer has prepared the model)
        sharding = SequenceSharding.for_accelerator(state)
        if sharding is not None and model is not None and any(True for _ in _site_holders(model)):
            return shard_sequences(model, sharding)
        return None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        config = getattr(self._tell(model, prepared=False), "config", None)
        # (the sites are told by now: accelerate's guard sees "full_attention" until training begins)
        self._hidden_layer_types = hide_hybrid_layer_types(config)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        restore_layer_types(self._hidden_layer_types)
        self._hidden_layer_types = None
        self._tell(model)


def check_sharded_refinement(pde_module, hidden_states, shards, token_mask=None, position_ids=None) -> int:
    """Raises what :func:`refine_sharded` cannot serve (before any collective); returns the chunk length."""
    if not isinstance(shards, SequenceShards):
        raise TypeError(f"`shards` must be a cta SequenceShards, got {type(shards).__name__}.")
    if not getattr(pde_module, "causal", False):
        raise ValueError(
            "A bidirectional (encoder) PDE site cannot refine a sharded sequence: each position reads its right "
            "neighbour too, and the halo exchange serves causal sites only. Run encoders without context / sequence "
            "parallelism, or use causal PDE sites (decoders).")
    if shards.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"`shards` spans {shards.world_size} ranks but torch.distributed is not initialised.")
    if shards.world_size > 1 and dist.get_world_size(shards.group) != shards.world_size:
        raise ValueError(f"`shards.world_size`={shards.world_size} but its process group has "
                         f"{dist.get_world_size(shards.group)} ranks.")
    if not torch.is_tensor(hidden_states) or hidden_states.dim() != 3:
        shape = tuple(hidden_states.shape) if torch.is_tensor(hidden_states) else type(hidden_states)
        raise ValueError(f"`hidden_states` must be this rank's shard [batch, local_seq, channels], got {shape}.")
    batch, local_length, _ = hidden_states.shape
    if local_length % shards.chunks_per_rank != 0:
        raise ValueError(f"`hidden_states` holds {local_length} tokens, not a multiple of the {shards.chunks_per_rank} "
                         f"chunks per rank of the {shards.layout!r} layout: the shard cannot be this layout's.")
    chunk_length = local_length // shards.chunks_per_rank
    steps = pde_module.steps
    if chunk_length < steps:
        raise ValueError(
            f"Each sequence chunk holds {chunk_length} tokens (layout {shards.layout!r}, {shards.num_chunks} chunks), "
            f"fewer than the site's steps={steps}: its halo of {steps} rows would reach past the neighbouring chunk. "
            f"Use sequences of at least {steps * shards.num_chunks} tokens, fewer ranks, or fewer PDE steps.")
    for name, value in (("token_mask", token_mask), ("position_ids", position_ids)):
        if value is not None and (not torch.is_tensor(value) or tuple(value.shape) != (batch, local_length)):
            got = tuple(value.shape) if torch.is_tensor(value) else type(value)
            raise ValueError(f"`{name}` must be this rank's shard [batch, local_seq] = [{batch}, {local_length}] "
                             f"(sharded like `hidden_states`), got {got}.")
    return chunk_length


def _all_gather(tensor, shards):
    """``[world_size, *tensor.shape]``: every rank's ``tensor``."""
    if shards.world_size == 1:
        return tensor.unsqueeze(0)
    # (concatenated along dim 0, the form every backend takes, gloo included)
    gathered = tensor.new_empty((shards.world_size * tensor.shape[0],) + tuple(tensor.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the former name: torch < 2.13)
    gather(gathered, tensor.contiguous(), group=shards.group)
    return gathered.view((shards.world_size,) + tuple(tensor.shape))


def _neighbour_rows(gathered, shards, offset):
    """Per local chunk ``c``: ``gathered``'s (``[world, chunks_per_rank, ...]``) chunk ``c + offset``, or zeros."""
    return torch.stack([gathered[shards.owner(chunk + offset)] if 0 <= chunk + offset < shards.num_chunks
                        else torch.zeros_like(gathered[0, 0]) for chunk in shards.local_chunks])


class _HaloExchange(torch.autograd.Function):
    """``tails`` ``[chunks_per_rank, ...]`` (each local chunk's last rows) -> each local chunk's halo; backward hands
    each sender its tail's gradient. (Not torch.distributed.nn's all_gather: its backward runs only where a gathered
    tensor is used, so a rank holding only the first chunk would skip it and the others would wait forever.)"""

    @staticmethod
    def forward(ctx, tails, shards):
        ctx.shards = shards
        return _neighbour_rows(_all_gather(tails, shards), shards, -1)

    @staticmethod
    def backward(ctx, grad_halos):
        return _neighbour_rows(_all_gather(grad_halos, ctx.shards), ctx.shards, +1), None


def exchange_halo(hidden_states: torch.Tensor, shards: SequenceShards, halo: int) -> torch.Tensor:
    """``[chunks_per_rank, batch, halo, channels]``: the ``halo`` rows before each local chunk of ``hidden_states``
    ``[batch, local_seq, channels]`` (zeros before the start); differentiable. All ranks call it with equal shapes."""
    batch, local_length, channels = hidden_states.shape
    chunk_length = local_length // shards.chunks_per_rank
    if local_length % shards.chunks_per_rank or not 0 < halo <= chunk_length:
        raise ValueError(f"`halo`={halo} must be in [1, chunk length] = [1, {chunk_length}] for a shard of "
                         f"{local_length} tokens in {shards.chunks_per_rank} chunk(s) (layout {shards.layout!r}).")
    chunks = hidden_states.reshape(batch, shards.chunks_per_rank, chunk_length, channels)
    return _HaloExchange.apply(chunks[:, :, chunk_length - halo:].transpose(0, 1), shards)


def refine_sharded(pde_module, hidden_states: torch.Tensor, shards: SequenceShards,
                   token_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None):
    """Applies the causal ``pde_module`` to this rank's shard ``hidden_states`` ``[batch, local_seq, channels]`` as on
    the full sequence (``token_mask`` ``[batch, local_seq]``: 0 for padding; packed rows where ``position_ids`` reset).
    All ranks call it with equal shapes, all or none with ``position_ids`` (``token_mask`` may differ). No cache."""
    chunk_length = check_sharded_refinement(pde_module, hidden_states, shards, token_mask, position_ids)
    steps = pde_module.steps
    if steps == 0:
        return hidden_states
    batch, local_length, channels = hidden_states.shape
    k = shards.chunks_per_rank
    # The walls travel with the halo: padding and positions of the halo rows (zeros, i.e. padding, before the start).
    mask = hidden_states.new_ones(batch, local_length, dtype=torch.long) if token_mask is None else token_mask.long()
    positions = torch.zeros_like(mask) if position_ids is None else position_ids.long()
    walls = torch.stack([mask, positions], -1).reshape(batch, k, chunk_length, 2)
    wall_tails = walls[:, :, chunk_length - steps:].transpose(0, 1)
    with torch.no_grad():
        halo_walls = _neighbour_rows(_all_gather(wall_tails, shards), shards, -1)
    halos = exchange_halo(hidden_states, shards, steps)  # [k, batch, steps, channels]

    # Every local chunk behind its halo, the chunks side by side in the batch: one PDE call.
    chunks = hidden_states.reshape(batch, k, chunk_length, channels).transpose(0, 1)
    extended = torch.cat([halos, chunks], 2).reshape(k * batch, steps + chunk_length, channels)
    extended_walls = torch.cat([halo_walls, walls.transpose(0, 1)], 2).reshape(k * batch, steps + chunk_length, 2)
    extended_mask = extended_walls[..., 0]
    packed = None if position_ids is None else packed_rows(extended_walls[..., 1], extended_mask, steps + chunk_length)
    refined = pde_module(extended, extended_mask, None, packed)
    refined = refined.reshape(k, batch, steps + chunk_length, channels)[:, :, steps:]
    return refined.transpose(0, 1).reshape(batch, local_length, channels)


__all__ = ["LAYOUTS", "ContextParallelCallback", "SequenceSharding", "SequenceShards", "accelerate_shards_sequences",
           "check_sharded_refinement", "exchange_halo", "refine_sharded", "refuse_untold_sites", "shard_sequences"]
