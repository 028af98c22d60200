"""README.md and docs/*.md numbers come from result files: the tables between BEGIN/END markers equal the files
they name, results/summary.md equals what scripts/summarize_results.py renders from the result JSON, the README
stays a short front page that links the detailed pages, every relative link resolves, and every script and flag
the docs name exists."""

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



COMMAND = re.compile(r"(?:python3?|torchrun[^`\n]*?|accelerate launch[^`\n]*?)\s+"
                     r"((?:benchmarks|examples|scripts)/[\w/]+\.py)([^`\n]*)")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")


def _code(text):
    """The code spans and fenced blocks of a markdown text."""
    blocks = re.findall(r"```.*?```", text, re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`[^`\n]+`", rest)


def _sources(script):
    """The script's source and those of the repository modules it imports (examples/common.py and the like), and, for
    HfArgumentParser scripts, transformers' TrainingArguments (read as text: nothing is imported)."""
    texts = [script.read_text(encoding="utf-8")]
    for name in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", texts[0], re.M):
        local = script.parent / f"{name.split('.')[0]}.py"
        if local.exists() and local != script:
            texts.append(local.read_text(encoding="utf-8"))
    if "TrainingArguments" in "".join(texts):
        spec = importlib.util.find_spec("transformers")
        texts.append((Path(spec.origin).parent / "training_args.py").read_text(encoding="utf-8"))
    return "\n".join(texts)


def test_every_script_and_flag_the_docs_name_exists():
    """Each ``python <benchmarks|examples|scripts>/x.py ... --flag`` in a code span or block of README.md,
    benchmarks/README.md, examples/README.md and docs/*.md names a script that exists and flags it defines (an
    argparse ``--flag`` string, or a dataclass field ``flag`` an HfArgumentParser reads)."""
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "examples" / "README.md"]
    missing = []
    for page in pages + sorted((ROOT / "docs").glob("*.md")):
        for code in _code(page.read_text(encoding="utf-8")):
            for path, arguments in COMMAND.findall(code):
                script = ROOT / path
                where = f"{page.relative_to(ROOT)}: {path}"
                if not script.exists():
                    missing.append(f"{where} (no such script)")
                    continue
                source = _sources(script)
                arguments = re.split(r"[;&|]", re.sub(r"'[^']*'|\"[^\"]*\"", "", arguments))[0]  # (its own)
                for flag in FLAG.findall(arguments):
                    if f"--{flag}" not in source and not re.search(rf"\b{flag.replace('-', '_')}\s*:", source):
                        missing.append(f"{where} --{flag}")
        for row in re.findall(r"^\|\s*`([\w/]+\.py)`\s*\|(.*)$", page.read_text(encoding="utf-8"), re.M):
            # a table row naming a script first: the flags of the row's code spans are that script's
            script = next((folder / row[0] for folder in (page.parent, ROOT / "benchmarks", ROOT / "examples",
                                                          ROOT / "scripts") if (folder / row[0]).exists()), None)
            if script is None:
                missing.append(f"{page.relative_to(ROOT)}: {row[0]} (no such script)")
                continue
            source = _sources(script)
            for span in re.findall(r"`([^`]+)`", row[1]):
                if COMMAND.search(span):
                    continue  # (a whole command, checked above)
                for flag in FLAG.findall(span):
                    if f"--{flag}" not in source and not re.search(rf"\b{flag.replace('-', '_')}\s*:", source):
                        missing.append(f"{page.relative_to(ROOT)}: {row[0]} --{flag}")
    assert not missing, "the docs name scripts or flags that do not exist:\n" + "\n".join(sorted(set(missing)))
