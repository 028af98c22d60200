"""Runs a script in an environment where `cta` is NOT importable: only torch + transformers (and their deps).

A fresh `python -m venv --without-pip` gets the system site-packages directory as a plain path through a `.pth`
file. `.pth` files *inside* that directory are then not processed, so the editable install of `cta` (a .pth hook)
is invisible, and the script runs with a cwd outside the repository.
"""

import os
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

_ENV_DIR = None


def clean_python() -> str:
    """Path of the python executable of the (cached, per test session) clean environment."""
    global _ENV_DIR
    if _ENV_DIR is None:
        root = Path(tempfile.mkdtemp(prefix="cta-clean-env-"))
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        purelib = Path(subprocess.check_output(
            [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip())
        system_dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
        (purelib / "system_packages.pth").write_text("\n".join(sorted(system_dirs)) + "\n")
        _ENV_DIR = root
    return str(_ENV_DIR / "bin" / "python")


def run_in_clean_env(script: str, timeout: int = 600) -> str:
    """Runs `script` with the clean interpreter; returns stdout, raises RuntimeError with the output on failure.

    The script starts with an assertion that `cta` cannot be imported.
    """
    guard = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('cta') is None, 'cta must not be importable in the clean environment'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run(
            [clean_python(), "-c", guard + script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    if result.returncode != 0:
        raise RuntimeError(f"clean-env script failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout
