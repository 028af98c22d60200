import os
import sys

# Triton kernels run on CPU tensors through Triton's interpreter unless a GPU run asks otherwise. This must be set
# before anything imports triton (the first `import cta` may), hence here.
if os.environ.get("CTA_TEST_GPU", "0") in ("", "0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test helpers (remote_code_env.py) are imported by name.
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture
def decode_plan_calls(monkeypatch):
    """Records every call of a prepared decode step (``cta.pde_cta._DecodePlan``): True where it ran the step,
    False where it declined (the caller then took the general path); ``calls.in_place`` counts the steps that wrote
    the refined token over their input."""
    from cta import pde_cta

    class Calls(list):
        in_place = 0

    calls = Calls()
    plan_call = pde_cta._DecodePlan.__call__

    def recording_call(plan, *args):
        out = plan_call(plan, *args)
        calls.append(out is not None)
        calls.in_place += out is not None and out is args[0]
        return out

    monkeypatch.setattr(pde_cta._DecodePlan, "__call__", recording_call)
    return calls
