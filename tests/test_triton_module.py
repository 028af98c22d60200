"""PDERefinement on the Triton kernels against the same module on the PyTorch reference: its one-token decode step
(the update kernel, through a real hybrid cache) and its stateless training call (one autograd node that projects
the raw coefficients). On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set below before
triton is imported: tests/triton_testing.py); tests marked for the GPU run them on CUDA with ``CTA_TEST_GPU=1``. Tolerances as in
``test_triton_kernels.py``."""

from triton_testing import DEVICE, needs_kernels  # (first: sets up Triton's interpreter before triton is imported)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from cta.pde_cta import PDE_TYPES  # noqa: E402


def _decode_module_pair(channels, pde, steps):
    """A one-layer hybrid cache config and two identical causal PDERefinement modules (per-channel alpha),
    ``{"triton": ..., "torch": ...}``, on DEVICE."""
    from transformers import LlamaConfig

    from cta.pde_cta import PDERefinement

    config = LlamaConfig(num_hidden_layers=1, layer_types=["hybrid"], number_of_conv_states=steps,  # one per step
                         hidden_size=64, num_attention_heads=1)
    modules = {}
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        modules[backend] = PDERefinement(channels, pde, steps, causal=True, alpha=0.1, per_channel=True,
                                         backend=backend, layer_idx=0).to(DEVICE)
    return config, modules


def _state(cache):
    """A site's cached state ``[batch, steps, channels, 1]``: its conv states (one per step) side by side."""
    layer = cache.layers[0]
    return torch.cat([layer.conv_states[index] for index in sorted(layer.conv_states)], 1)


@needs_kernels
@pytest.mark.parametrize("pde", PDE_TYPES)
def test_module_decode_matches_reference_module(pde):
    """PDERefinement's decode step (the Triton update kernel) against the reference module through a real hybrid
    cache: outputs and states per token, padding tokens, and a coefficient update between tokens."""
    from transformers import DynamicCache

    channels, steps = 37, 3
    config, modules = _decode_module_pair(channels, pde, steps)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 30, channels, generator=gen).to(DEVICE)
    mask = torch.ones(2, 30, device=DEVICE)
    mask[1, 20] = 0  # a padding token inside the decoded part
    caches = {b: DynamicCache(config=config) for b in modules}
    with torch.no_grad():
        full = modules["torch"](x, mask)  # one full-sequence pass, before the coefficient update below
        outs = {b: [m(x[:, :16], mask[:, :16], caches[b])] for b, m in modules.items()}
        for t in range(16, 30):
            if t == 23:  # an in-place update (what an optimizer does) between two decode steps
                for m in modules.values():
                    m.alpha.mul_(0.5)
            for b, m in modules.items():
                outs[b].append(m(x[:, t:t + 1], mask[:, t:t + 1], caches[b]))
            torch.testing.assert_close(outs["triton"][-1], outs["torch"][-1], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(_state(caches["triton"]), _state(caches["torch"]), rtol=1e-5, atol=1e-6)
    # up to the update, prefill + decode equals the full-sequence pass
    torch.testing.assert_close(torch.cat(outs["triton"], 1)[:, :23], full[:, :23], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(torch.cat(outs["triton"], 1)[:, 23:], full[:, 23:], atol=1e-3)  # the update mattered


@needs_kernels
def test_module_decode_refuses_a_state_of_another_shape():
    """The module's decode step checks the state the cache hands over (on the CPU its block of conv states, on CUDA
    the conv states): a state of another batch would be read and written out of bounds."""
    from transformers import DynamicCache

    config, modules = _decode_module_pair(24, "diffusion", 2)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        modules["triton"](torch.randn(2, 5, 24, device=DEVICE), None, cache)  # prefill: 2 states [2, 1, 24, 1]
        with pytest.raises(ValueError, match=r"float32 .*\[batch, (1|steps), channels\] = \[3, (1|2), 24\]"):
            modules["triton"](torch.randn(3, 1, 24, device=DEVICE), None, cache)


@needs_kernels
@pytest.mark.parametrize("pde", ["diffusion", "reaction_diffusion"])
def test_module_decode_follows_every_change(pde):
    """The Triton decode step of PDERefinement against the reference module, token by token, across a coefficient
    updated in place and one replaced, a second cache, a beam reorder of the state, another batch size, strided
    tokens, and a step under autograd."""
    from torch import nn
    from transformers import DynamicCache

    channels, steps = 40, 4
    config, modules = _decode_module_pair(channels, pde, steps)
    gen = torch.Generator().manual_seed(5)

    def generation(batch, tokens, edit=None, reorder_at=None, strided=False):
        x = torch.randn(batch, 8 + tokens, channels, generator=gen).to(DEVICE)
        caches = {b: DynamicCache(config=config) for b in modules}
        for b, m in modules.items():
            m(x[:, :8], None, caches[b])
        for t in range(8, 8 + tokens):
            if t == 10 and edit is not None:
                for m in modules.values():
                    edit(m)
            if t == reorder_at:
                beams = torch.arange(batch - 1, -1, -1, device=DEVICE)
                for cache in caches.values():
                    cache.reorder_cache(beams)
            token = x[:, t:t + 1] if strided else x[:, t:t + 1].contiguous()
            outs = {b: m(token, None, caches[b]) for b, m in modules.items()}
            torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(_state(caches["triton"]), _state(caches["torch"]), rtol=1e-5, atol=1e-6)

    with torch.no_grad():
        generation(2, 5, edit=lambda m: m.alpha.mul_(0.5))  # in-place update (what an optimizer does)
        generation(2, 5, edit=lambda m: setattr(m, "alpha", nn.Parameter(m.alpha.detach() * 0.5)))
        generation(3, 6, reorder_at=11)  # a new cache and batch size, then a beam reorder
        generation(3, 4, strided=True)
    x = torch.randn(3, 9, channels, generator=gen).to(DEVICE)
    caches = {b: DynamicCache(config=config) for b in modules}
    grads = {}
    for b, m in modules.items():  # autograd: never the plan, and the gradient flows
        with torch.no_grad():
            m(x[:, :8], None, caches[b])
        token = x[:, 8:].clone().requires_grad_(True)
        m(token, None, caches[b]).square().sum().backward()
        grads[b] = token.grad
    torch.testing.assert_close(grads["triton"], grads["torch"], rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("pde,causal,per_channel", [
    ("diffusion", True, False), ("diffusion", False, True), ("wave", True, True),
    ("reaction_diffusion", False, False), ("advection_diffusion", True, False), ("advection_diffusion", False, True),
])
def test_module_training_call_matches_reference_module(pde, causal, per_channel):
    """PDERefinement's stateless call on the kernels (one autograd node that projects the raw coefficients:
    ``pde_refine_module_triton``) against the reference module: outputs, the input gradient and the raw
    coefficients' gradients (straight-through: a coefficient outside its bounds computes with the bound and still
    gets the gradient), with a padding mask, on an odd shape."""
    from cta.pde_cta import PDERefinement

    batch, seq, channels, steps = 2, 37, 19, 3
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(batch, seq, channels, generator=gen).to(DEVICE)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :5] = 0
    mask = mask.to(DEVICE)
    upstream = torch.randn(batch, seq, channels, generator=gen).to(DEVICE)
    results = {}
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        module = PDERefinement(channels, pde, steps, causal=causal, alpha=0.1, per_channel=per_channel,
                               backend=backend).to(DEVICE)
        with torch.no_grad():
            # the first coefficient above its upper bound: computed with the bound, still trained
            module.alpha.copy_(torch.linspace(module.alpha_bounds[1] + 0.3, 0.05, module.alpha.numel()))
        leaf = x.clone().requires_grad_(True)
        out = module(leaf, mask)
        (out * upstream).sum().backward()
        grads = [leaf.grad, module.alpha.grad] + ([module.beta.grad] if module.beta is not None else [])
        with torch.no_grad():
            inference = module(x, mask)
        results[backend] = (out.detach(), inference, *grads)
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * (1 + batch * seq * channels) ** 0.5)
    assert results["triton"][2].abs().max() > 0  # the out-of-bounds coefficient got a gradient
    with pytest.raises(ValueError, match="attention_mask"):
        module_t = PDERefinement(channels, pde, steps, causal=causal, backend="triton").to(DEVICE)
        module_t(x, mask[:, 1:])


@needs_kernels
def test_module_training_call_with_bf16_coefficients():
    """FSDP2's bf16 parameter policy and DeepSpeed's bf16 mode hand the site bf16 coefficients and activations: the
    kernels (fp32 inside) match the reference module run in fp32 on the same bf16 values, and the coefficient keeps
    its dtype and shape in its gradient."""
    from cta.pde_cta import PDERefinement

    x = torch.randn(2, 37, 19, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    results = {}
    for backend, dtype in (("triton", torch.bfloat16), ("torch", torch.float32)):
        module = PDERefinement(19, "diffusion", 3, causal=True, alpha=0.2, backend=backend).to(DEVICE, dtype)
        leaf = x.to(dtype).clone().requires_grad_(True)
        out = module(leaf)
        out.float().square().sum().backward()
        results[backend] = (out.float(), leaf.grad.float(), module.alpha.grad)
    (out, dx, da), (ref_out, ref_dx, ref_da) = results["triton"], results["torch"]
    assert da.dtype == torch.bfloat16 and da.shape == (1,)
    torch.testing.assert_close(out, ref_out, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(dx, ref_dx, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(da.float(), ref_da, rtol=2e-2, atol=1e-1)
