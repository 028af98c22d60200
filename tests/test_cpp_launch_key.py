"""The C++ site launcher's plan lookup (``csrc/site_launch.cpp``), built here as on a user's machine: a call finds a
plan only with the metadata the binaries were specialised on. (Its launches run on CUDA: test_gpu_cpp_launch.py.)"""

import shutil

import pytest
import torch

from cta import kernels_cpp, kernels_cpu


@pytest.fixture(scope="module")
def table():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the launcher is not built here (the Python path serves)")
    return kernels_cpp.build().PlanTable(kernels_cpp.PLANS_PER_TABLE)


def test_key_tells_apart_what_the_binaries_are_specialised_on(table):
    x = torch.randn(2, 8, 32)
    alpha = torch.full((1,), 0.1)
    key = table.key(x, alpha, None, None)
    assert table.key(x.clone(), alpha.clone(), None, None) == key  # (fresh tensors: same metadata, aligned)
    others = {
        "shape": table.key(torch.randn(2, 9, 32), alpha, None, None),
        "strides": table.key(torch.randn(8, 2, 32).transpose(0, 1), alpha, None, None),
        "dtype": table.key(x.to(torch.float64), alpha, None, None),
        "alignment": table.key(torch.randn(2 * 8 * 32 + 1)[1:].view(2, 8, 32), alpha, None, None),
        "per-channel alpha": table.key(x, torch.full((32,), 0.1), None, None),
        "beta": table.key(x, alpha, alpha.clone(), None),
        "mask": table.key(x, alpha, None, torch.ones(2, 8, dtype=torch.bool)),
        "mask dtype": table.key(x, alpha, None, torch.ones(2, 8)),
    }
    for name, other in others.items():
        assert other != key, name
    torch.use_deterministic_algorithms(True)
    try:
        assert table.key(x, alpha, None, None) != key
    finally:
        torch.use_deterministic_algorithms(False)


def test_unknown_and_refused_metadata_take_the_python_path(table):
    refine = kernels_cpp.build().refine  # (the call a site makes: the module's fast entry, the table its argument)
    x, alpha = torch.randn(1, 4, 16), torch.full((1,), 0.1)
    assert refine(table, x, alpha, None, None) is None  # (no plan yet: Python makes one, or refuses)
    table.refuse(table.key(x, alpha, None, None))
    assert refine(table, x, alpha, None, None) is False
    assert refine(table, torch.randn(1, 5, 16), alpha, None, None) is None
    assert len(table) == 1
    lengths = range(6, 206)  # (training with dynamic padding sees many lengths: one entry each, found by hash)
    for length in lengths:
        table.refuse(table.key(torch.randn(1, length, 16), alpha, None, None))
    table.refuse(table.key(x, alpha, None, None))  # (refused again: still one entry)
    assert len(table) == 1 + len(lengths)
    assert all(refine(table, torch.randn(1, n, 16), alpha, None, None) is False for n in lengths)
    assert refine(table, torch.randn(1, 206, 16), alpha, None, None) is None
    # the plan found last is remembered, and a call of other metadata still finds its own
    for n in (6, 206, 7, 7, 206, 6):
        assert refine(table, torch.randn(1, n, 16), alpha, None, None) is (None if n == 206 else False)
    with pytest.raises(TypeError, match="argument 2 is not a tensor"):
        refine(table, x, 0.1, None, None)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        refine(table, x, alpha)
    with pytest.raises(RuntimeError, match="cast"):  # (not a table: pybind11's cast error, as a Python error)
        refine(alpha, x, alpha, None, None)


def test_a_table_keeps_its_capacity_evicting_the_least_recently_used():
    """Plans are bounded per table (``PLANS_PER_TABLE``): a new one evicts the plan looked up least recently, whose
    metadata then gets a new plan (None: no plan); the plan found last is forgotten when evicted. (Refused entries are
    plans too: on CPU they are what a table can hold. A pending backward keeps an evicted plan alive: the GPU test.)"""
    module = kernels_cpp.build()
    assert module.PlanTable(kernels_cpp.PLANS_PER_TABLE).capacity == kernels_cpp.PLANS_PER_TABLE == 1024
    with pytest.raises(ValueError, match="at least one plan"):
        module.PlanTable(0)
    table, alpha = module.PlanTable(3), torch.full((1,), 0.1)
    x = {n: torch.randn(1, n, 16) for n in range(1, 8)}
    key = {n: table.key(t, alpha, None, None) for n, t in x.items()}
    for n in (1, 2, 3):
        table.refuse(key[n])
    assert module.refine(table, x[1], alpha, None, None) is False  # (1 is now the most recently used)
    table.refuse(key[4])  # evicts 2, the least recently used
    assert len(table) == 3
    assert [module.refine(table, x[n], alpha, None, None) for n in (1, 2, 3, 4)] == [False, None, False, False]
    table.refuse(key[3])  # refused again: no new entry, nothing evicted
    assert len(table) == 3 and module.refine(table, x[1], alpha, None, None) is False
    single = module.PlanTable(1)
    single.refuse(key[5])
    assert module.refine(single, x[5], alpha, None, None) is False  # (5 is the plan found last)
    single.refuse(key[6])  # evicts 5, the plan found last
    assert module.refine(single, x[5], alpha, None, None) is None
    assert module.refine(single, x[6], alpha, None, None) is False and len(single) == 1


@pytest.fixture
def fresh_launcher():
    """The launcher's process caches (the built module, the plan tables) emptied before and after the test."""
    caches = (kernels_cpp.extension, kernels_cpp.plan_table)
    [cache.cache_clear() for cache in caches]
    yield
    [cache.cache_clear() for cache in caches]


def test_an_untested_triton_turns_the_launcher_off_with_one_warning(monkeypatch, caplog, fresh_launcher):
    """On a Triton release outside ``TESTED_TRITON`` the launcher is not built: every call, whatever its shape, takes
    the Python path, and one warning says why; ``CTA_CPP_LAUNCH=1`` builds it anyway, ``=0`` turns it off quietly."""
    monkeypatch.setattr(kernels_cpp, "INTERPRET", False)  # (the CPU tests run Triton's interpreter: no launcher)
    monkeypatch.setattr(kernels_cpp, "build", lambda: "built")
    monkeypatch.setattr(kernels_cpp, "triton_release", lambda: "9.1")
    monkeypatch.delenv("CTA_CPP_LAUNCH", raising=False)
    alpha = torch.full((1,), 0.1)
    with caplog.at_level("DEBUG", logger=kernels_cpp.__name__):
        for config in (("diffusion", 2, True, None), ("diffusion", 3, True, None)):
            for length in (4, 5, 6):
                assert kernels_cpp.refine_planned(config, torch.randn(1, length, 16), alpha, None, None) is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "tested with Triton 3.6 and Triton 9.1 is installed" in warnings[0].getMessage()
    assert "CTA_CPP_LAUNCH=1 runs it anyway" in warnings[0].getMessage()
    assert kernels_cpp.extension() is None
    for setting, built in (("1", "built"), ("0", None)):
        monkeypatch.setenv("CTA_CPP_LAUNCH", setting)
        kernels_cpp.extension.cache_clear()
        assert kernels_cpp.extension() == built
    monkeypatch.delenv("CTA_CPP_LAUNCH")
    for release in kernels_cpp.TESTED_TRITON:
        monkeypatch.setattr(kernels_cpp, "triton_release", lambda: release)
        kernels_cpp.extension.cache_clear()
        assert kernels_cpp.extension() == "built"
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_each_new_metadata_is_planned_once_and_the_switch_bypasses_the_launcher(table, monkeypatch, fresh_launcher):
    """``refine_planned``'s dispatch with the real tables (planning itself needs CUDA: here it refuses, which sends a
    call to the Python path as a failed check does): a new metadata is planned once, then found; each site
    configuration has its own table, kept across calls; inside ``python_launch()`` and in inference mode nothing
    is planned, and every call returns None (the Python path)."""
    module = kernels_cpp.build()
    monkeypatch.setattr(kernels_cpp, "extension", lambda: module)
    planned = []

    def refuse(table, config, x, alpha, beta, mask):
        planned.append((config, tuple(x.shape)))
        table.refuse(table.key(x, alpha, beta, mask))

    monkeypatch.setattr(kernels_cpp, "_add_plan", refuse)
    monkeypatch.setattr(kernels_cpp, "_may_plan", lambda: True)  # (no CUDA stream here to ask)
    alpha = torch.full((1,), 0.1)
    configs = [("diffusion", 2, True, None), ("diffusion", 3, True, None)]
    calls = [(config, n) for config in configs for n in (5, 6, 5, 6)]
    with kernels_cpp.python_launch():
        assert all(kernels_cpp.refine_planned(c, torch.randn(1, n, 16), alpha, None, None) is None for c, n in calls)
    with torch.inference_mode():
        assert all(kernels_cpp.refine_planned(c, torch.randn(1, n, 16), alpha, None, None) is None for c, n in calls)
    assert planned == []
    assert all(kernels_cpp.refine_planned(c, torch.randn(1, n, 16), alpha, None, None) is None for c, n in calls)
    assert planned == [(c, (1, n, 16)) for c in configs for n in (5, 6)]
    tables = [kernels_cpp.plan_table(c) for c in configs]
    assert tables[0] is not tables[1] and [len(t) for t in tables] == [2, 2]
    assert kernels_cpp.plan_table.cache_info().maxsize == kernels_cpp.TABLES


@pytest.mark.parametrize("shape", [(), (1,), (5,)])
def test_the_check_coefficients_keep_the_metadata_of_the_call_s(shape):
    """A new plan is checked at coefficients with the call's metadata (its key): shape (0-d too, a functional call's
    scalar tensor), dtype and address modulo 16, at values inside the bounds that differ across elements."""
    c = torch.zeros(17)[1:1 + (shape[0] if shape else 1)].view(shape)  # (an address that is not 16-byte aligned)
    out = kernels_cpp.stencil_coefficient(c, (0.0, 0.5), (0.35, 0.75))
    assert out.shape == c.shape and out.dtype == c.dtype and out.data_ptr() % 16 == c.data_ptr() % 16
    expected = 0.5 * torch.linspace(0.35, 0.75, c.numel(), dtype=torch.float64) if c.numel() > 1 else \
        torch.tensor([0.175], dtype=torch.float64)
    torch.testing.assert_close(out.reshape(-1).double(), expected)


def test_the_installed_triton_release_is_read():
    triton = pytest.importorskip("triton")
    release = kernels_cpp.triton_release()
    assert triton.__version__.startswith(release + ".") or triton.__version__ == release


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_new_plan_is_checked_at_coefficients_that_move_the_stencil(table, dtype, monkeypatch):
    """The identity init (coefficients 0) would let a plan that misreads or swaps a coefficient agree with the Python
    path: the check runs at coefficients inside the stable bounds, away from 0 and from each other, with the call's
    metadata (the same plan: the key holds each operand's 16-byte alignment too)."""
    from cta.pde_spec import coefficient_bounds

    x = torch.randn(2, 8, 32)
    storage = torch.zeros(32 + 8, dtype=dtype)
    for pde, causal in (("advection_diffusion", False), ("reaction_diffusion", True)):
        (a_low, a_high), (b_low, b_high) = coefficient_bounds(pde, causal)
        for alpha, beta in ((torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype)),
                            (storage[1:33], storage[2:34])):  # per channel, at addresses off 16 bytes
            key = table.key(x, alpha, beta, None)
            seen = {}

            class Table:  # (a plan's launches are CUDA's: what the check is given is what is checked)
                def key(self, *operands):
                    return table.key(*operands)

                def forward(self, x, alpha, beta, mask):
                    seen.update(alpha=alpha, beta=beta)
                    return None

            assert not kernels_cpp._agrees_with_python(Table(), key, (pde, 2, causal, None), x, alpha, beta, None)
            a, b = seen["alpha"], seen["beta"]
            assert table.key(x, a, b, None) == key
            assert (a > a_low).all() and (a <= a_high).all() and (b.abs() > 0).all() and (b <= b_high).all()
            assert not torch.equal(a, b) and (b >= b_low).all()
            assert (a.numel() == 1) or len(set(a.float().tolist())) > 1  # (per channel: several values)
            assert torch.equal(alpha.float().abs().sum(), torch.tensor(0.0))  # (the call's own: untouched)


def test_a_lock_left_by_an_interrupted_build_is_removed(tmp_path, caplog):
    """torch waits on its build lock without end and without a word: a lock older than any build (an interrupted first
    build) is removed with a warning, a fresh one (another process building) is waited for and left to its owner."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    kernels_cpu.wait_for_build_lock(str(lock), "a kernel")  # (no lock: returns at once)
    lock.touch()
    os.utime(lock, (time.time() - 400, time.time() - 400))
    with caplog.at_level("WARNING", logger=kernels_cpu.__name__):
        kernels_cpu.wait_for_build_lock(str(lock), "a kernel", stale_after=300, poll=0.01)
    assert not lock.exists() and "did not finish" in caplog.text
    lock.touch()  # another process building: it removes its own lock when done
    owner = threading.Timer(0.3, lock.unlink)
    owner.start()
    start = time.perf_counter()
    kernels_cpu.wait_for_build_lock(str(lock), "a kernel", stale_after=300, poll=0.01)
    owner.join()
    assert time.perf_counter() - start >= 0.25 and not lock.exists()


def test_the_launcher_is_built_optimised(monkeypatch):
    """torch's JIT build passes no optimisation flag of its own: unoptimised, a site's call cost 3-10 times its time
    (most inside a model, between its ops: docs/kernels.md)."""
    import torch.utils.cpp_extension

    seen = {}
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *args, **kwargs: seen.update(kwargs) or "built")
    assert kernels_cpp.build() == "built" and "-O2" in seen["extra_cflags"]
