"""The one-token decode step under ``torch.compile``: the recurrence as torch ops on the state's per-step buffers
(``cta.pde_decode_update``, its torch backend ``pde_decode``), against the PyTorch reference (``pde_decode_step_reference``, the ground truth)
through Inductor between a residual add and a norm, and in a patched model's compiled decode step through a
StaticCache, where each of a site's state buffers is written in place once, at the index it is read (what lets
Inductor fuse the site into the norm kernel after it: no kernel of its own on the GPU, ``bench_generate.py``). On CPU
Inductor's C++ kernels run; with ``CTA_TEST_GPU=1`` the same tests run on CUDA, and the last one counts the
kernels of a compiled step."""

from triton_testing import DEVICE, gpu  # (first: sets up Triton's interpreter before triton is imported)

import pytest  # noqa: E402
import torch  # noqa: E402

from cta.pde_cache import CACHE_ARGUMENT  # noqa: E402
from cta.pde_cta import PDE_TYPES  # noqa: E402
from cta.pde_cta import pde_decode_update  # noqa: E402
from cta.pde_reference import pde_decode_step_reference  # noqa: E402
from cta.pde_spec import project_coefficients, coefficient_bounds  # noqa: E402


def _case(pde, batch, steps, channels, seed):
    """Per-channel coefficients inside the scheme's bounds, and ``steps`` state buffers ``[batch, 1, channels, 1]``
    (a cache's conv states, one per step)."""
    gen = torch.Generator().manual_seed(seed)
    alpha = torch.rand(channels, generator=gen) * 1.2 - 0.2
    beta = torch.rand(channels, generator=gen) * 1.4 - 0.6 if pde in ("reaction_diffusion", "advection_diffusion") \
        else None
    alpha, beta = project_coefficients(alpha, beta, coefficient_bounds(pde, True))
    buffers = [torch.randn(batch, 1, channels, 1, generator=gen).to(DEVICE) for _ in range(steps)]
    return alpha.to(DEVICE), None if beta is None else beta.to(DEVICE), buffers


@pytest.mark.parametrize("pde", PDE_TYPES)
def test_compiled_step_between_an_add_and_a_norm_equals_the_reference(pde):
    """Inductor (``fullgraph=True``) compiles the step where a model calls it: on the sum of a residual add, the state
    the ``[batch, 1, channels]`` views of its per-step buffers (graph inputs, written in place), an RMS norm after
    it. Over several calls (each reads what the previous one wrote) the outputs and the buffers equal the
    reference's."""
    batch, steps, channels = 2, 3, 24
    alpha, beta, buffers = _case(pde, batch, steps, channels, seed=13)
    weight = torch.randn(channels, generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def step(residual, update, buffers):
        refined = pde_decode_update(residual + update, [b[..., -1] for b in buffers], pde_type=pde, steps=steps,
                                    alpha=alpha, beta=beta)
        return refined, refined * torch.rsqrt(refined.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    torch.compiler.reset()
    compiled = torch.compile(step, fullgraph=True)
    expected_state = torch.cat(buffers, 1)[..., -1].clone()
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        residual, update = (torch.randn(batch, 1, channels, generator=gen).to(DEVICE) for _ in range(2))
        token = (residual + update)[:, 0]
        expected = pde_decode_step_reference(token, expected_state, pde_type=pde, steps=steps, alpha=alpha, beta=beta)
        refined, normed = compiled(residual, update, buffers)
        torch.testing.assert_close(refined[:, 0], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(normed[:, 0], expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-6)
                                   * weight, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.cat(buffers, 1)[..., -1], expected_state, rtol=1e-5, atol=1e-5)


def _patched_llama(pde, per_channel, backend):
    from transformers import LlamaConfig, LlamaForCausalLM

    from cta.patching_cta import patch_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    unpatched = LlamaForCausalLM(config).eval().to(DEVICE)
    unpatched.load_state_dict(model.state_dict())
    patch_model(model, pde_type=pde, pde_steps=3, placement="block_output", init="paper", backend=backend,
                per_channel=per_channel)
    return model.to(DEVICE), unpatched


def _decode(model, step, ids, prefill=6):
    """The logits of the decode steps after a ``prefill``-token prefill (eager), through a StaticCache, and the
    cache."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=16)
    model(ids[:, :prefill], use_cache=True, **{CACHE_ARGUMENT: cache})
    logits = torch.cat([step(input_ids=ids[:, t:t + 1], use_cache=True, **{CACHE_ARGUMENT: cache},
                             attention_mask=torch.ones(1, t + 1, dtype=torch.long, device=DEVICE)).logits
                        for t in range(prefill, ids.shape[1])], 1)
    return logits, cache


@pytest.mark.parametrize("pde,per_channel", [("diffusion", False), ("wave", True), ("reaction_diffusion", True),
                                             ("advection_diffusion", False)])
def test_patched_compiled_decode_step_writes_each_state_buffer_once(pde, per_channel):
    """A patched decoder's decode step traced with ``torch.compile(fullgraph=True)`` through transformers'
    StaticCache: its logits and cached states equal eager decoding's token by token, and beyond the unpatched
    graph's own writes the traced graph writes each state buffer of each site once, in place (``copy_``), with no
    custom op: plain torch ops Inductor can fuse into the norm that follows."""
    from cta.patching_cta import pde_modules

    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def traced_targets(model):
        """(the traced decode step's logits, cache, and the targets of the calls of its last graph: the attention
        mask's length changes every step, so a second trace makes it dynamic)."""
        graphs = []

        def backend(graph_module, example_inputs):  # records the traced graph and runs it as traced
            graphs.append(graph_module)
            return graph_module.forward

        torch.compiler.reset()
        logits, cache = _decode(model, torch.compile(model.forward, fullgraph=True, backend=backend), ids)
        assert 1 <= len(graphs) <= 2
        return logits, cache, [node.target for node in graphs[-1].graph.nodes
                               if node.op in ("call_function", "call_method")]

    def writes(targets):
        return [str(t) for t in targets if str(t).rstrip("_").endswith("copy") or str(t).endswith("_")]

    model, unpatched = _patched_llama(pde, per_channel, "auto")
    with torch.no_grad():
        _, _, unpatched_targets = traced_targets(unpatched)
        eager, eager_cache = _decode(model, model.forward, ids)
        compiled, cache, targets = traced_targets(model)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for layer, eager_layer in zip(cache.layers, eager_cache.layers):
        for index, state in layer.conv_states.items():
            torch.testing.assert_close(state, eager_layer.conv_states[index], rtol=1e-5, atol=1e-6)
    extra = sorted(writes(targets))
    for write in writes(unpatched_targets):
        extra.remove(write)
    assert extra == ["copy_"] * (3 * len(pde_modules(model))), extra  # 3 steps: one buffer each, written once
    assert not [t for t in targets if "cta" in str(t)]


@gpu
def test_compiled_decode_step_adds_no_kernel():
    """On the GPU, the patched model's compiled decode step (Inductor, default mode) launches as many kernels as the
    unpatched one: each site, state writes included, is fused into the norm kernel after it."""
    from transformers import StaticCache

    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def kernels(model):
        torch.compiler.reset()
        step = torch.compile(model.forward, fullgraph=True)
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(ids[:, :6], use_cache=True, **{CACHE_ARGUMENT: cache})
        position = torch.tensor([6], device=DEVICE)
        for _ in range(3):  # compiled and warm
            step(input_ids=ids[:, 6:7], use_cache=True, cache_position=position, **{CACHE_ARGUMENT: cache})
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            step(input_ids=ids[:, 6:7], use_cache=True, cache_position=position, **{CACHE_ARGUMENT: cache})
            torch.cuda.synchronize()
        return len([e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA])

    model, unpatched = _patched_llama("diffusion", False, "auto")
    with torch.no_grad():
        assert kernels(model) == kernels(unpatched)
