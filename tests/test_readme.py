"""README.md and docs/*.md numbers come from result files: the tables between BEGIN/END markers equal the files
they name, results/summary.md equals what scripts/summarize_results.py renders from the result JSON, the README
stays a short front page that links the detailed pages, and every relative link resolves."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_equals_what_the_result_files_render():
    summary = _script("summarize_results")
    assert summary.OUTPUT.read_text(encoding="utf-8") == summary.render(), \
        "results/summary.md is out of date: run python scripts/update_readme.py"


def test_readme_and_docs_tables_equal_their_result_files():
    module = _script("update_readme")
    documents = module.documents()
    names = {str(path.relative_to(ROOT)) for path in documents}
    assert {"README.md", "docs/results.md", "docs/kernels.md", "docs/decoding.md"} <= names
    for path in documents:
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(ROOT))
        assert module.BLOCK.search(text), f"{name} has no result blocks"
        assert module.render(text, name) == text, f"{name} is out of date: run python scripts/update_readme.py"
    assert "<!-- BEGIN results/summary.md -->" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_a_short_front_page_linking_the_details():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200, f"README.md has {len(readme.splitlines())} lines (at most 200)"
    links = set(LINK.findall(readme))
    for target in ("docs/results.md", "docs/kernels.md", "docs/decoding.md", "benchmarks/README.md"):
        assert target in links, f"README.md does not link {target}"


def test_relative_links_resolve():
    for path in [ROOT / "README.md", ROOT / "benchmarks" / "README.md"] + sorted((ROOT / "docs").glob("*.md")):
        for target in LINK.findall(path.read_text(encoding="utf-8")):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            assert (path.parent / target.split("#")[0]).exists(), f"{path.relative_to(ROOT)} links {target}, missing"

