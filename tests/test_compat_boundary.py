"""Private names of transformers, accelerate, DeepSpeed and PEFT are used only in ``cta/transformers_compat.py``
(issue 68): every other ``cta/*.py`` is parsed (no import) and may not

- import a private name or from a private module of them (``from transformers.x import _y``,
  ``import peft.tuners._z``);
- call a private method of their class it subclasses (``super()._x``);
- read a private attribute (``._x``, not a dunder; or ``getattr(.., "_x")``) of an expression rooted in a name bound by
  importing them, or by looking one of their modules up (``sys.modules.get("accelerate.state")``,
  ``importlib.import_module``).

Importing cta changes no logger of transformers (no process-wide change at import)."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("transformers", "accelerate", "deepspeed", "peft")
COMPAT = "transformers_compat.py"
# transformers' hooks for model code, which every model in its repository overrides (as `_no_split_modules`,
# `_supports_*`, `_can_record_outputs` are set): a native model may call its base class's.
MODEL_CODE_HOOKS = {"_init_weights"}


def _library(module) -> bool:
    return isinstance(module, str) and module.split(".")[0] in LIBRARIES


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _looked_up_module(node):
    """The module name a ``sys.modules.get("m")`` / ``sys.modules["m"]`` / ``importlib.import_module("m")`` /
    ``__import__("m")`` expression names, or None."""
    if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("sys.modules"):
        key = node.slice
    elif isinstance(node, ast.Call) and node.args and ast.unparse(node.func).split(".")[-1] in (
            "get", "import_module", "__import__") and (
            ast.unparse(node.func) in ("__import__", "import_module") or "modules" in ast.unparse(node.func)
            or "importlib" in ast.unparse(node.func)):
        key = node.args[0]
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _of_library(node, bound) -> bool:
    """Whether ``node`` (``a.b(c)[d].e``) starts at a name in ``bound`` or at a lookup of one of the libraries."""
    while True:
        if _library(_looked_up_module(node)):
            return True
        if not isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
            return isinstance(node, ast.Name) and node.id in bound
        node = node.func if isinstance(node, ast.Call) else node.value


def violations(source: str, filename: str = "<source>") -> list:
    """``["file:line: what"]`` for each private use of the libraries in ``source``."""
    tree = ast.parse(source, filename)
    bound, found = set(), []

    def report(node, what):
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):  # (names bound anywhere in the file: imports inside functions count)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _library(alias.name):
                    bound.add(alias.asname or alias.name.split(".")[0])
                    if any(_private(part) for part in alias.name.split(".")):
                        report(node, f"import {alias.name} (a private module)")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _library(node.module):
            if any(_private(part) for part in node.module.split(".")):
                report(node, f"from {node.module} import ... (a private module)")
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if _private(alias.name):
                    report(node, f"from {node.module} import {alias.name}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and _library(
                _looked_up_module(node.value)):
            module = _looked_up_module(node.value)
            if any(_private(part) for part in module.split(".")):
                report(node, f"looks up {module} (a private module)")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound.update(target.id for target in targets if isinstance(target, ast.Name))
    for node in ast.walk(tree):  # a private method of a library base class, called through super()
        if isinstance(node, ast.ClassDef) and any(_root(base) in bound for base in node.bases):
            for call in ast.walk(node):
                if isinstance(call, ast.Attribute) and _private(call.attr) and call.attr not in MODEL_CODE_HOOKS \
                        and isinstance(call.value, ast.Call) \
                        and isinstance(call.value.func, ast.Name) and call.value.func.id == "super":
                    report(call, f"{ast.unparse(call)} (of a {', '.join(map(ast.unparse, node.bases))} subclass)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _of_library(node.value, bound):
            report(node, f"{ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2 and isinstance(
                node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and _private(
                node.args[1].value) and _of_library(node.args[0], bound):
            report(node, f"{ast.unparse(node)}")
        elif isinstance(node, (ast.Call, ast.Subscript)) and _library(_looked_up_module(node)) and any(
                _private(part) for part in _looked_up_module(node).split(".")):
            report(node, f"looks up {_looked_up_module(node)} (a private module)")
    return sorted(set(found), key=lambda line: int(line.split(":")[1]))


def test_no_private_library_name_outside_the_compat_module():
    found = []
    for path in sorted((ROOT / "cta").glob("*.py")):
        if path.name != COMPAT:
            found += violations(path.read_text(encoding="utf-8"), f"cta/{path.name}")
    assert not found, ("private names of transformers / accelerate / deepspeed / peft outside cta/" + COMPAT +
                       " (move each behind a function there, with the releases it was checked on):\n" +
                       "\n".join(found))


@pytest.mark.parametrize("source", [
    "from transformers.utils import _is_package_available",
    "from transformers.utils.import_utils import _torch_version as v",
    "from peft.tuners._buffer_dict import BufferDict",
    "import transformers.models._private",
    "import transformers\nx = transformers.utils._foo",
    "import transformers as hf\nx = hf.modeling_utils._init_weights(1)",
    "def f():\n    from deepspeed.utils import groups\n    return groups._get_sequence_parallel_group()",
    "import sys\nstate = sys.modules.get('accelerate.state')\nx = state.AcceleratorState._shared_state.get('a')",
    "import sys\nx = sys.modules['accelerate.state'].AcceleratorState._shared_state",
    "from accelerate.state import AcceleratorState\nx = AcceleratorState()._shared_state",
    "from transformers import PreTrainedModel\nx = getattr(PreTrainedModel, '_hidden')",
    "import importlib\nm = importlib.import_module('peft.utils.constants')\nx = m._private",
    "from peft import LoraModel\nclass M(LoraModel):\n    def _hook(self):\n        return super()._hook()",
])
def test_the_check_catches(source):
    assert violations(source), source


@pytest.mark.parametrize("source", [
    "from transformers import PretrainedConfig\nfrom transformers.cache_utils import DynamicCache",
    "import transformers\nx = transformers.PreTrainedModel.__init__",
    "import torch\nx = torch._dynamo.config",
    "x = self._private\ny = getattr(self, '_cta_state', None)",
    "from . import transformers_compat\nx = transformers_compat._bound_module",
])
def test_the_check_passes(source):
    assert not violations(source), violations(source)


def test_importing_cta_adds_no_filter_to_transformers_loggers():
    code = textwrap.dedent("""
        import logging
        import transformers
        names = ["transformers", "transformers.modeling_utils"]
        before = {name: list(logging.getLogger(name).filters) for name in names}
        import cta, cta.transformers_compat
        after = {name: list(logging.getLogger(name).filters) for name in names}
        assert before == after, (before, after)
        """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
