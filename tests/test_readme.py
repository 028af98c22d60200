"""README.md numbers come from result files: the tables between BEGIN/END markers equal the files they name."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_equal_their_result_files():
    spec = importlib.util.spec_from_file_location("update_readme", ROOT / "scripts" / "update_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert module.BLOCK.search(readme), "README.md has no result blocks"
    assert module.render(readme) == readme, "README.md is out of date: run python scripts/update_readme.py"
