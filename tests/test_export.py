"""``torch.export`` of decoders with causal PDE sites. A site keeps its state in the cache's conv states, which an
exported program's cache does not carry: transformers' ExecuTorch recipe (``TorchExportableModuleForDecoderOnlyLM``:
a StaticCache whose key/value tensors it registers as buffers) and any export of a forward given a cache refuse while
they trace, naming why, instead of returning a program that decodes wrong logits. The unpatched Llama through the
same harness decodes exactly (the harness is right), and the export of a forward without a cache stays exact."""

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

import cta
from cta.pde_cache import CACHE_ARGUMENT, is_exporting
from pde_testing import randomize_pde

executorch = pytest.importorskip("transformers.integrations.executorch")
if not hasattr(executorch, "TorchExportableModuleForDecoderOnlyLM"):
    pytest.skip(f"transformers {transformers.__version__} has no TorchExportableModuleForDecoderOnlyLM",
                allow_module_level=True)

VOCAB, LENGTH = 64, 8
IDS = torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(1))


def llama(patched):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    if patched:
        cta.patch_model(model, pde_type="diffusion", pde_steps=2, placement="block_output", init="paper")
    return model


def native():
    torch.manual_seed(0)
    config = cta.CTAConfig.modern_decoder(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, pde_type="wave", pde_steps=2,
                                          pde_placement=["value", "block_output"])
    return randomize_pde(cta.CTAForCausalLM(config).eval(), seed=3)


PDE_MODELS = {"patched": (lambda: llama(True), "LlamaForCausalLM"), "native": (native, "CTAModel")}


def full_logits(model):
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def assert_refused(error, model_name):
    """The export's error names the model, the reason and what works (under Dynamo, strict export, the text of an
    error may also come wrapped in Dynamo's own)."""
    text = str(error)
    for part in (f"{model_name}: cannot export a forward with a cache", "conv states",
                 "does not carry as mutable state", "`use_cache=False`", "`generate()`"):
        assert part in text, text


def recipe_export(model, strict):
    """transformers' ExecuTorch recipe: a StaticCache of 16 positions, exported on one token at position 0."""
    model.generation_config.cache_implementation = "static"
    module = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16)
    with torch.no_grad():
        return module.export(input_ids=IDS[:, :1], cache_position=torch.tensor([0]), strict=strict)


def test_pde_models_are_not_identities():
    """(Otherwise the refusals below would guard nothing.)"""
    assert not torch.allclose(full_logits(llama(True)), full_logits(llama(False)), atol=1e-3)
    model = native()
    plain = cta.CTAForCausalLM(cta.CTAConfig.from_dict({**model.config.to_dict(), "pde_steps": 0})).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    assert not torch.allclose(full_logits(model), full_logits(plain), atol=1e-3)


@pytest.mark.parametrize("strict", [True, False])
def test_executorch_recipe_control_unpatched_llama_decodes_exactly(strict):
    """The harness: the unpatched Llama's exported program decodes token by token like ``use_cache=False``."""
    model = llama(False)
    program = recipe_export(model, strict).module()
    with torch.no_grad():
        decoded = torch.cat([program(input_ids=IDS[:, t:t + 1], cache_position=torch.tensor([t]))
                             for t in range(LENGTH)], 1)
    torch.testing.assert_close(decoded, full_logits(model), rtol=0, atol=1e-5)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", PDE_MODELS)
def test_executorch_recipe_refuses_pde_models(kind, strict):
    """The recipe's export raises, naming why; the model then still decodes exactly in eager mode with a cache."""
    make, name = PDE_MODELS[kind]
    model = make()
    with pytest.raises(Exception) as error:
        recipe_export(model, strict)
    assert_refused(error.value, name)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        decoded = torch.cat([model(IDS[:, t:t + 1], use_cache=True, **{CACHE_ARGUMENT: cache}).logits
                             for t in range(LENGTH)], 1)
    torch.testing.assert_close(decoded, full_logits(model), rtol=0, atol=1e-5)


class CacheStep(torch.nn.Module):
    """A forward given a cache held outside the model (what a hand-written export does): one decode step."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, input_ids):
        return self.model(input_ids, use_cache=True, **{CACHE_ARGUMENT: self.cache}).logits


@pytest.mark.parametrize("cache_type", ["static", "dynamic"])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", PDE_MODELS)
def test_torch_export_with_a_cache_passed_in_refuses(kind, strict, cache_type):
    make, name = PDE_MODELS[kind]
    model = make()
    cache = StaticCache(config=model.config, max_cache_len=16) if cache_type == "static" \
        else transformers.DynamicCache(config=model.config)
    with pytest.raises(Exception) as error, torch.no_grad():
        torch.export.export(CacheStep(model, cache), (IDS[:, :1],), strict=strict)
    assert_refused(error.value, name)


@pytest.mark.parametrize("kind", PDE_MODELS)
def test_torch_export_with_the_cache_as_an_input_raises(kind):
    """A cache given to ``torch.export`` as an input is not a pytree it can flatten: torch raises before tracing."""
    model = PDE_MODELS[kind][0]()
    with pytest.raises(Exception), torch.no_grad():
        torch.export.export(model, (IDS[:, :1],), {CACHE_ARGUMENT: StaticCache(config=model.config, max_cache_len=16),
                                                   "use_cache": True})


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", PDE_MODELS)
def test_torch_export_without_a_cache_equals_eager(kind, strict):
    """Exported on one input, the program's logits on another of the same shape equal eager ones."""
    model = PDE_MODELS[kind][0]()
    with torch.no_grad():
        program = torch.export.export(model, (IDS,), {"use_cache": False}, strict=strict).module()
        other = torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(7))
        for ids in (IDS, other):
            torch.testing.assert_close(program(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       rtol=0, atol=1e-5)


def test_is_exporting_is_false_under_torch_compile():
    """Dynamo runs :func:`is_exporting` instead of tracing it: False in a compiled function (no refusal there)."""
    torch.compiler.reset()
    compiled = torch.compile(lambda x: x + 1 if is_exporting() else x, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.zeros(2)), torch.zeros(2))
    assert not is_exporting()
