# coding=utf-8
"""CTA model configuration."""

from __future__ import annotations

from functools import partial

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .pde_cta import PAPER_COEFFICIENTS, PDE_BACKENDS, check_steps, coefficient_bounds, normalize_pde_type
from .site_spec import STATE_PLACEMENTS, cache_layout, site_specs

PDE_PLACEMENTS = ("embedding", "value", "attention_output", "mlp_output", "block_output", "attention_matrix")
# Placements applied inside every selected decoder layer, in the order their cache states are numbered.
LAYER_PLACEMENTS = STATE_PLACEMENTS


def check_choice(value, field, allowed):
    if value not in allowed:
        raise ValueError(f"`{field}` must be one of {allowed}, got {value!r}.")
    return value


def _positive_int(value, field, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{field}` must be an int >= {minimum}, got {value!r}.")
    return value


def _positive_float(value, field):
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"`{field}` must be a positive float, got {value!r}.")
    return float(value)


def _probability(value, field):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
        raise ValueError(f"`{field}` must be a float in [0, 1], got {value!r}.")
    return None if value is None else float(value)


def normalize_placements(placement, field="pde_placement", allowed=PDE_PLACEMENTS):
    """``str`` or list of placements -> sorted unique list (validated)."""
    items = [placement] if isinstance(placement, str) else placement
    if not isinstance(items, (list, tuple)) or not items or any(item not in allowed for item in items):
        raise ValueError(f"`{field}` must be one of {allowed} or a non-empty list of them, got {placement!r}.")
    return [p for p in allowed if p in items]


def check_layers(layers, field, num_layers):
    """``None`` (every layer) or the sorted unique layer indices of ``layers``."""
    if layers is None:
        return None
    if not isinstance(layers, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers):
        raise ValueError(f"`{field}` must be a list of layer indices in [0, {num_layers}), got {layers!r}.")
    return sorted(set(layers))


def check_coefficient(value, field, pde_type, which, causal=None):
    """``value`` (coefficient ``which``: 0 alpha, 1 beta) as a float inside the stable interval of ``pde_type``'s
    causal or bidirectional scheme, or (``causal=None``: a config that may serve either) of one of them."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{field}` must be a float, got {value!r}.")
    kinds = ("bidirectional", "causal") if causal is None else ("causal" if causal else "bidirectional",)
    intervals = {kind: coefficient_bounds(pde_type, kind == "causal")[which] for kind in kinds}
    if None in intervals.values():  # e.g. pde_beta of a diffusion: unused
        return float(value)
    if not min(low for low, _ in intervals.values()) <= value <= max(high for _, high in intervals.values()):
        stable = " / ".join(f"{bounds} ({kind})" for kind, bounds in intervals.items())
        raise ValueError(f"`{field}` must lie in the stable interval {stable} of the {pde_type} scheme, got {value!r}.")
    return float(value)


# Argument -> its check (value, argument name) -> the value to keep.
_CHECKS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                     "max_position_embeddings"), _positive_int),
    "num_hidden_layers": partial(_positive_int, minimum=0),
    **{name: partial(check_choice, allowed=allowed) for name, allowed in (
        ("hidden_act", tuple(ACT2FN.keys())), ("mlp_type", ("standard", "gated")),
        ("norm_type", ("layernorm", "rmsnorm")), ("norm_position", ("post", "pre")),
        ("position_embedding_type", ("absolute", "rope", "none")))},
    "rope_theta": _positive_float, "layer_norm_eps": _positive_float,
    **dict.fromkeys(("hidden_dropout_prob", "attention_dropout", "classifier_dropout"), _probability),
    **dict.fromkeys(("attention_bias", "mlp_bias", "is_causal", "use_cache", "pde_per_channel"),
                    lambda value, field: bool(value)),
    "sliding_window": lambda value, field: value if value is None else _positive_int(value, field),
    "initializer_range": lambda value, field: float(value),
    "pooling": partial(check_choice, allowed=("mean", "cls", "last")),
    "pde_type": normalize_pde_type,
    "pde_steps": check_steps,
    "pde_backend": partial(check_choice, allowed=PDE_BACKENDS),
}


class CTAConfig(PretrainedConfig):
    r"""
    Configuration of a Continuous-Time Attention (CTA) transformer: a standard transformer whose token representations
    are refined by a few explicit steps of a PDE along the sequence (Zhang & Zhou, EMNLP 2025). The defaults are the
    paper's small text classifier (:meth:`paper_encoder`); :meth:`modern_decoder` gives a RoPE / RMSNorm / SwiGLU
    pre-norm decoder.

    Args:
        vocab_size (`int`, defaults to 30522): vocabulary size (the paper uses bert-base-uncased).
        hidden_size (`int`, defaults to 128): dimension of the token representations.
        num_hidden_layers (`int`, defaults to 2): number of transformer blocks.
        num_attention_heads (`int`, defaults to 4): attention heads; must divide `hidden_size`.
        num_key_value_heads (`int`, *optional*): key/value heads for grouped-query attention (default: all heads).
        intermediate_size (`int`, defaults to 256): inner dimension of the MLP.
        hidden_act (`str`, defaults to `"gelu"`): MLP activation (any key of `transformers.activations.ACT2FN`).
        mlp_type (`str`, defaults to `"standard"`): `"standard"` (up, act, down) or `"gated"` (SwiGLU-style).
        norm_type (`str`, defaults to `"layernorm"`): `"layernorm"` or `"rmsnorm"`.
        norm_position (`str`, defaults to `"post"`): `"post"` (BERT/paper) or `"pre"` (Llama) normalisation.
        position_embedding_type (`str`, defaults to `"absolute"`): `"absolute"` (learned), `"rope"` or `"none"`.
        max_position_embeddings (`int`, defaults to 512): longest sequence for learned positions.
        rope_theta (`float`, defaults to 10000.0): RoPE base.
        layer_norm_eps (`float`, defaults to 1e-12): epsilon of the normalisation layers.
        hidden_dropout_prob (`float`, defaults to 0.1): dropout on embeddings and residual branches.
        attention_dropout (`float`, defaults to 0.0): dropout on attention probabilities.
        attention_bias (`bool`, defaults to `True`): bias in the q/k/v/o projections.
        mlp_bias (`bool`, defaults to `True`): bias in the MLP projections.
        sliding_window (`int`, *optional*): local attention window (the paper's PDE-Longformer hybrid); `None` = full.
        initializer_range (`float`, defaults to 0.02): std of the normal weight initialisation.
        is_causal (`bool`, defaults to `False`): causal attention and causal PDE stencil. `CTAForCausalLM` sets it.
        pooling (`str`, defaults to `"mean"`): sequence classification pooling, `"mean"` over valid tokens (paper),
            `"cls"` (first token) or `"last"` (last valid token).
        classifier_dropout (`float`, *optional*): dropout before the classification head (default: hidden dropout).
        use_cache (`bool`, defaults to `True`): whether the model returns its cache (`past_key_values`) for decoding.
        tie_word_embeddings (`bool`, defaults to `True`): tie the LM head to the input embedding.
        pde_type (`str`, defaults to `"diffusion"`): `"diffusion"`, `"wave"`, `"reaction_diffusion"` or
            `"advection_diffusion"` (hyphenated spellings are accepted). See `pde_cta.py` for the schemes.
        pde_steps (`int`, defaults to 1): explicit PDE steps per refinement site (0 = plain transformer).
        pde_placement (`str` or `list[str]`, defaults to `"block_output"`): one or several of `"embedding"`, `"value"`
            (attention values), `"attention_output"`, `"mlp_output"`, `"block_output"` and `"attention_matrix"` (the
            paper's Algorithm 1: the softmax matrix evolved along the key axis; eager attention, O(L^2)).
        pde_layers (`list[int]`, *optional*): the blocks that get per-layer placements (default: all).
        pde_alpha (`float`, defaults to 0.1): initial diffusion coefficient (`c**2` for the wave); kept inside the
            stable interval of `pde_cta.COEFFICIENT_BOUNDS` during training.
        pde_beta (`float`, *optional*): initial reaction / advection coefficient (default per type, see
            `pde_cta.PAPER_COEFFICIENTS`); unused by diffusion and wave.
        pde_per_channel (`bool`, defaults to `False`): one coefficient per channel instead of a scalar.
        pde_backend (`str`, defaults to `"auto"`): `"auto"` (Triton on CUDA when importable), `"torch"` or `"triton"`.
        pad_token_id (`int`, defaults to 0), bos_token_id / eos_token_id (`int`, *optional*): special token ids.
    """

    model_type = "cta"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self, vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=None,
        intermediate_size=256, hidden_act="gelu", mlp_type="standard", norm_type="layernorm", norm_position="post",
        position_embedding_type="absolute", max_position_embeddings=512, rope_theta=10000.0, layer_norm_eps=1e-12,
        hidden_dropout_prob=0.1, attention_dropout=0.0, attention_bias=True, mlp_bias=True, sliding_window=None,
        initializer_range=0.02, is_causal=False, pooling="mean", classifier_dropout=None, use_cache=True,
        tie_word_embeddings=True, pde_type="diffusion", pde_steps=1, pde_placement="block_output", pde_layers=None,
        pde_alpha=0.1, pde_beta=None, pde_per_channel=False, pde_backend="auto", pad_token_id=0, bos_token_id=None,
        eos_token_id=None, **kwargs,
    ):
        arguments = locals()
        fields = {name: arguments[name] for name in _CHECKS}
        if num_key_value_heads is None:
            fields["num_key_value_heads"] = num_attention_heads
        for name, check in _CHECKS.items():
            fields[name] = check(fields[name], name)
        heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
        if hidden_size % heads != 0:
            raise ValueError(f"`hidden_size` ({hidden_size}) must be divisible by `num_attention_heads` ({heads}).")
        if heads % kv_heads != 0:
            raise ValueError(f"`num_attention_heads` ({heads}) must be divisible by `num_key_value_heads` "
                             f"({kv_heads}).")
        if position_embedding_type == "rope" and (hidden_size // heads) % 2 != 0:
            raise ValueError(f"`position_embedding_type='rope'` needs an even head dim, got {hidden_size // heads}.")
        for name, value in fields.items():  # the checked arguments; the derived fields follow
            setattr(self, name, value)
        self.head_dim = hidden_size // heads
        placements = normalize_placements(pde_placement)
        self.pde_placement = placements[0] if len(placements) == 1 else placements
        self.pde_layers = check_layers(pde_layers, "pde_layers", num_hidden_layers)
        self.pde_alpha = check_coefficient(pde_alpha, "pde_alpha", self.pde_type, 0)
        pde_beta = PAPER_COEFFICIENTS[self.pde_type][1] if pde_beta is None else pde_beta
        self.pde_beta = None if pde_beta is None else check_coefficient(pde_beta, "pde_beta", self.pde_type, 1)
        for derived in ("layer_types", "number_of_conv_states", "head_dim"):  # recomputed: stale in a saved config
            kwargs.pop(derived, None)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.update_cache_layout()

    @property
    def pde_placements(self) -> list:
        """``pde_placement`` as a list."""
        return normalize_placements(self.pde_placement)

    def update_cache_layout(self):
        """Sets ``layer_types`` / ``number_of_conv_states`` so that ``DynamicCache(config=...)`` holds the PDE state
        (``site_spec.cache_layout`` of this config's sites)."""
        attention = "sliding_attention" if self.sliding_window is not None else "full_attention"
        attention_types = (attention,) * self.num_hidden_layers
        layout = cache_layout(attention_types, site_specs(self))
        self.layer_types, self.number_of_conv_states = (list(layout[0]), layout[1]) if layout else (
            list(attention_types), 1)

    @classmethod
    def paper_encoder(cls, **kwargs):
        """The paper's small classifier (Table 1: embedding 128, 4 heads, FFN 256, 2 layers, learned absolute
        positions, post-LN, GELU, one diffusion step after every block): the class defaults, named at call sites."""
        return cls(**kwargs)

    @classmethod
    def modern_decoder(cls, **kwargs):
        """A Llama-style decoder: RoPE, RMSNorm, pre-norm, SwiGLU, no biases, causal."""
        return cls(**{**dict(hidden_act="silu", mlp_type="gated", norm_type="rmsnorm", norm_position="pre",
                             position_embedding_type="rope", layer_norm_eps=1e-6, hidden_dropout_prob=0.0,
                             attention_bias=False, mlp_bias=False, is_causal=True, pooling="last",
                             tie_word_embeddings=False), **kwargs})


__all__ = ["CTAConfig", "PDE_PLACEMENTS", "LAYER_PLACEMENTS"]
