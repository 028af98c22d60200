"""Compiled static-cache generation on CUDA is exact whatever ran before (GPU only): after a compiled run of the
unpatched base, on a deepcopy patched afterwards, and on a copy of a patched model that compiled, for every PDE type,
with and without left padding in one batch, 48 new tokens, against `use_cache=False`; offloaded caches likewise.

`CTA_GPU_RESULTS=<file.json>` writes what each case measured, and its markdown table beside it (the committed
`results/generation/gpu_generation_*.json` / `.md`, shown in docs/generation.md)."""

import copy
import json
import os

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import cta
from cta import PDE_TYPES
from cta.generation_cta import compiled_calls
from cta.patching_cta import patch_model
from pde_testing import randomize_pde as randomize

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PLACEMENTS = {"block_output": "block_output",
              "all": ["embedding", "value", "attention_output", "mlp_output", "block_output"]}
RESULTS = []
NEW_TOKENS = 48


def base_model(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # no pad_token_id, as Llama's own config
    return LlamaForCausalLM(config).cuda().eval()


def prompts(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # row 1 left-padded, row 0 not
    return ids.cuda(), mask.cuda()


def run(model, ids, mask, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


def check(case, model, ids, mask, **kwargs):
    tokens, logits = run(model, ids, mask, **kwargs)
    expected, expected_logits = run(model, ids, mask, use_cache=False)
    difference = (logits - expected_logits).abs().max().item()
    RESULTS.append(dict(case=case, tokens_equal=bool(torch.equal(tokens, expected)), max_logit_difference=difference,
                        compiled=bool(compiled_calls(model))))
    assert torch.equal(tokens, expected), case
    assert difference < 1e-3, (case, difference)


@requires_cuda
@pytest.mark.parametrize("pde_type", PDE_TYPES)
def test_compiled_static_generation_of_a_copy_patched_after_the_base_compiled(pde_type):
    torch.compiler.reset()
    for seed in (0, 1):
        for placement in PLACEMENTS:
            ids, mask = prompts(seed)
            base = base_model(seed)
            run(base, ids, mask, cache_implementation="static")  # compiles the base's forward, kept on the instance
            assert compiled_calls(base)
            patched = copy.deepcopy(base)
            patch_model(patched, pde_type=pde_type, pde_steps=4, placement=PLACEMENTS[placement], init="paper")
            randomize(patched, seed)
            case = f"{pde_type}/{placement}/seed{seed}"
            check(f"deepcopy of a compiled base, then patched: {case}", patched, ids, mask,
                  cache_implementation="static")
            assert compiled_calls(patched), "the patched copy did not compile its own forward"
            if seed == 0:  # a copy of the compiled patched model, other coefficients: compiles its own forward too
                other = randomize(copy.deepcopy(patched), seed + 100)
                check(f"deepcopy of a compiled patched model, new coefficients: {case}", other, ids, mask,
                      cache_implementation="static")


@requires_cuda
@pytest.mark.parametrize("implementation", ["offloaded"])  # ("offloaded_static" is refused: test_generation_matrix)
def test_offloaded_caches_are_exact(implementation):
    ids, mask = prompts(3)
    model = randomize(patch_model(base_model(3), pde_type="wave", pde_steps=4, placement=PLACEMENTS["all"],
                                  init="paper"), 3)
    check(f"patched, cache_implementation={implementation}", model, ids, mask, cache_implementation=implementation)
    config = cta.CTAConfig.modern_decoder(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, pde_type="reaction_diffusion",
                                          pde_steps=4, pde_placement=PLACEMENTS["all"])
    native = randomize(cta.CTAForCausalLM(config).cuda().eval(), 4)
    check(f"native, cache_implementation={implementation}", native, ids, mask, cache_implementation=implementation)


def summary_markdown(result: dict) -> str:
    """The markdown table of a result file (what docs/generation.md shows)."""
    meta, cases = result["meta"], result["cases"]
    lines = [f"Compiled static-cache `generate()` on CUDA against `use_cache=False`: {meta['gpu']}, "
             f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['dtype']}, {meta['new_tokens']} new "
             f"tokens, a left-padded and an unpadded row (`{meta['command']}`).", "",
             "| case | compiled | tokens equal | max logit difference |", "|---|---|---|---|"]
    lines += [f"| {c['case']} | {'yes' if c['compiled'] else 'no'} | {'yes' if c['tokens_equal'] else '**no**'} | "
              f"{c['max_logit_difference']:.1e} |" for c in cases]
    return "\n".join(lines) + "\n"


def write_results(path: str, result: dict):
    """``path`` (.json) and the same name with .md."""
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as handle:
        handle.write(summary_markdown(result))


def teardown_module(module):
    path = os.environ.get("CTA_GPU_RESULTS")
    if path and RESULTS:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
                    new_tokens=NEW_TOKENS, dtype="float32", reference="use_cache=False",
                    command="CTA_TEST_GPU=1 CTA_GPU_RESULTS=<file.json> python -m pytest tests/test_gpu_generation.py")
        write_results(path, dict(meta=meta, cases=RESULTS))
