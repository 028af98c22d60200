"""The C++ site launcher's plan lookup (``csrc/site_launch.cpp``), built here as on a user's machine: a call finds a
plan only with the metadata the binaries were specialised on. (Its launches run on CUDA: test_gpu_cpp_launch.py.)"""

import shutil

import pytest
import torch

from cta import kernels_cpp


@pytest.fixture(scope="module")
def table():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the launcher is not built here (the Python path serves)")
    return kernels_cpp.build().PlanTable()


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


def test_a_lock_left_by_an_interrupted_build_is_removed(tmp_path, caplog):
    """torch waits on its build lock without end and without a word: a lock older than any build (an interrupted first
    build) is removed with a warning, a fresh one (another process building) is waited for and left to its owner."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    kernels_cpp._wait_for_the_lock(str(lock))  # (no lock: returns at once)
    lock.touch()
    os.utime(lock, (time.time() - 400, time.time() - 400))
    with caplog.at_level("WARNING", logger=kernels_cpp.__name__):
        kernels_cpp._wait_for_the_lock(str(lock), stale_after=300, poll=0.01)
    assert not lock.exists() and "did not finish" in caplog.text
    lock.touch()  # another process building: it removes its own lock when done
    owner = threading.Timer(0.3, lock.unlink)
    owner.start()
    start = time.perf_counter()
    kernels_cpp._wait_for_the_lock(str(lock), stale_after=300, poll=0.01)
    owner.join()
    assert time.perf_counter() - start >= 0.25 and not lock.exists()


def test_the_launcher_is_built_optimised(monkeypatch):
    """torch's JIT build passes no optimisation flag of its own: unoptimised, a site's call cost 3-10 times its time
    (most inside a model, between its ops: docs/kernels.md)."""
    import torch.utils.cpp_extension

    seen = {}
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *args, **kwargs: seen.update(kwargs) or "built")
    assert kernels_cpp.build() == "built" and "-O2" in seen["extra_cflags"]
