"""A PDE site's settings changed after construction (issue 69): ``steps``, ``backend`` and the coefficients are read by
every path at the call, so a changed site gives what a site built with the new settings gives; the type, causality
and bounds cannot be changed (an AttributeError that says what to do). Each path is run once *before* the change, so
that what it keeps (the C++ launcher's key, the CPU decode map, the state block) was made with the old settings.

On CPU: the reference (``backend="torch"``) and the Triton kernels through Triton's interpreter (``TRITON_INTERPRET=1``,
tests/triton_testing.py), each without a cache (training: output and every gradient; inference) and with one
(prefill, then token by token). With ``CTA_TEST_GPU=1`` the same tests run on CUDA, where the training call is the C++
launcher's (tests/test_gpu_cpp_launch.py compares it there too)."""

from triton_testing import DEVICE, needs_kernels  # (first: sets up Triton's interpreter before triton is imported)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cta  # noqa: E402
from cta.pde_cta import MAX_PDE_STEPS, PDERefinement  # noqa: E402

CHANNELS, BATCH, LENGTH, PREFILL = 8, 2, 10, 6
BACKENDS = ["torch", pytest.param("triton", marks=needs_kernels)]


def _site(pde, steps, causal, backend, per_channel=False, seed=0):
    """A site at coefficients away from the identity (seeded), on DEVICE."""
    site = PDERefinement(CHANNELS, pde, steps, causal=causal, alpha=0.1, per_channel=per_channel, backend=backend,
                         layer_idx=0).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, (low, high) in zip(site.parameters(), site.bounds):
            p.copy_(low + (high - low) * (0.2 + 0.6 * torch.rand(p.shape, generator=g)))
    return site


def _copy_coefficients(source, target):
    """``target``'s coefficients as ``source``'s (the same parameter shapes: a replaced parameter is replaced)."""
    for name in ("alpha", "beta"):
        value = getattr(source, name)
        if value is not None:
            setattr(target, name, nn.Parameter(value.detach().clone()))


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, LENGTH, CHANNELS, generator=g).to(DEVICE)
    mask = torch.ones(BATCH, LENGTH, device=DEVICE)
    mask[1, :2] = 0  # left padding
    return x, mask


def _training_call(site, x, mask):
    """Output and gradients (input, then each coefficient) of a training call without a cache."""
    leaf = x.detach().clone().requires_grad_()
    site.zero_grad(set_to_none=True)
    y = site(leaf, mask)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (y * weights).sum().backward()
    return [y.detach(), leaf.grad] + [p.grad for p in site.parameters()]


def _cached_calls(site, x, mask, cache_steps):
    """Prefill, then one token at a time, through a hybrid cache of ``cache_steps`` conv states: the outputs."""
    from transformers import DynamicCache, LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, layer_types=["hybrid"], number_of_conv_states=max(cache_steps, 1),
                         hidden_size=64, num_attention_heads=1)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        outs = [site(x[:, :PREFILL], mask[:, :PREFILL], cache)]
        outs += [site(x[:, t:t + 1], mask[:, t:t + 1], cache) for t in range(PREFILL, LENGTH)]
    return torch.cat(outs, 1)


def _every_path(site, cache_steps):
    """What each path gives: training (output, gradients), inference, and (causal) cached prefill + decode."""
    x, mask = _inputs()
    results = {"training": _training_call(site, x, mask)}
    with torch.no_grad():
        results["inference"] = [site(x, mask)]
    if site.causal:
        results["cached"] = [_cached_calls(site, x, mask, cache_steps)]
    return results


def _assert_same(got, want, what):
    assert got.keys() == want.keys()
    for path in want:
        for i, (a, b) in enumerate(zip(got[path], want[path])):
            assert (a is None) == (b is None), (what, path, i)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {path}[{i}]: {m}")


CHANGES = {
    # name: (settings before, change, settings after)
    "steps 4 -> 2": (dict(steps=4), lambda s: setattr(s, "steps", 2), dict(steps=2)),
    "steps 4 -> 1": (dict(steps=4), lambda s: setattr(s, "steps", 1), dict(steps=1)),
    "steps 3 -> 0": (dict(steps=3), lambda s: setattr(s, "steps", 0), dict(steps=0)),
    "steps 2 -> 0 -> 2": (dict(steps=2), lambda s: (setattr(s, "steps", 0), setattr(s, "steps", 2)), dict(steps=2)),
    "alpha in place": (dict(steps=3), lambda s: s.alpha.data.mul_(0.5), dict(steps=3)),
    "alpha per channel": (dict(steps=3), lambda s: setattr(s, "alpha", nn.Parameter(
        torch.linspace(0.05, 0.3, CHANNELS, device=s.alpha.device))), dict(steps=3)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pde,causal", [("diffusion", True), ("reaction_diffusion", True),
                                        ("advection_diffusion", False)])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_site_gives_what_a_site_built_so_gives(change, pde, causal, backend):
    before, edit, after = CHANGES[change]
    site = _site(pde, before["steps"], causal, backend)
    _every_path(site, before["steps"])  # (each path once with the old settings: what it keeps is made now)
    edit(site)
    fresh = _site(pde, after["steps"], causal, backend)
    _copy_coefficients(site, fresh)
    _assert_same(_every_path(site, before["steps"]), _every_path(fresh, after["steps"]), change)


@pytest.mark.parametrize("to_backend", BACKENDS)
@pytest.mark.parametrize("from_backend", BACKENDS)
def test_a_changed_backend_gives_what_a_site_built_with_it_gives(from_backend, to_backend):
    site = _site("reaction_diffusion", 3, True, from_backend)
    _every_path(site, 3)
    site.backend = to_backend
    fresh = _site("reaction_diffusion", 3, True, to_backend)
    _assert_same(_every_path(site, 3), _every_path(fresh, 3), f"{from_backend} -> {to_backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_decode_follows_a_changed_step_count(backend):
    """A decode step after ``steps`` went from 4 to 2 gives what a 2-step site gives (what a step count shapes must
    follow it: a kept map raised a shape error before 0.2.0)."""
    site = _site("diffusion", 4, True, backend)
    levels = [torch.zeros(BATCH, 1, CHANNELS, 1, device=DEVICE) for _ in range(4)]
    x = torch.randn(BATCH, 1, CHANNELS, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        site._decode(x, levels, None)
        site.steps = 2
        fresh = _site("diffusion", 2, True, backend)
        got = site._decode(x, [torch.zeros_like(level) for level in levels[:2]], None)
        want = fresh._decode(x, [torch.zeros_like(level) for level in levels[:2]], None)
    torch.testing.assert_close(got, want)


def test_steps_above_the_cache_layout_raise_with_a_cache_only():
    """A site owns ``steps`` conv states of its cache layer, as built: with a cache it cannot take more steps (it would
    write another site's states); without one it can."""
    site = _site("diffusion", 2, True, "torch")
    x, mask = _inputs()
    site.steps = 4
    fresh = _site("diffusion", 4, True, "torch")
    _copy_coefficients(site, fresh)
    torch.testing.assert_close(site(x, mask), fresh(x, mask))
    with pytest.raises(ValueError, match=r"built with steps=2 .* with steps=4 it would use the states of another"):
        _cached_calls(site, x, mask, 2)


@pytest.mark.parametrize("name,value", [("pde_type", "wave"), ("causal", False), ("alpha_bounds", (0.0, 5.0)),
                                        ("beta_bounds", (-1.0, 1.0))])
def test_the_type_causality_and_bounds_cannot_be_changed(name, value):
    site = _site("reaction_diffusion", 2, True, "torch")
    kept = getattr(site, name)
    with pytest.raises(AttributeError, match=rf"PDERefinement\.{name} is fixed at construction .* build a new "
                                             r"PDERefinement, or unpatch the model"):
        setattr(site, name, value)
    assert getattr(site, name) == kept


@pytest.mark.parametrize("name,value,message", [
    ("steps", -1, r"`steps` must be an int"), ("steps", 2.0, r"`steps` must be an int"),
    ("steps", True, r"`steps` must be an int"), ("steps", MAX_PDE_STEPS + 1, r"`steps` must be an int"),
    ("backend", "cuda", r"`backend` must be one of"),
])
def test_a_live_setting_is_checked_when_set(name, value, message):
    site = _site("diffusion", 2, True, "torch")
    with pytest.raises(ValueError, match=message):
        setattr(site, name, value)
    assert (site.steps, site.backend) == (2, "torch")


def test_a_patched_model_follows_its_sites_steps():
    """The tests' own ``set_pde_steps`` (tests/test_modeling.py) on a patched model: every site at 1 step gives the
    model patched with 1 step, cached generation included (fewer steps than the cache holds per site)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pde_testing import randomize_pde

    def model(steps):
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
        cta.patch_model(m, pde_type="reaction_diffusion", pde_steps=steps, placement=["value", "block_output"],
                        backend="torch")
        return randomize_pde(m, seed=1).eval()

    live, built = model(3), model(1)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    live(ids)
    for site, other in zip((m for m in live.modules() if isinstance(m, PDERefinement)),
                           (m for m in built.modules() if isinstance(m, PDERefinement))):
        site.steps = 1
        _copy_coefficients(other, site)
    torch.testing.assert_close(live(ids).logits, built(ids).logits)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(live.generate(ids, **kwargs), built.generate(ids, **kwargs))
