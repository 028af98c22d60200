"""Every cache and decoding strategy of generate() equals recomputation (`use_cache=False`), for patched and native
decoders, with and without left padding; caches that cannot hold a PDE state and continuous batching are refused up
front; a compiled forward copied from another model is dropped."""

import copy

import pytest
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import cta
from cta import PDE_TYPES
from cta.generation_cta import drop_compiled_calls
from cta.pde_cache import CACHE_ARGUMENT
from cta.patching_cta import patch_model, unpatch_model
from pde_testing import randomize_pde

VOCAB = 64
ALL_PATCH_PLACEMENTS = ["embedding", "value", "attention_output", "mlp_output", "block_output"]


def decoder(kind, pde_type="diffusion", placement="block_output", steps=3, seed=0):
    """A tiny decoder with causal PDE sites; the configs have no `pad_token_id` (Llama's default, and many real
    checkpoints'), so padded positions have nonzero embeddings."""
    torch.manual_seed(seed)
    if kind == "native":
        config = cta.CTAConfig.modern_decoder(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, pde_type=pde_type, pde_steps=steps, pde_placement=placement)
        model = cta.CTAForCausalLM(config)
    else:
        if kind == "llama":
            model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        else:
            model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))
        patch_model(model, pde_type=pde_type, pde_steps=steps, placement=placement, init="paper")
    return randomize_pde(model.eval(), seed)


def prompts(padded, batch=2, length=9, seed=3):
    """A batch whose rows repeat a 4-token pattern (so prompt lookup finds drafts), row 1 left-padded by 4."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, 4), generator=g).repeat(1, 3)[:, :length]
    mask = torch.ones_like(ids)
    if padded:
        ids[-1, :4], mask[-1, :4] = 0, 0
    return ids, mask


def generate(model, ids, mask, seed=None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=8, return_dict_in_generate=True,
                         output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


STRATEGIES = {
    "dynamic": dict(do_sample=False),
    "static": dict(do_sample=False, cache_implementation="static", disable_compile=True),
    "beam_search": dict(do_sample=False, num_beams=4),
    "sampling": dict(do_sample=True, top_k=0, seed=7),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
}


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("kind", ["llama", "native"])
def test_every_decoding_strategy_equals_recomputation(kind, strategy, padded, monkeypatch):
    model = decoder(kind, placement=["embedding", "value", "block_output"] if kind == "native" else
                    ALL_PATCH_PLACEMENTS)
    options = dict(STRATEGIES[strategy])
    seed = options.pop("seed", None)
    # transformers' assisted decoding takes one sequence at a time: a left-padded row of its own
    ids, mask = prompts(padded, batch=1 if strategy == "prompt_lookup" else 2)
    crops = []
    if strategy == "prompt_lookup":
        crop = transformers.cache_utils.Cache.crop
        monkeypatch.setattr(transformers.cache_utils.Cache, "crop",
                            lambda self, n: (crops.append(n), crop(self, n))[1])
    tokens, step_logits = generate(model, ids, mask, seed=seed, **options)
    reference_options = {k: v for k, v in options.items() if k not in ("cache_implementation", "disable_compile",
                                                                        "prompt_lookup_num_tokens")}
    expected, expected_logits = generate(model, ids, mask, seed=seed, use_cache=False, **reference_options)
    assert torch.equal(tokens, expected)
    if strategy != "beam_search":  # (beam search reorders its rows: the tokens say it)
        torch.testing.assert_close(step_logits, expected_logits, rtol=1e-4, atol=1e-4)
    if strategy == "prompt_lookup":
        assert any(n != 0 for n in crops), "no draft token was rejected: the rollback was not exercised"


@pytest.mark.parametrize("pde_type", PDE_TYPES)
@pytest.mark.parametrize("kind", ["llama", "gpt2", "native"])
def test_static_cache_with_left_padding_is_exact_for_every_pde_type(kind, pde_type):
    """The regression of the static cache's 4D masks: the padded row's PDE state is what the uncached operator
    leaves (a wall at padding)."""
    placement = ["embedding", "value", "attention_output", "mlp_output", "block_output"]
    model = decoder(kind, pde_type, placement, steps=4, seed=1)
    ids, mask = prompts(True, seed=5)
    tokens, logits = generate(model, ids, mask, cache_implementation="static", disable_compile=True)
    expected, expected_logits = generate(model, ids, mask, use_cache=False)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


def test_prompt_lookup_rolls_back_every_pde_type_and_placement():
    """Rejected drafts: every site's state is the one of the last accepted token (native, all placements)."""
    for pde_type in PDE_TYPES:
        model = decoder("native", pde_type, ["embedding", "value", "attention_output", "mlp_output", "block_output"])
        ids, mask = prompts(True, batch=1, seed=11)
        tokens, logits = generate(model, ids, mask, prompt_lookup_num_tokens=4, max_length=None)
        expected, expected_logits = generate(model, ids, mask, use_cache=False)
        assert torch.equal(tokens, expected), pde_type
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


def test_assisted_decoding_with_an_assistant_model_is_exact():
    """A draft model (another patched decoder) proposes tokens the patched target verifies and partly rejects (on a
    transformers release that cannot roll an assistant's conv states back, refused before the first draft)."""
    from cta.generation_cta import ASSISTANT_ROLLBACK_SINCE
    from packaging import version

    target, assistant = decoder("llama", seed=0), decoder("llama", "wave", seed=1)
    ids, mask = prompts(False, batch=1)
    if version.parse(transformers.__version__) < ASSISTANT_ROLLBACK_SINCE:
        with pytest.raises(ValueError, match="as the assistant"):
            target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=assistant)
        return
    tokens, logits = generate(target, ids, mask, assistant_model=assistant)
    expected, expected_logits = generate(target, ids, mask, use_cache=False)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "native"])
def test_caches_that_cannot_hold_the_pde_state_are_refused_up_front(kind):
    model = decoder(kind)
    ids, mask = prompts(False)
    plain = transformers.DynamicCache()  # built without the config: plain key/value layers, no conv states
    if kind == "llama" or CACHE_ARGUMENT == "cache":  # (before 5.24 generate() takes a native model's cache by the
        # name of its forward's parameter, `cache`, which those releases' generate() does not pass on)
        with pytest.raises(ValueError, match="cannot hold the PDE state"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, **{CACHE_ARGUMENT: plain})
    for implementation in ("quantized", "offloaded_static"):
        with pytest.raises(ValueError, match=f"cache_implementation='{implementation}' is refused"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation=implementation)
    with pytest.raises(ValueError, match="continuous batching"):
        model.init_continuous_batching()


def test_patch_and_unpatch_drop_a_compiled_forward_bound_to_another_model():
    """What transformers' get_compiled_call leaves on a model (torch.compile of its bound __call__) travels through
    copy.deepcopy still bound to the original: patching or unpatching the copy, or generating with it, drops it."""
    base = decoder("llama")
    unpatch_model(base)
    base.compiled_call_of_test = torch.compile(base.__call__)  # the form get_compiled_call keeps
    copy_ = copy.deepcopy(base)
    assert copy_.compiled_call_of_test.__wrapped__.__self__ is base
    patch_model(copy_, pde_steps=2)
    assert not hasattr(copy_, "compiled_call_of_test")
    copy_.other_call = torch.compile(base.__call__)
    copy_.own_call = torch.compile(copy_.__call__)
    assert drop_compiled_calls(copy_, foreign_only=True) == ["other_call"]
    assert hasattr(copy_, "own_call")
    unpatch_model(copy_)
    assert not hasattr(copy_, "own_call")
