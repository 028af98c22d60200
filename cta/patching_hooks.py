# coding=utf-8
"""What runs at every forward of a patched model: the forward hooks that apply its PDE sites, and the per-forward
context (:class:`PatchContext`) that the hooks of one model share.

Each PDE module is a submodule ``cta_<placement>_pde`` of the module it refines, whose hooks find it through the module
they are called on. Every hook is a bound method of a plain site object kept in the context, so ``copy.deepcopy`` of
a patched model gives hooks bound to the copy's sites.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .pde_cache import (CACHE_ARGUMENTS, cache_lookup_order, check_pde_states, fill_unused_pde_states, find_cache,
                        is_exporting, missing_cache_error, refuse_export_with_cache)
from .pde_sites import NO_WALLS, SiteWalls
from .transformers_compat import training_forward_drops_cache


class CheckpointWalls:
    """The :class:`SiteWalls` of a training forward, kept for gradient checkpointing's recomputation of its layers in
    the backward pass. A recomputation reads the latest forward's walls, and raises where an earlier forward whose
    graph is still alive, not yet recomputed, had other walls (two forwards, then one backward through both).
    """

    def __init__(self, walls: SiteWalls, previous: Optional["CheckpointWalls"]):
        self.walls = walls
        self.recomputed = False
        self.in_graph = False  # held by the metadata of the forward's output node (set when the forward returns)
        self.rivals = []
        if previous is not None:
            self.rivals = [ref for ref in previous.rivals if ref() is not None]
            if previous.in_graph and not previous.recomputed:
                self.rivals.append(weakref.ref(previous))

    def recomputation_walls(self) -> SiteWalls:
        if not self.recomputed:
            for ref in self.rivals:
                rival = ref()
                if rival is not None and not rival.recomputed and not _same_mask(rival.walls.mask, self.walls.mask):
                    raise ValueError(
                        "CTA patch: a layer is recomputed for gradient checkpointing while two forwards with "
                        "different attention masks await their backward pass; its PDE sites cannot tell which "
                        "forward's padding walls apply. Call backward after each forward (or release the outputs "
                        "of a forward you will not backpropagate before the next one)."
                    )
            self.recomputed = True
        return self.walls


def _same_mask(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    return a.shape == b.shape and bool(torch.equal(a, b))


class PatchContext:
    """Per-forward state shared by the hooks of one patched model, captured by the base model's forward pre-hook
    (:meth:`enter`) and released by its forward hook (:meth:`exit`). ``site_hooks``: the model's site objects;
    ``takes_use_cache``: whether the base model's forward has a ``use_cache`` parameter (read once, when patched:
    under torch.compile the pre-hook is traced, and a cached signature lookup there makes Dynamo warn)."""

    def __init__(self, mask_position: Optional[int], cache_position: Optional[int], sites, model_name: str,
                 position_ids_position: Optional[int] = None, takes_use_cache: bool = False):
        self.mask_position = mask_position
        self.takes_use_cache = takes_use_cache
        self.cache_position = cache_position
        self.position_ids_position = position_ids_position
        self.sites = sites  # (site, cache layer, conv state) of every causal PDE site
        self.model_name = model_name
        self.active = False  # inside the base model's forward
        self.walls = NO_WALLS  # the SiteWalls of the current forward
        self.cache = None
        self.sharding = None  # a pde_context_parallel.SequenceSharding (cta.shard_sequences), or None
        self.stateless = False  # a training forward that starts its cache: the sites keep no PDE state in it
        self.checkpoint_walls = None  # CheckpointWalls of the latest forward run for training
        self.handles = []  # of the base model's hooks
        self.site_hooks = []  # LayerSite / OutputSite / ValueSite objects, each with its `handles`

    def enter(self, module, args, kwargs):
        """The base model's forward pre-hook: this forward's cache (checked), walls and training state."""
        compiling = torch.compiler.is_compiling()
        training = module.training and torch.is_grad_enabled()
        self.cache = cache = self._find_cache(args, kwargs)
        self._check_cache(cache, compiling)
        position_ids = self._argument(args, kwargs, "position_ids", self.position_ids_position)
        mask = self._argument(args, kwargs, "attention_mask", self.mask_position)
        self.walls = SiteWalls.of_forward(mask, position_ids, kwargs.get("cu_seq_lens_q"), cache, self.sharding,
                                          self.model_name, module.training)
        if training and not compiling:  # (traced, a recomputed layer replays the compiled graph, not these hooks)
            self.checkpoint_walls = CheckpointWalls(self.walls, self.checkpoint_walls)
        if training and cache is None:
            self._no_training_cache(args, kwargs, position_ids is not None, compiling)
        # Nothing decodes from the cache of a training forward that starts one (transformers makes one whenever
        # use_cache is on): its sites keep no PDE state there and take their cache-free (fused) path; continuing
        # that cache later raises (no state). A training forward that continues a cache keeps using its state.
        self.stateless = training and (cache is None or (not compiling and int(cache.get_seq_length()) == 0))
        self.active = True
        return args, kwargs

    def _find_cache(self, args, kwargs):
        cache = find_cache(kwargs)
        if cache is None and self.cache_position is not None and len(args) > self.cache_position:
            cache = args[self.cache_position]
        return cache

    def _check_cache(self, cache, compiling: bool):
        """A continuation step must find every causal PDE site's state in the cache (never refine statelessly).
        Traced, the eager calls before (the prefill) checked the same cache; torch.export (e.g. transformers'
        ExecuTorch recipe) is refused: the exported cache cannot carry the PDE states."""
        if cache is None or not self.sites:
            return
        if not compiling:
            check_pde_states(cache, self.sites, self.model_name)
        elif is_exporting():
            refuse_export_with_cache(self.model_name)

    def _no_training_cache(self, args, kwargs, packable: bool, compiling: bool):
        """``use_cache=False`` for a training forward given no cache, where transformers would make one it never
        decodes from (and a caller did not choose)."""
        packable = packable or kwargs.get("cu_seq_lens_q") is not None
        if self.sites and training_forward_drops_cache(compiling, packable) and kwargs.get("use_cache") is None \
                and len(args) <= 1 and self.takes_use_cache:
            kwargs["use_cache"] = False

    @staticmethod
    def _argument(args, kwargs, name, position):
        value = kwargs.get(name)
        if value is None and position is not None and len(args) > position:
            value = args[position]
        return value

    def exit(self, module, args, kwargs, output):
        """The base model's forward hook (``always_call``: it also runs when the forward raises)."""
        walls = self.checkpoint_walls
        fill = self.cache is not None and self.sites  # (a prefill or a chunk fills the unused conv states)
        if self.active and (walls is not None or fill) and output is not None and not torch.compiler.is_compiling():
            hidden = output[0] if isinstance(output, (tuple, list)) or hasattr(output, "to_tuple") else output
            grad_fn = getattr(hidden, "grad_fn", None) if walls is not None else None
            if grad_fn is not None:
                # The walls live as long as this forward's graph: what tells a later forward's recomputation that
                # this one may still be backpropagated (see CheckpointWalls).
                grad_fn.metadata["cta_checkpoint_walls"] = walls
                walls.in_graph = True
            if fill and torch.is_tensor(hidden) and hidden.dim() == 3 and hidden.shape[1] > 1:
                fill_unused_pde_states(self.cache)
        self.active = self.stateless = False
        self.cache = None
        self.walls = NO_WALLS

    def refine_site(self, pde, hidden_states, layer, cache=None):
        """Refines one site of ``layer`` with ``pde`` behind the current forward's walls (``SiteWalls.refine``)."""
        if self.active:
            return self.walls.refine(pde, hidden_states, cache)
        # Outside the model's forward: gradient checkpointing's recomputation of `layer`, or a module called by itself.
        walls = self.checkpoint_walls
        if (walls is None or not torch.is_grad_enabled() or not layer.training
                or not getattr(layer, "gradient_checkpointing", False)):
            return NO_WALLS.refine(pde, hidden_states, cache)
        return walls.recomputation_walls().refine(pde, hidden_states, cache)

    def remove_hooks(self):
        for handle in self.handles:
            handle.remove()
        for site in self.site_hooks:
            site.remove()
        self.handles, self.site_hooks = [], []


def _first_tensor(output):
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(f"CTA patch: cannot find the hidden states in an output of type {type(output).__name__}.")


def _replace_first(output, value):
    if torch.is_tensor(output):
        return value
    return type(output)((value, *output[1:])) if isinstance(output, tuple) else [value, *output[1:]]


class _Site:
    """Base of the site objects: the shared context, the layer the site belongs to, the handles of its hooks."""

    def __init__(self, context: PatchContext, layer):
        self.context = context
        self.layer = layer  # its `gradient_checkpointing` / `training` tell a recomputation apart
        self.handles = []

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


class LayerSite(_Site):
    """A decoder/encoder layer's hooks: ``cta_embedding_pde`` refines the first layer's input (a forward pre-hook),
    ``cta_block_output_pde`` its output (its first forward hook). The pre-hook, where the layer has one, also
    publishes the layer's cache to the sites nested in it and points the value sites at the current projection."""

    def __init__(self, context, layer, name: str, causal: bool, cache_position, embedding: bool, block_output: bool,
                 nested: bool, value_sites=(), cache_names=CACHE_ARGUMENTS):
        super().__init__(context, layer)
        self.name = name
        self.cache_keywords = cache_lookup_order(cache_names)  # the keywords the layer may receive the cache under
        self.causal = causal
        self.cache_position = cache_position
        self.embedding = embedding
        self.value_sites = tuple(value_sites)
        self.has_pre_hook = embedding or nested
        if self.has_pre_hook:
            self.handles.append(layer.register_forward_pre_hook(self.before, prepend=True, with_kwargs=True))
        if block_output:
            # First forward hook: every later hook (transformers' `output_hidden_states` recording among them) sees
            # the refined output that the next layer receives.
            self.handles.append(layer.register_forward_hook(self.after, prepend=True, with_kwargs=True))

    def _layer_cache(self, module, args, kwargs):
        """The cache this layer received; published for its nested sites. A layer that receives none although the
        model was called with one raises (its sites would refine statelessly)."""
        cache = find_cache(kwargs, self.cache_keywords)
        if cache is None and self.cache_position is not None and len(args) > self.cache_position:
            cache = args[self.cache_position]
        context = self.context
        if context.active:
            if context.stateless:
                cache = None
            elif cache is None and context.cache is not None and self.causal and not (
                    module.training and getattr(module, "gradient_checkpointing", False)):
                # (a checkpointed layer is handed no cache by transformers on purpose)
                raise missing_cache_error(self.name)
            context.cache = cache
        return cache

    def before(self, module, args, kwargs):
        # Once per layer and token when decoding, where host time is the cost: plain attribute reads only.
        cache = self._layer_cache(module, args, kwargs)
        for value_site in self.value_sites:
            value_site.follow_projection()
        if not self.embedding:
            return None
        context = self.context
        hidden = args[0] if args else kwargs["hidden_states"]
        refined = context.refine_site(module.cta_embedding_pde, hidden, module, cache)
        if args:
            return (refined, *args[1:]), kwargs
        kwargs["hidden_states"] = refined
        return args, kwargs

    def after(self, module, args, kwargs, output):
        context = self.context
        if self.has_pre_hook:
            cache = context.cache if context.active else None
        else:
            cache = self._layer_cache(module, args, kwargs)
        plain = type(output) is torch.Tensor
        hidden = output if plain else _first_tensor(output)
        refined = context.refine_site(module.cta_block_output_pde, hidden, module, cache)
        return refined if plain else _replace_first(output, refined)


class OutputSite(_Site):
    """Refines a module's output (its first forward hook) with its submodule ``pde_name``: the attention module
    (``attention_output``), the MLP (``mlp_output``), or BERT's dropouts before Add & Norm."""

    def __init__(self, context, layer, module, pde_name: str):
        super().__init__(context, layer)
        self.pde_name = pde_name
        self.handles.append(module.register_forward_hook(self.after, prepend=True))

    def after(self, module, args, output):
        context = self.context
        cache = context.cache if context.active else None
        plain = type(output) is torch.Tensor
        hidden = output if plain else _first_tensor(output)
        # Looked up per call: PEFT's `modules_to_save` replaces the PDE module by its own wrapper.
        pde = getattr(module, self.pde_name)
        refined = context.refine_site(pde, hidden, self.layer, cache)
        return refined if plain else _replace_first(output, refined)


class ValueSite(_Site):
    """Refines the value projection ``owner.<value_attr>`` (``value_slice``: the value part of a fused qkv
    projection) with ``owner.cta_value_pde``, through a forward hook on whatever module is the projection when the
    layer is called: a PEFT LoRA layer put in its place is refined with its LoRA delta."""

    def __init__(self, context, layer, owner, value_attr: str, value_slice):
        super().__init__(context, layer)
        self.owner = owner
        self.value_attr = value_attr
        self.value_slice = value_slice
        self.projection = None
        self.follow_projection()

    def follow_projection(self):
        projection = getattr(self.owner, self.value_attr)
        if projection is not self.projection:
            self.remove()
            self.handles.append(projection.register_forward_hook(self.after))
            self.projection = projection

    def after(self, module, args, output):
        context = self.context
        cache = context.cache if context.active else None
        pde = self.owner.cta_value_pde
        if self.value_slice is None:
            return context.refine_site(pde, output, self.layer, cache)
        low, high = self.value_slice
        refined = context.refine_site(pde, output[..., low:high], self.layer, cache)
        return torch.cat([output[..., :low], refined, output[..., high:]], dim=-1)
