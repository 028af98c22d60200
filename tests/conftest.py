import os
import sys

# Test helpers (remote_code_env.py) are imported by name.
sys.path.insert(0, os.path.dirname(__file__))
