"""The C++ site launcher (``kernels_cpp``, ``csrc/site_launch.cpp``) against the Python path it replays: the same
kernels, so the output and the input gradient are bitwise equal, the coefficient gradients equal up to the order of
an atomic sum (GPU only)."""

import pytest
import torch

import cta
from cta import kernels_cpp
from cta.pde_cta import PDERefinement

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not cta.triton_available(), reason="needs CUDA and triton"
)


@pytest.fixture
def python_path():
    """A context (``with python_path():``) whose calls take the Python path (the launcher off)."""
    return kernels_cpp.python_launch


@pytest.fixture
def fresh_tables():
    """Empties the launcher's plan tables and its warnings given (call it after changing a setting they read); they
    are emptied again after the test."""
    def clear():
        kernels_cpp.plan_table.cache_clear()
        kernels_cpp._warn_once.cache_clear()
    yield clear
    clear()


def _run(module, x, mask, gy_of=lambda y: y):
    leaf = x.detach().requires_grad_()
    module.zero_grad()
    y = module(leaf, mask)
    weights = torch.randn(gy_of(y).shape, device=x.device, generator=torch.Generator(x.device).manual_seed(1))
    (gy_of(y).float() * weights).sum().backward()
    grads = [leaf.grad] + [p.grad.clone() for p in module.parameters()]
    return y.detach(), grads, y.grad_fn.name()


@requires_cuda
@pytest.mark.parametrize("pde_type,causal", [("diffusion", True), ("diffusion", False), ("advection_diffusion", True)])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype,masked", [(torch.bfloat16, False), (torch.float32, True), (torch.float16, True)])
def test_planned_call_equals_the_python_path(pde_type, causal, per_channel, dtype, masked, python_path):
    assert kernels_cpp.extension() is not None, "the C++ launcher did not build"
    torch.manual_seed(0)
    channels = 96  # (not a multiple of the channel block on every plan: masked channel blocks)
    module = PDERefinement(channels, pde_type, steps=4, causal=causal, alpha=0.12, beta=0.05,
                           per_channel=per_channel).cuda()
    x = torch.randn(3, 37, channels, device="cuda", dtype=dtype)
    mask = None
    if masked:
        mask = torch.ones(3, 37, dtype=torch.bool, device="cuda")
        mask[1, :5] = False
    # a gradient with other strides than the output's (the C++ backward copies it into the planned layout)
    for gy_of in (lambda y: y, lambda y: y.transpose(0, 1)):
        y, grads, node = _run(module, x, mask, gy_of)
        with python_path():
            y_py, grads_py, node_py = _run(module, x, mask, gy_of)
        assert "SiteRefine" in node and "SiteRefine" not in node_py
        assert torch.equal(y, y_py)
        assert torch.equal(grads[0], grads_py[0])
        with torch.no_grad():  # (no autograd node: the same launch)
            assert torch.equal(module(x, mask), y)
        for got, want in zip(grads[1:], grads_py[1:]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@requires_cuda
def test_calls_without_a_plan_take_the_python_path():
    torch.manual_seed(0)
    module = PDERefinement(64, "reaction_diffusion", steps=3, causal=True).cuda()  # (its backward: the tile kernel)
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    assert "SiteRefine" not in module(x).grad_fn.name()
    diffusion = PDERefinement(64, "diffusion", steps=2, causal=True).cuda()
    strided = torch.randn(2, 64, 16, device="cuda").transpose(1, 2).requires_grad_()  # (channels not contiguous)
    assert "SiteRefine" not in diffusion(strided).grad_fn.name()
    assert "SiteRefine" in diffusion(x).grad_fn.name()

@requires_cuda
def test_another_stream_and_a_cuda_graph_get_their_own_workspace(python_path):
    torch.manual_seed(0)
    module = PDERefinement(128, "diffusion", steps=4, causal=True, per_channel=True).cuda()
    x = torch.randn(2, 64, 128, device="cuda")
    y, grads, _ = _run(module, x, None)  # (makes the plan on the default stream)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # (each launch leaves its workspace at zero: repeated calls agree)
            y_s, grads_s, node = _run(module, x, None)
    torch.cuda.current_stream().wait_stream(stream)
    assert "SiteRefine" in node and torch.equal(y_s, y) and torch.equal(grads_s[0], grads[0])
    torch.testing.assert_close(grads_s[1], grads[1], rtol=1e-4, atol=1e-6)

    static_x = x.clone().requires_grad_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        module(static_x).sum().backward()  # (warm-up on the side stream, as graph capture asks)
    torch.cuda.current_stream().wait_stream(stream)
    module.zero_grad()
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_y = module(static_x)
        static_y.sum().backward()
    graph.replay()
    torch.cuda.synchronize()
    with python_path():
        leaf = x.clone().requires_grad_()
        expected = module(leaf)
        expected.sum().backward()
    assert torch.equal(static_y, expected) and torch.equal(static_x.grad, leaf.grad)


@requires_cuda
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_plan_made_inside_an_activation_checkpoint(use_reentrant, python_path):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    steps = 3 if use_reentrant else 5  # (a configuration no other test planned: its plan is made in the checkpoint)
    module = PDERefinement(80, "diffusion", steps=steps, causal=True, per_channel=True).cuda()
    x = torch.randn(2, 33, 80, device="cuda")

    def run():
        leaf = x.clone().requires_grad_()
        module.zero_grad()
        y = checkpoint(lambda v: module(v) * 1.5, leaf, use_reentrant=use_reentrant)
        (y * torch.linspace(-1, 1, 80, device="cuda")).sum().backward()
        return y.detach(), leaf.grad, module.alpha.grad.clone()

    got = run()
    assert "SiteRefine" in module(x.clone().requires_grad_()).grad_fn.name()
    with python_path():
        want = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-6)


@requires_cuda
def test_bf16_parameters_get_a_plan(python_path):
    """A model cast to bf16 has bf16 coefficients; their per-channel gradients, summed with atomics in any order,
    differ between two runs by bf16 steps: the plan's check allows that (and still serves)."""
    torch.manual_seed(0)
    module = PDERefinement(192, "diffusion", steps=4, causal=True, per_channel=True).cuda().to(torch.bfloat16)
    x = torch.randn(4, 257, 192, device="cuda", dtype=torch.bfloat16)
    y, grads, node = _run(module, x, None)
    with python_path():
        y_py, grads_py, _ = _run(module, x, None)
    assert "SiteRefine" in node and torch.equal(y, y_py) and torch.equal(grads[0], grads_py[0])
    torch.testing.assert_close(grads[1], grads_py[1], rtol=3e-2, atol=1e-3)


@requires_cuda
def test_the_hand_written_node_keeps_autograd_s_guarantees(python_path):
    torch.manual_seed(0)
    module = PDERefinement(64, "diffusion", steps=2, causal=True).cuda()
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    # an input changed in place after the call: the backward raises, as torch's own nodes do
    hidden = x * 1
    y = module(hidden)
    assert "SiteRefine" in y.grad_fn.name()
    hidden.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    # a second backward through a freed graph raises; with retain_graph the two gradients are equal
    y = module(x)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="a second time"):
        y.sum().backward()
    x.grad = None
    y = module(x)
    y.sum().backward(retain_graph=True)
    first, x.grad = x.grad.clone(), None
    y.sum().backward()
    assert torch.equal(x.grad, first)
    # only the coefficient asks for a gradient: the Python path's
    module.zero_grad()
    module(x.detach()).sum().backward()
    planned = module.alpha.grad.clone()
    module.zero_grad()
    with python_path():
        module(x.detach()).sum().backward()
    torch.testing.assert_close(planned, module.alpha.grad, rtol=1e-4, atol=1e-6)
    # saved-tensor hooks (activation offloading, checkpointing) see the node's saved operands
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        module(x)
    assert any(t.data_ptr() == x.data_ptr() for t in packed)
    # a forward-mode tangent is not dropped: the Python path serves the call (and says it has no jvp)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), pytest.raises(NotImplementedError):
        module(fwAD.make_dual(x.detach(), torch.ones_like(x)))


@requires_cuda
def test_a_compiled_call_launches_the_plans(python_path):
    """Under torch.compile a site is the ``cta::pde_refine_fwd`` / ``_bwd`` custom ops (the graph holds the autograd);
    their implementations launch the launcher's plans, made and checked on the first call, and give the Python path's
    output and input gradient bitwise."""
    torch.manual_seed(0)
    module = PDERefinement(96, "diffusion", steps=4, causal=True, alpha=0.12, per_channel=True).cuda()
    x = torch.randn(3, 37, 96, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(3, 37, dtype=torch.bool, device="cuda")
    mask[1, :5] = False
    compiled = torch.compile(module, fullgraph=True)
    y, grads, _ = _run(compiled, x, mask)
    # the op's plan (the coefficient projected in the graph, so the configuration has no bounds) serves this metadata
    table = kernels_cpp.plan_table((module.pde_type, module.steps, module.causal, None))
    alpha = module.alpha.detach().clamp(*module.alpha_bounds)
    assert torch.equal(table.forward(x, alpha, None, mask), y)
    with python_path():
        y_py, grads_py, _ = _run(compiled, x, mask)
    assert torch.equal(y, y_py) and torch.equal(grads[0], grads_py[0])
    torch.testing.assert_close(grads[1], grads_py[1], rtol=1e-4, atol=1e-6)


@requires_cuda
def test_making_a_plan_leaves_the_random_stream_alone():
    """The check of a new plan draws its output gradient from a generator of its own: a first step (every site makes
    its plan) must not shift the user's random stream (dropout masks, sampling) against a run without the launcher."""
    module = PDERefinement(80, "diffusion", steps=3, causal=True, alpha=0.1).cuda()
    x = torch.randn(2, 29, 80, device="cuda", requires_grad=True)  # (a shape no other test plans)
    config = (module.pde_type, module.steps, module.causal, module.bounds)
    plans = len(kernels_cpp.plan_table(config))
    state = torch.cuda.get_rng_state()
    assert "SiteRefine" in module(x).grad_fn.name()
    assert len(kernels_cpp.plan_table(config)) == plans + 1 and torch.equal(torch.cuda.get_rng_state(), state)


@requires_cuda
def test_a_python_error_inside_a_planned_call_keeps_its_type():
    """A saved-tensor hook that raises inside the planned call (non-reentrant checkpointing stops its recomputation
    so) reaches the caller as its own exception, not as a RuntimeError of the launcher's."""
    class Stop(Exception):
        pass

    def pack(tensor):
        raise Stop("from the pack hook")

    module = PDERefinement(64, "diffusion", steps=2, causal=True).cuda()
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    assert "SiteRefine" in module(x).grad_fn.name()  # (planned)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), pytest.raises(Stop, match="pack hook"):
        module(x)
    assert "SiteRefine" in module(x).grad_fn.name()  # (and the next call is served as before)


@requires_cuda
@pytest.mark.parametrize("pde_type", ["diffusion", "advection_diffusion"])
def test_a_setting_changed_after_construction_takes_its_own_plan(pde_type, python_path):
    """Issue 69: the launcher's key followed the steps a site was built with, so after ``site.steps = 2`` the eager
    training call ran 4 steps (0.179 off on an H100). Each change (steps down and up, the backend, the coefficients
    in place and replaced) against a site built with the new settings, on the launcher and on the Python path."""
    from torch import nn

    torch.manual_seed(0)
    channels = 64
    x = torch.randn(2, 41, channels, device="cuda")

    def site(steps, backend="auto"):
        module = PDERefinement(channels, pde_type, steps=steps, causal=True, alpha=0.1, beta=0.05,
                               backend=backend).cuda()
        with torch.no_grad():
            module.alpha.fill_(0.2)
        return module

    live = site(4)
    assert "SiteRefine" in _run(live, x, None)[2]  # (a plan under the built settings)
    for change, steps, backend in (("steps", 2, "auto"), ("steps", 1, "auto"), ("steps", 4, "auto"),
                                   ("backend", 4, "torch"), ("backend", 4, "triton"), ("alpha", 4, "triton"),
                                   ("alpha per channel", 4, "triton")):
        if change == "steps":
            live.steps = steps
        elif change == "backend":
            live.backend = backend
        elif change == "alpha":
            with torch.no_grad():
                live.alpha.mul_(0.5)
        else:
            live.alpha = nn.Parameter(torch.linspace(0.01, 0.24, channels, device="cuda"))
        fresh = site(steps, backend)
        fresh.alpha = nn.Parameter(live.alpha.detach().clone())
        y, grads, node = _run(live, x, None)
        # (a per-channel alpha beside a scalar beta: causal advection's gradient takes a second kernel, which no plan
        # covers, so that call takes the Python path)
        mixed = change == "alpha per channel" and live.beta is not None
        assert ("SiteRefine" in node) == (backend != "torch" and not mixed), change
        with python_path():
            y_fresh, grads_fresh, _ = _run(fresh, x, None)
        torch.testing.assert_close(y, y_fresh, rtol=1e-5, atol=1e-6, msg=change)
        for got, want in zip(grads, grads_fresh):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=change)


@requires_cuda
def test_an_evicted_plan_serves_its_pending_backward_and_is_made_again(monkeypatch, python_path, fresh_tables):
    """Tables keep ``PLANS_PER_TABLE`` plans (here 2): a call's backward still runs after its plan was evicted (the
    node holds it), and the evicted metadata gets a new, checked plan."""
    monkeypatch.setattr(kernels_cpp, "PLANS_PER_TABLE", 2)
    fresh_tables()
    module = PDERefinement(48, "diffusion", steps=3, causal=True, alpha=0.2, per_channel=True).cuda()
    inputs = [torch.randn(2, n, 48, device="cuda", requires_grad=True) for n in (11, 12, 13, 11)]
    outputs = [module(x) for x in inputs]  # (the third evicts the first's plan; the fourth makes it again)
    table = kernels_cpp.plan_table((module.pde_type, module.steps, module.causal, module.bounds))
    assert len(table) == 2 and all("SiteRefine" in y.grad_fn.name() for y in outputs)
    for x, y in zip(inputs, outputs):
        y.square().sum().backward()
        with python_path():
            leaf = x.detach().clone().requires_grad_()
            module(leaf).square().sum().backward()
        assert torch.equal(x.grad, leaf.grad)


@requires_cuda
def test_a_plan_that_misreads_a_coefficient_is_refused_at_the_identity_init(monkeypatch, caplog, fresh_tables):
    """A plan whose alpha and beta slots are swapped (what a changed launch ABI could do) agrees with the Python path
    at the identity init (both 0): the check runs at coefficients that move the stencil, so it is refused, with one
    warning, and the call takes the Python path."""
    original = kernels_cpp._launch_spec

    def swapped(launch, args, operands):
        spec = original(launch, args, operands)
        if spec is None or len(operands) != 5:  # (the forward: x, y, mask, alpha, beta)
            return spec
        slots = [(4 if s[0] == 3 else 3 if s[0] == 4 else s[0], *s[1:]) for s in spec[4]]
        return (*spec[:4], slots)

    monkeypatch.setattr(kernels_cpp, "_launch_spec", swapped)
    fresh_tables()
    module = PDERefinement(64, "advection_diffusion", steps=2, causal=True, alpha=0.0, beta=0.0).cuda()
    with caplog.at_level("WARNING", logger=kernels_cpp.__name__):
        for n in (17, 18):
            y = module(torch.randn(2, n, 64, device="cuda", requires_grad=True))
            assert "SiteRefine" not in y.grad_fn.name()
    assert len([r for r in caplog.records if "disagreed" in r.getMessage()]) == 1
