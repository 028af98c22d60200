import os
import sys

# Triton kernels run on CPU tensors through Triton's interpreter unless a GPU run asks otherwise. This must be set
# before anything imports triton (the first `import cta` may), hence here.
if os.environ.get("CTA_TEST_GPU", "0") in ("", "0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test helpers (remote_code_env.py) are imported by name.
sys.path.insert(0, os.path.dirname(__file__))
