"""Tiny random models of transformers' architectures for the zoo test (hidden 64, 2 layers, fp32, vocab 128).

``ZOO`` maps each covered model type to what its config needs beyond :data:`TINY` (``None``: nothing): its own names
for the sizes, a smaller expert count, a rotary dimension that fits a 16-wide head. Decoders are built with their
causal-LM head, encoders with their masked-LM head. ``ZOO`` / ``DECODERS`` / ``ENCODERS`` depend on the installed
transformers (the types it ships and does not refuse); ``ALL_ZOO`` / ``ALL_DECODERS`` / ``ALL_ENCODERS`` do not.
"""

import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from cta.patching_structure import release_refusal

VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=128, head_dim=16, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_local_experts=4,
           n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, shared_expert_intermediate_size=32, first_k_dense_replace=1)
NO_HEAD_DIM = dict(head_dim=None)
MLA = dict(head_dim=None, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)

DECODERS = {
    "llama": None, "mistral": dict(sliding_window=64), "qwen2": None, "qwen3": None, "gpt2": NO_HEAD_DIM,
    "gemma": None, "gemma2": None, "gemma3_text": None, "phi": None, "phi3": None, "mixtral": MOE,
    "qwen2_moe": MOE, "qwen3_moe": MOE, "olmo": None, "olmo2": None, "olmo3": None, "olmoe": MOE,
    "gpt_oss": MOE, "smollm3": None, "granite": None, "granitemoe": MOE, "granitemoeshared": MOE,
    "cohere": None, "cohere2": None, "starcoder2": None, "ministral": None, "ministral3": None, "glm": None,
    "glm4": None, "ernie4_5": None, "exaone4": None, "helium": None, "nemotron": None, "phimoe": MOE,
    "arcee": None, "apertus": None, "seed_oss": None, "hunyuan_v1_dense": None, "hunyuan_v1_moe": MOE,
    "stablelm": None, "persimmon": None, "gpt_neox": NO_HEAD_DIM, "gptj": dict(rotary_dim=8, **NO_HEAD_DIM),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=64, **NO_HEAD_DIM),
    "gpt_bigcode": NO_HEAD_DIM, "codegen": dict(rotary_dim=8, **NO_HEAD_DIM), "bloom": NO_HEAD_DIM,
    "mpt": NO_HEAD_DIM, "falcon": NO_HEAD_DIM, "opt": dict(ffn_dim=128, word_embed_proj_dim=64, **NO_HEAD_DIM),
    "biogpt": NO_HEAD_DIM, "xglm": dict(ffn_dim=128, **NO_HEAD_DIM), "bitnet": None, "diffllama": None,
    "exaone": None, "internlm3": None, "jetmoe": MOE, "vaultgemma": None, "cwm": None, "nanochat": None,
    "hyperclovax": None, "jais2": None, "granite_swa": None, "deepseek_v2": dict(MLA, **MOE), "deepseek_v3": dict(MLA, **MOE),
    "ernie4_5_moe": MOE, "glm4_moe": MOE, "dots1": MOE, "minicpm3": MLA, "doge": None,
}
# Checked as the types above, with transformers' defaults beyond TINY (MoE ones with fewer experts).
DECODERS.update({t: None for t in (
    "apertus1p5_text", "beam", "flint", "gpt-sw3", "gpt_neox_japanese", "granitemoe_swa", "iquestcoder", "mellum",
    "modernbert-decoder", "trocr", "flex_olmo", "laguna", "solar_open", "minimax_m3_vl_text")})
DECODERS.update({t: MOE for t in (
    "afmoe", "aria_text", "cohere2_moe", "exaone_moe", "hy_v3", "kolibri1", "mimo_v2_flash", "minimax_m2",
    "sarvam_moe", "gemma4_text", "gemma4_unified_text", "minicpm5_moe", "param2moe")})
# transformers 5.25: Ergo's dense first block and shared expert at tiny sizes (its defaults: 32768 and 8192), one
# global-attention layer of the two (its default: every 4th)
DECODERS["ergo"] = dict(MOE, first_dense_intermediate_size=128, shared_intermediate_size=32,
                        global_attention_every_n_layers=2, sliding_window=64)
MORE_ENCODERS = {t: NO_HEAD_DIM for t in (
    "camembert", "convbert", "data2vec-text", "deberta", "ernie", "esm", "eurobert", "fnet", "gte",
    "jina_embeddings_v3", "layoutlm", "luke", "megatron-bert", "mra", "neomme", "nomic_bert", "nystromformer",
    "rembert", "roberta-prelayernorm", "roc_bert", "roformer", "tapas", "ultrabert", "xlm-roberta-xl", "yoso")}
ENCODERS = {
    "bert": NO_HEAD_DIM, "roberta": NO_HEAD_DIM, "distilbert": NO_HEAD_DIM, "deberta-v2": NO_HEAD_DIM,
    "electra": NO_HEAD_DIM, "modernbert": NO_HEAD_DIM, "xlm-roberta": NO_HEAD_DIM,
}
ISSUE_ENCODERS = dict(ENCODERS)  # the 7 encoders issue 41 names
ENCODERS.update(MORE_ENCODERS)

# Version-dependent lists. The tables above (ALL_DECODERS, ALL_ENCODERS, ALL_ZOO) are every type the zoo checks on the
# newest supported transformers. DECODERS, ENCODERS and ZOO keep the types the installed release ships (the lowest
# supported one, 5.14, lacks e.g. apertus1p5_text, exaone, granite_swa, gte, internlm3) and whose model code there
# patch_model does not refuse (cta.patching_structure.REFUSED_BEFORE: e.g. doge before 5.18); the zoo asserts that
# those are refused (tests/test_zoo.py). ISSUE_ENCODERS is not filtered: every supported release ships the 7 encoders
# issue 41 names, and the zoo asserts that they stay in ENCODERS.
ALL_DECODERS, ALL_ENCODERS = dict(DECODERS), dict(ENCODERS)
ALL_ZOO = {**ALL_DECODERS, **ALL_ENCODERS}
SHIPPED = set(CONFIG_MAPPING_NAMES)  # the installed release's model types
RELEASE_REFUSED = {t: release_refusal(t) for t in ALL_ZOO if t in SHIPPED and release_refusal(t) is not None}
DECODERS = {t: extra for t, extra in ALL_DECODERS.items() if t in SHIPPED and t not in RELEASE_REFUSED}
ENCODERS = {t: extra for t, extra in ALL_ENCODERS.items() if t in SHIPPED and t not in RELEASE_REFUSED}
ZOO = {**DECODERS, **ENCODERS}


def tiny_config(model_type):
    extra = ALL_ZOO[model_type] or {}
    kwargs = {**TINY, **extra}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    return config


def tiny_model(model_type, head=None, seed=0):
    """A tiny random model of ``model_type``: ``head`` an Auto class name (default: causal LM for decoders, masked LM
    for encoders), eval mode, fp32."""
    config = tiny_config(model_type)
    if head is None:
        head = "AutoModelForCausalLM" if model_type in ALL_DECODERS else "AutoModelForMaskedLM"
    torch.manual_seed(seed)
    model = getattr(transformers, head).from_config(config, dtype=torch.float32)
    return model.eval()


def head_classes(model_type):
    """transformers' head class names of ``model_type`` ({Auto class: name})."""
    tables = {"AutoModel": "MODEL_MAPPING_NAMES", "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
              "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
              "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
              "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
              "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES"}
    if model_type in DECODERS:
        tables.pop("AutoModelForMaskedLM")
    else:
        tables.pop("AutoModelForCausalLM")
    return {auto: getattr(modeling_auto, table)[model_type] for auto, table in tables.items()
            if model_type in getattr(modeling_auto, table)}
