"""Copies generated result tables into README.md and docs/*.md, so that no number there is typed by hand.

Each document marks a table with a pair of comments naming a file (relative to the repository root) written by a
script in this repo:

    <!-- BEGIN results/table1.md -->
    ...replaced by the file's contents...
    <!-- END results/table1.md -->

It first regenerates results/summary.md (scripts/summarize_results.py), the README's summary table.

Usage: python scripts/update_readme.py [--check]   (--check exits 1 when any document, or results/summary.md, is
out of date, and writes nothing)
"""

import argparse
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- BEGIN (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- END (?P=path) -->)", re.S)


def documents():
    """The files whose blocks are rendered: README.md, then every docs/*.md."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def summarizer():
    spec = importlib.util.spec_from_file_location("summarize_results", ROOT / "scripts" / "summarize_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render(text: str, name: str = "README.md") -> str:
    def replace(match):
        source = ROOT / match.group("path")
        if not source.exists():
            raise SystemExit(f"{name} refers to {match.group('path')}, which does not exist.")
        body = source.read_text(encoding="utf-8").strip() + "\n"
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(replace, text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that every document is up to date")
    args = parser.parse_args()
    summary = summarizer()
    stale = []
    if args.check:
        current = summary.OUTPUT.read_text(encoding="utf-8") if summary.OUTPUT.exists() else ""
        if current != summary.render():
            stale.append(str(summary.OUTPUT.relative_to(ROOT)))
    else:
        summary.OUTPUT.write_text(summary.render(), encoding="utf-8")
    for path in documents():
        name = str(path.relative_to(ROOT))
        current = path.read_text(encoding="utf-8")
        updated = render(current, name)
        if args.check:
            if updated != current:
                stale.append(name)
            continue
        path.write_text(updated, encoding="utf-8")
        print(f"updated {len(BLOCK.findall(current))} block(s) in {name}")
    if args.check:
        if stale:
            print(f"out of date: {', '.join(stale)}: run python scripts/update_readme.py")
            sys.exit(1)
        print("README.md, docs/*.md and results/summary.md are up to date")


if __name__ == "__main__":
    main()
