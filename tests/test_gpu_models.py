"""CTA models on CUDA: the Triton backend matches the PyTorch reference inside whole models (GPU only)."""

import copy

import pytest
import torch

import cta
from cta import PDE_TYPES, CTAConfig, CTAForCausalLM
from cta.pde_cache import CACHE_ARGUMENT

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not cta.triton_available(), reason="needs CUDA and triton"
)


def _pair(pde_type, placement):
    torch.manual_seed(0)
    config = CTAConfig.modern_decoder(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, pde_type=pde_type, pde_steps=4,
                                      pde_placement=placement, pde_per_channel=True, pde_backend="torch")
    reference = CTAForCausalLM(config).cuda().eval()
    triton_model = CTAForCausalLM(CTAConfig.from_dict({**config.to_dict(), "pde_backend": "triton"})).cuda().eval()
    triton_model.load_state_dict(reference.state_dict())
    return reference, triton_model


@requires_cuda
@pytest.mark.parametrize("pde_type", PDE_TYPES)
@pytest.mark.parametrize("placement", ["value", ["embedding", "block_output"], "mlp_output"])
def test_triton_backend_matches_reference_in_a_model(pde_type, placement):
    reference, triton_model = _pair(pde_type, placement)
    ids = torch.randint(1, 97, (3, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    out_ref = reference(ids, attention_mask=mask, labels=ids)
    out_tri = triton_model(ids, attention_mask=mask, labels=ids)
    valid = mask.bool()
    torch.testing.assert_close(out_tri.logits[valid], out_ref.logits[valid], rtol=1e-4, atol=1e-4)
    out_ref.loss.backward()
    out_tri.loss.backward()
    for (name, p_ref), (_, p_tri) in zip(reference.named_parameters(), triton_model.named_parameters()):
        torch.testing.assert_close(p_tri.grad, p_ref.grad, rtol=1e-3, atol=1e-5, msg=name)


@requires_cuda
@pytest.mark.parametrize("pde_type", PDE_TYPES)
def test_triton_cached_generation_is_exact(pde_type):
    _, model = _pair(pde_type, ["value", "block_output"])
    ids = torch.randint(1, 97, (2, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


@requires_cuda
def test_bf16_model_runs_on_triton():
    _, model = _pair("diffusion", "block_output")
    model = model.to(torch.bfloat16)
    out = model(torch.randint(1, 97, (2, 64), device="cuda"))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()


@requires_cuda
def test_patched_decode_is_exact_and_keeps_hooks():
    """A patched Llama on Triton, unpadded prompts: every cached decode step's logits equal the full forward's at that
    position (without a mask, and with the all-ones mask ``generate()`` passes: its last column is the token mask);
    ``output_hidden_states`` records what each next layer receives; a forward hook on a PDE module runs at every
    step. Left-padded generation through the same path is exact as well."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).cuda().eval()
    cta.patch_model(model, pde_steps=4, init="paper", backend="triton")
    ids = torch.randint(1, 97, (2, 14), device="cuda")
    with torch.no_grad():
        full = model(ids).logits
        unpatched = cta.unpatch_model(model)(ids).logits
        cta.patch_model(model, pde_steps=4, init="paper", backend="triton")
    assert (full - unpatched).abs().max() > 1e-3  # the patch is not the identity here

    def decode(first, last):
        cache = model(ids[:, :first], use_cache=True).past_key_values
        for t in range(first, last):
            mask = torch.ones(2, t + 1, dtype=torch.long, device="cuda") if t % 2 else None
            step = model(ids[:, t:t + 1], **{CACHE_ARGUMENT: cache}, use_cache=True, attention_mask=mask).logits[:, -1]
            torch.testing.assert_close(step, full[:, t], rtol=1e-4, atol=1e-4)

    with torch.no_grad():
        decode(6, 14)
        # output_hidden_states while decoding: the recorded states are the refined ones, what each next layer
        # receives.
        received = []
        hooks = [layer.register_forward_pre_hook(lambda module, args: received.append(args[0]))
                 for layer in model.model.layers]
        cache = model(ids[:, :6], use_cache=True).past_key_values
        for t in range(6, 9):
            del received[:]
            out = model(ids[:, t:t + 1], **{CACHE_ARGUMENT: cache}, use_cache=True, output_hidden_states=True)
            torch.testing.assert_close(out.logits[:, -1], full[:, t], rtol=1e-4, atol=1e-4)
            for k, layer_input in enumerate(received):
                torch.testing.assert_close(out.hidden_states[k], layer_input, rtol=0, atol=0)
        for hook in hooks:
            hook.remove()
        hooked = []
        _, pde = cta.patching_cta.pde_modules(model)[0]
        handle = pde.register_forward_hook(lambda module, args, output: hooked.append(1))
        decode(8, 12)
        handle.remove()
    assert len(hooked) == 1 + 4  # the prefill and every decode step
    prompt = ids[:, :6].clone()
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0  # left padding: the step masks are not all ones
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, use_cache=True, **kwargs), model.generate(prompt, use_cache=False, **kwargs))


def _refine(x):
    return cta.pde_refine(x, pde_type="diffusion", steps=4, alpha=0.1, backend="triton")


@requires_cuda
def test_functional_op_with_a_float_coefficient_in_cuda_graphs_and_fullgraph_compile():
    """`pde_refine` with a Python float `alpha` is captured in a CUDA graph and compiles with fullgraph=True."""
    static_x = torch.randn(2, 256, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (kernel compilation) outside the capture
        _refine(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _refine(static_x)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    expected = cta.pde_refine_reference(static_x, pde_type="diffusion", steps=4, alpha=0.1)
    torch.testing.assert_close(static_out, expected, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(_refine, fullgraph=True)
    torch.testing.assert_close(compiled(static_x), expected, atol=1e-5, rtol=1e-5)


@requires_cuda
def test_no_host_device_synchronisation_in_eager_calls():
    """The functional op and the module (forward and backward) never synchronise the host with the GPU."""
    x = torch.randn(2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    module = cta.PDERefinement(64, steps=4, causal=True, backend="triton").cuda()
    alpha = torch.tensor(0.1, device="cuda")
    for _ in range(2):  # the first calls compile the kernels
        _refine(x.detach())
        cta.pde_refine(x.detach(), pde_type="wave", steps=4, alpha=alpha, backend="triton")
        module(x).float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _refine(x.detach())
        cta.pde_refine(x.detach(), pde_type="wave", steps=4, alpha=alpha, backend="triton")
        module(x).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@requires_cuda
def test_no_host_device_synchronisation_in_a_patched_decode_step():
    """A decode step of a patched Llama (dynamic cache) runs without synchronising the host with the GPU. (Without
    an attention mask: with one, transformers' own mask builder synchronises, in the unpatched model too.)"""
    from transformers import LlamaConfig, LlamaForCausalLM


    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = cta.patch_model(LlamaForCausalLM(config).cuda().eval(), pde_steps=4, init="paper",
                            placement=["block_output", "mlp_output"], backend="triton")
    ids = torch.randint(0, 64, (2, 8), device="cuda")
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for checked in (False, True):  # the first step compiles the decode kernel; the second is checked
            token = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if checked else 0)
            try:
                out = model(input_ids=token, use_cache=True, **{CACHE_ARGUMENT: getattr(out, CACHE_ARGUMENT)})
            finally:
                torch.cuda.set_sync_debug_mode(0)


@requires_cuda
@pytest.mark.skipif(not hasattr(cta.CTAForCausalLM, "activation_checkpointing_enable"),
                    reason="this transformers has no activation_checkpointing_enable(offload=...) (5.24 has)")
@pytest.mark.parametrize("kind", ["native", "patched"])
def test_offloaded_activation_checkpointing_gives_the_same_gradients(kind):
    """Newer transformers keep a checkpointed layer's saved inputs in pinned host memory (``offload=True``, saved-tensor
    hooks): the sites (the C++ launcher's node and the Python path alike) give the gradients of the plain model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if kind == "native":
        model = CTAForCausalLM(CTAConfig.modern_decoder(pde_type="diffusion", pde_steps=4, pde_alpha=0.2, **shape))
    else:
        model = cta.patch_model(LlamaForCausalLM(LlamaConfig(**shape)), pde_steps=4, init="paper")
    model = model.cuda().train()
    twin = copy.deepcopy(model)
    twin.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    ids = torch.randint(1, 97, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    grads = []
    for m in (model, twin):
        m(ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("pde" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)
