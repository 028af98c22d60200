# coding=utf-8
"""PyTorch CTA model: a transformer whose token representations are refined by a PDE along the sequence."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import (create_bidirectional_mask, create_bidirectional_sliding_window_mask,
                                       create_causal_mask, create_sliding_window_causal_mask)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (BaseModelOutputWithPast, CausalLMOutputWithPast,
                                          SequenceClassifierOutputWithPast)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from .configuration_cta import CTAConfig
from .checkpoint_conversion import from_pretrained_with_pde_check, saved_as_own_class
from .pde_cache import (CACHE_ARGUMENT, CACHE_ARGUMENTS, check_pde_states, deprecate_past_key_values,
                        fill_unused_pde_states, pop_cache)
from .generation_cta import PDEGenerationMixin, refuse_vllm_transformers_backend
from .pde_cta import PDERefinement
from .pde_sites import NO_WALLS, SiteWalls
from .site_spec import build_site, cache_sites, layer_specs, site_specs
from .transformers_compat import OutputRecorder, can_return_tuple, capture_outputs, repeat_kv


class CTARMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        states = hidden_states.to(torch.float32)
        states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * states.to(hidden_states.dtype)


def make_norm(config: CTAConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return CTARMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def _site(config: CTAConfig, channels: int, layer_idx: int, placement: str) -> Optional[PDERefinement]:
    """The PDE module (``site_spec.build_site``) of ``placement`` in block ``layer_idx`` (``embedding``: before block 0), or None where none."""
    spec = layer_specs(site_specs(config), layer_idx).get(placement)
    return None if spec is None else build_site(spec, channels)


class CTARotaryEmbedding(nn.Module):
    """Plain RoPE. Frequencies are computed on the fly (no buffer to materialise after meta-device loading)."""

    def __init__(self, config: CTAConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        exponent = torch.arange(0, self.head_dim, 2, device=x.device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.base**exponent)
        freqs = position_ids[..., None].float() * inv_freq  # [batch, seq, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
        else:
            attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def allowed_keys(attention_mask, query_length, key_length, causal, batch, device):
    """Boolean ``[batch, 1, q, k]``: which keys each query may read, from whatever mask form transformers built."""
    if attention_mask is None:
        allowed = torch.ones(query_length, key_length, dtype=torch.bool, device=device)
        if causal:
            allowed = torch.tril(allowed, diagonal=key_length - query_length)
        return allowed[None, None].expand(batch, 1, query_length, key_length)
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :key_length]
    return attention_mask[..., :key_length] > torch.finfo(attention_mask.dtype).min / 2


class CTAAttention(nn.Module):
    """Multi-head attention with the ``value`` and ``attention_matrix`` PDE placements.

    ``value``: PDE on the values before attention (O(L)); for a linear PDE with symmetric step matrix ``M``,
    ``A (M V) = (A M^T) V`` (the paper's Eq. 2). ``attention_matrix``: the paper's Algorithm 1, ``A -> PDE(A)`` along
    the key axis, then ``A V`` (eager, O(L^2), per-head coefficients). Equal for bidirectional diffusion and wave; they
    differ for advection, reaction and causal stencils. Causal models wall off later keys: ``A`` stays lower-triangular.
    """

    def __init__(self, config: CTAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = config.is_causal
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.value_pde = _site(config, self.num_key_value_heads * self.head_dim, layer_idx, "value")
        self.matrix_pde = _site(config, self.num_heads, layer_idx, "attention_matrix")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, walls=NO_WALLS, cache=None,
                output_attentions=False, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        values = self.v_proj(hidden_states)
        if self.value_pde is not None:
            values = walls.refine(self.value_pde, values, cache)
        value_states = values.view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, *position_embeddings)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        dropout = self.attention_dropout if self.training else 0.0
        if self.matrix_pde is not None:
            attn_output, attn_weights = self._matrix_pde_attention(query_states, key_states, value_states,
                                                                   attention_mask, dropout)
        else:
            implementation = "eager" if output_attentions else self.config._attn_implementation
            attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
            attn_output, attn_weights = attention(
                self, query_states, key_states, value_states, attention_mask, dropout=dropout, scaling=self.scaling,
                sliding_window=self.config.sliding_window, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def _matrix_pde_attention(self, query, key, value, attention_mask, dropout):
        batch, heads, q_len, _ = query.shape
        k_len = key.shape[2]
        allowed = allowed_keys(attention_mask, q_len, k_len, self.is_causal, batch, query.device)
        key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
        scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * self.scaling
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        weights = nn.functional.softmax(scores, dim=-1)
        # Evolve each query row along the key axis; heads are the channels, masked keys are walls.
        rows = weights.permute(0, 2, 3, 1).reshape(batch * q_len, k_len, heads)
        row_mask = allowed.expand(batch, 1, q_len, k_len).reshape(batch * q_len, k_len)
        rows = self.matrix_pde(rows, row_mask)
        weights = rows.reshape(batch, q_len, k_len, heads).permute(0, 3, 1, 2).to(query.dtype)
        weights = nn.functional.dropout(weights, p=dropout, training=self.training)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class CTAMLP(nn.Module):
    def __init__(self, config: CTAConfig):
        super().__init__()
        self.gated = config.mlp_type == "gated"
        bias = config.mlp_bias
        if self.gated:
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        if self.gated:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act_fn(self.up_proj(x)))


class CTADecoderLayer(GradientCheckpointingLayer):
    """One transformer block with the ``attention_output``, ``mlp_output`` and ``block_output`` PDE placements."""

    def __init__(self, config: CTAConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.self_attn = CTAAttention(config, layer_idx)
        self.mlp = CTAMLP(config)
        self.attention_norm = make_norm(config)
        self.mlp_norm = make_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        for name in ("attention_output", "mlp_output", "block_output"):
            setattr(self, f"{name}_pde", _site(config, config.hidden_size, layer_idx, name))

    def forward(self, hidden_states, attention_mask=None, walls=NO_WALLS, position_embeddings=None,
                output_attentions=False, **kwargs):
        # The cache arrives under the installed transformers' name (its gradient checkpointing clears that one).
        cache = pop_cache(kwargs)
        normed = self.attention_norm(hidden_states) if self.pre_norm else hidden_states
        attn_output, attn_weights = self.self_attn(normed, position_embeddings=position_embeddings,
                                                   attention_mask=attention_mask, walls=walls, cache=cache,
                                                   output_attentions=output_attentions, **kwargs)
        hidden_states = self._add_residual(hidden_states, attn_output, self.attention_norm, self.attention_output_pde,
                                           walls, cache)
        normed = self.mlp_norm(hidden_states) if self.pre_norm else hidden_states
        hidden_states = self._add_residual(hidden_states, self.mlp(normed), self.mlp_norm, self.mlp_output_pde, walls,
                                           cache)
        if self.block_output_pde is not None:
            hidden_states = walls.refine(self.block_output_pde, hidden_states, cache)
        return hidden_states, attn_weights

    def _add_residual(self, residual, output, norm, pde, walls, cache):
        """``residual`` + a sub-block's ``output`` (refined by its PDE site), normalised after the sum in post-norm."""
        if pde is not None:
            output = walls.refine(pde, output, cache)
        hidden_states = residual + self.dropout(output)
        return hidden_states if self.pre_norm else norm(hidden_states)


# Every Auto class a saved CTA folder loads with under `trust_remote_code=True`.
AUTO_MAP = {"AutoConfig": "configuration_cta.CTAConfig", "AutoModel": "modeling_cta.CTAModel",
            "AutoModelForCausalLM": "modeling_cta.CTAForCausalLM",
            "AutoModelForSequenceClassification": "modeling_cta.CTAForSequenceClassification"}


class CTAPreTrainedModel(PreTrainedModel):
    config_class = CTAConfig
    config: CTAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["CTADecoderLayer"]
    _skip_keys_device_placement = list(CACHE_ARGUMENTS)
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    _supports_attention_backend = True
    # What `output_hidden_states` / `output_attentions` record (transformers' capture_outputs on CTAModel.forward).
    _can_record_outputs = {"hidden_states": CTADecoderLayer, "attentions": OutputRecorder(CTAAttention, index=1)}

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loading (earlier releases' checkpoints too); raises where PDE weights mismatch the config."""
        return from_pretrained_with_pde_check(super().from_pretrained, cls, args, kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Saves safetensors weights, the config with the full ``auto_map`` and the flat code files."""
        self.config.auto_map = dict(AUTO_MAP)
        with saved_as_own_class(self, __name__):  # (a model sharded by FSDP2 has a class of torch's)
            return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PDERefinement):
            init.constant_(module.alpha, module.alpha_init)
            if module.beta is not None:
                init.constant_(module.beta, module.beta_init)


class CTAModel(CTAPreTrainedModel):
    """The bare CTA transformer (bidirectional unless ``config.is_causal``)."""

    pde_sharding = None  # how the sequence is sharded over ranks (``cta.shard_sequences``), or None

    def __init__(self, config: CTAConfig):
        refuse_vllm_transformers_backend(config, type(self).__name__)
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        if config.position_embedding_type == "absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.rotary_emb = CTARotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        # Post-norm (BERT/paper) normalises the embeddings; pre-norm (Llama) normalises the final output.
        self.embedding_norm = make_norm(config) if config.norm_position == "post" else None
        self.norm = make_norm(config) if config.norm_position == "pre" else None
        self.embedding_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.embedding_pde = _site(config, config.hidden_size, 0, "embedding")
        self.layers = nn.ModuleList([CTADecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        # (site, cache layer, conv state) of every causal PDE site: checked before a continuation step.
        self.pde_sites = cache_sites(site_specs(config))
        self.gradient_checkpointing = False
        self.post_init()

    # As transformers' own base models, but not `merge_with_config_defaults`: it would pass the config's `is_causal`
    # on to the attention functions (the `use_cache` default is read below).
    @deprecate_past_key_values
    @capture_outputs
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, cache: Optional[Cache] = None,
                inputs_embeds: Optional[torch.FloatTensor] = None, use_cache: Optional[bool] = None,
                output_attentions: Optional[bool] = None, **kwargs):
        """``cache`` may also be given as ``past_key_values`` (its name before transformers 5.24).
        ``output_hidden_states`` / ``output_attentions`` / ``return_dict`` default to the config's."""
        cache = pop_cache(kwargs, cache)
        kwargs.pop("output_hidden_states", None)
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        seq_len = inputs_embeds.shape[1]
        cache = self._cache_in_use(cache, use_cache)
        past_seen = cache.get_seq_length() if cache is not None else 0
        # A continuation step must find every causal PDE site's state in the cache (never refine statelessly).
        check_pde_states(cache, self.pde_sites, type(self).__name__)
        # generate() gives a one-token decode step of a StaticCache its 4D masks (one per layer type): no walls.
        built_masks = attention_mask if isinstance(attention_mask, dict) or (
            torch.is_tensor(attention_mask) and attention_mask.dim() == 4) else None
        self._check_padding_mask(attention_mask, inputs_embeds.shape[0], past_seen + seq_len)
        walls = SiteWalls.of_forward(attention_mask if built_masks is None else None, position_ids,
                                     kwargs.get("cu_seq_lens_q"), cache, self.pde_sharding, type(self).__name__,
                                     self.training)
        given_position_ids = position_ids  # (packed rows are told by given positions only; see _layer_mask)
        if position_ids is None:
            position_ids = self._default_position_ids(attention_mask, inputs_embeds, past_seen)
        hidden_states = self._embed(inputs_embeds, position_ids, walls, cache)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        mask = built_masks
        if isinstance(built_masks, dict):  # (already built by generate(): the one of this model's layer type)
            mask = built_masks["sliding_attention" if self.config.sliding_window is not None else "full_attention"]
        elif built_masks is None:
            mask = self._layer_mask(attention_mask, hidden_states, cache, given_position_ids)

        for layer in self.layers:
            # (position_ids reach the attention function, as in Llama: FlashAttention's packing and Ulysses read them)
            hidden_states, _ = layer(hidden_states, attention_mask=mask, walls=walls, position_ids=position_ids,
                                     position_embeddings=position_embeddings, output_attentions=output_attentions,
                                     **{CACHE_ARGUMENT: cache}, **kwargs)
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        if cache is not None and self.pde_sites and seq_len > 1 and not torch.compiler.is_compiling():
            fill_unused_pde_states(cache)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_ARGUMENT: cache})

    def _cache_in_use(self, cache, use_cache):
        """Cache used: None for an encoder or ``use_cache`` off (training's default), else ``cache`` or a new one."""
        if use_cache is None:
            use_cache = self.config.use_cache and not (self.training and torch.is_grad_enabled())
        if not (use_cache and self.config.is_causal):
            return None
        return DynamicCache(config=self.config) if cache is None else cache

    def _check_padding_mask(self, attention_mask, batch: int, length: int):
        """Raises where a 2D ``attention_mask`` isn't ``[batch, past + seq]`` or sharding meets ``attention_matrix``."""
        if torch.is_tensor(attention_mask) and attention_mask.dim() == 2 and attention_mask.shape != (batch, length):
            raise ValueError(f"`attention_mask` must have shape [batch, past + seq] = [{batch}, {length}], got "
                             f"{tuple(attention_mask.shape)}.")
        if self.pde_sharding is not None and "attention_matrix" in self.config.pde_placements and self.config.pde_steps:
            raise ValueError("The `attention_matrix` placement cannot serve a sharded sequence (context parallelism "
                             "runs sdpa, which never forms the attention matrix); use the other placements.")

    @staticmethod
    def _default_position_ids(attention_mask, inputs_embeds, past_seen: int):
        batch, seq_len = inputs_embeds.shape[:2]
        if torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_len:]
        else:
            position_ids = torch.arange(past_seen, past_seen + seq_len, device=inputs_embeds.device)[None]
        return position_ids.expand(batch, -1)

    def _embed(self, inputs_embeds, position_ids, walls, cache):
        """The first layer's input: embeddings (+ absolute positions), norm, dropout, the embedding PDE site."""
        hidden_states = inputs_embeds
        if self.config.position_embedding_type == "absolute":
            if not torch.compiler.is_compiling() and int(position_ids.max()) >= self.config.max_position_embeddings:
                raise ValueError(f"Position {int(position_ids.max())} exceeds `max_position_embeddings` "
                                 f"({self.config.max_position_embeddings}).")
            hidden_states = hidden_states + self.embed_positions(position_ids)
        if self.embedding_norm is not None:
            hidden_states = self.embedding_norm(hidden_states)
        hidden_states = self.embedding_dropout(hidden_states)
        if self.embedding_pde is not None:
            hidden_states = walls.refine(self.embedding_pde, hidden_states, cache)
        return hidden_states

    def _layer_mask(self, attention_mask, hidden_states, cache, position_ids):
        """transformers' attention mask of this model's kind. ``position_ids``: the caller's, or None for the default
        ones (no packed rows: given them, the mask builder would sync with the device to see whether they restart)."""
        mask_kwargs = dict(config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask,
                           **{CACHE_ARGUMENT: cache})
        sliding = self.config.sliding_window is not None
        if not self.config.is_causal:
            return (create_bidirectional_sliding_window_mask if sliding else create_bidirectional_mask)(**mask_kwargs)
        create = create_sliding_window_causal_mask if sliding else create_causal_mask
        return create(position_ids=position_ids, **mask_kwargs)


class CTAForCausalLM(PDEGenerationMixin, CTAPreTrainedModel, GenerationMixin):
    """CTA decoder with a language-modelling head. Always causal: the config is switched to ``is_causal=True``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CTAConfig):
        if not config.is_causal:
            config.is_causal = True
            config.update_cache_layout()
        super().__init__(config)
        self.model = CTAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def pde_cache_sites(self):
        """``[(site, cache layer, conv state)]`` of this model's causal PDE sites (what ``generate()`` checks)."""
        return self.model.pde_sites

    # As LlamaForCausalLM: the output flags reach the base model's `capture_outputs` in `kwargs` (config defaults).
    @deprecate_past_key_values
    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        """As :meth:`CTAModel.forward`, plus ``labels`` (the LM loss) and ``logits_to_keep``."""
        cache = pop_cache(kwargs, cache)
        # (return_dict=True: the base model follows `config.return_dict` otherwise; can_return_tuple handles ours)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, keep, :])
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size, **kwargs)
        cache = getattr(outputs, CACHE_ARGUMENT)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions, **{CACHE_ARGUMENT: cache})


class CTAForSequenceClassification(CTAPreTrainedModel):
    """CTA encoder with a classification / regression head (``problem_type`` as in transformers' heads) on a pooled
    representation (``config.pooling``: ``mean`` over valid tokens as in the paper, ``cls`` or ``last`` valid token)."""

    # The loss is a per-device mean (it takes no `num_items_in_batch`): Trainer must not rescale it under DDP.
    accepts_loss_kwargs = False

    def __init__(self, config: CTAConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = CTAModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def pool(self, hidden_states, attention_mask):
        batch, seq_len = hidden_states.shape[:2]
        mask = (torch.ones(batch, seq_len, device=hidden_states.device) if attention_mask is None
                else attention_mask[:, -seq_len:].to(hidden_states.device)).to(hidden_states.dtype)
        if self.config.pooling == "mean":
            return (hidden_states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        positions = torch.arange(seq_len, device=hidden_states.device)
        valid = mask.bool()
        index = (torch.where(valid, positions, seq_len).min(1).values.clamp(max=seq_len - 1)
                 if self.config.pooling == "cls" else torch.where(valid, positions, -1).max(1).values.clamp(min=0))
        return hidden_states[torch.arange(batch, device=hidden_states.device), index]

    @deprecate_past_key_values
    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, **kwargs):
        """As :meth:`CTAModel.forward`, plus ``labels``; a cache and ``use_cache`` are accepted and ignored."""
        pop_cache(kwargs)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=False, return_dict=True, **kwargs)
        logits = self.score(self.dropout(self.pool(outputs.last_hidden_state, attention_mask)))
        loss = None if labels is None else self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        return SequenceClassifierOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                                attentions=outputs.attentions)


__all__ = ["CTAPreTrainedModel", "CTAModel", "CTAForCausalLM", "CTAForSequenceClassification"]
