"""Copies generated result tables into README.md, so that no number there is typed by hand.

README.md marks each table with a pair of comments naming a file written by a script in this repo:

    <!-- BEGIN results/table1.md -->
    ...replaced by the file's contents...
    <!-- END results/table1.md -->

Usage: python scripts/update_readme.py [--check]   (--check exits 1 when README.md is out of date)
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- BEGIN (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- END (?P=path) -->)", re.S)


def render(readme: str) -> str:
    def replace(match):
        source = ROOT / match.group("path")
        if not source.exists():
            raise SystemExit(f"README.md refers to {match.group('path')}, which does not exist.")
        body = source.read_text(encoding="utf-8").strip() + "\n"
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(replace, readme)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that README.md is up to date")
    args = parser.parse_args()
    path = ROOT / "README.md"
    current = path.read_text(encoding="utf-8")
    updated = render(current)
    if args.check:
        if updated != current:
            print("README.md is out of date: run python scripts/update_readme.py")
            sys.exit(1)
        print("README.md is up to date")
        return
    path.write_text(updated, encoding="utf-8")
    print(f"updated {len(BLOCK.findall(current))} block(s) in README.md")


if __name__ == "__main__":
    main()
