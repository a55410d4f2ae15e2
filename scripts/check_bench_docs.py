"""Checks that the benchmark pages state only what their runs printed, and that their links resolve.

    python scripts/check_bench_docs.py [--root DIR]

The pages are `docs/benchmarks.md` (the index) and `docs/benchmarks/*.md` (one per topic). Two
kinds of table are checked against the raw output kept in `docs/results/`:

* A page's **headline table** is the table right after a line
  `<!-- figures: FILE [FILE ...] [| skip: COLUMN; COLUMN] -->`, the files relative to the page.
  Every number in its body (code spans and link targets aside, skipped label columns aside) must
  be a figure of those files as `bench_figures` defines it: a stored value in some display unit,
  a count or percentile of a stored list, or a ratio of figures of the same run.
* The **index** is the table after `<!-- index -->`: in each row, the numbers of the `headline`
  column must be figures (as above, the row being the table) of the raw files the row links.

Every relative link in README.md and docs/ (files and `#anchors` of Markdown headings) must
resolve, every page under docs/benchmarks/ must be linked from the index, and every file under
docs/results/ from some page. Exits 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench_figures import load_raw, shown_numbers, unmatched

MARKER = re.compile(
    r"^<!--\s*figures:\s*(?P<files>[^|]*?)\s*(?:\|\s*skip:\s*(?P<skip>.*?))?\s*-->$"
)
INDEX_MARKER = "<!-- index -->"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


@dataclass(frozen=True)
class Table:
    """A Markdown table found after a marker line."""

    line: int  # 1-based, the header's
    header: list[str]
    rows: list[list[str]]


def table_after(lines: list[str], start: int) -> Table | None:
    i = start
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i + 1 >= len(lines) or not lines[i].lstrip().startswith("|"):
        return None
    body = []
    j = i + 2
    while j < len(lines) and lines[j].lstrip().startswith("|"):
        body.append(_cells(lines[j]))
        j += 1
    return Table(i + 1, _cells(lines[i]), body)


def check_page(page: Path, root: Path) -> list[str]:
    """Problems with the headline tables (and the index table) of one page."""
    problems = []
    lines = page.read_text().splitlines()
    name = page.relative_to(root)
    for i, line in enumerate(lines):
        marker = MARKER.match(line.strip())
        if not marker and line.strip() != INDEX_MARKER:
            continue
        table = table_after(lines, i + 1)
        if table is None:
            problems.append(f"{name}:{i + 1}: a marker with no table after it")
            continue
        if marker:
            problems += _check_headline(
                page, name, table, marker.group("files"), marker.group("skip")
            )
        else:
            problems += _check_index(page, name, table)
    return problems


def _check_headline(
    page: Path, name: Path, table: Table, files: str, skip: str | None
) -> list[str]:
    paths = [page.parent / f for f in files.split()]
    absent = [str(p) for p in paths if not p.is_file()]
    if absent or not paths:
        return [f"{name}:{table.line}: raw output not found: {', '.join(absent) or '(none named)'}"]
    skipped = {c.strip() for c in (skip or "").split(";") if c.strip()}
    unknown = skipped - set(table.header)
    if unknown:
        return [f"{name}:{table.line}: no column named {', '.join(sorted(unknown))}"]
    columns = {i for i, h in enumerate(table.header) if h in skipped}
    raw = load_raw(paths)
    return [
        f"{name}:{table.line + 2 + n.row}: {n.value:g}{n.suffix} ({table.header[n.column]}) "
        f"is not in {files.strip()}"
        for n in unmatched(shown_numbers(table.rows, columns), raw)
    ]


def _check_index(page: Path, name: Path, table: Table) -> list[str]:
    problems = []
    if "headline" not in table.header:
        return [f"{name}:{table.line}: the index has no `headline` column"]
    column = table.header.index("headline")
    for r, row in enumerate(table.rows):
        line = table.line + 2 + r
        links = [m.group(1).split("#")[0] for m in LINK.finditer(" ".join(row))]
        raw_files = [page.parent / t for t in links if t.endswith((".json", ".csv"))]
        if not raw_files:
            problems.append(f"{name}:{line}: a row with no raw output linked")
            continue
        if not all(p.is_file() for p in raw_files):
            continue  # reported as a broken link
        skip = {c for c in range(len(row)) if c != column}
        missing = unmatched(shown_numbers([row], skip), load_raw(raw_files))
        problems += [
            f"{name}:{line}: {n.value:g}{n.suffix} is not in its raw output" for n in missing
        ]
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            base = slug(line.lstrip("#"))
            name, n = base, 1
            while name in found:
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def link_targets(page: Path) -> Iterator[tuple[int, str]]:
    in_code = False
    for i, line in enumerate(page.read_text().splitlines()):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            yield i + 1, match.group(1)


def check_links(pages: list[Path], root: Path) -> tuple[list[str], set[Path]]:
    """Broken relative links of `pages`, and the files they link."""
    problems, linked = [], set()
    for page in pages:
        for line, target in link_targets(page):
            if re.match(r"^[a-z]+:", target):
                continue
            path_text, _, anchor = target.partition("#")
            path = (page.parent / path_text).resolve() if path_text else page.resolve()
            where = f"{page.relative_to(root)}:{line}"
            if not path.exists():
                problems.append(f"{where}: broken link {target}")
                continue
            linked.add(path)
            if anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{where}: no heading #{anchor} in {path_text or page.name}")
    return problems, linked


def check(root: Path) -> list[str]:
    """Every problem with the benchmark pages under `root` (a checkout), one line each."""
    docs = root / "docs"
    index = docs / "benchmarks.md"
    topics = sorted((docs / "benchmarks").glob("*.md"))
    pages = [root / "README.md", *sorted(docs.glob("*.md")), *topics]
    problems, _ = check_links([p for p in pages if p.is_file()], root)
    for page in [index, *topics]:
        problems += check_page(page, root)
    _, from_index = check_links([index], root)
    problems += [
        f"{p.relative_to(root)}: not linked from the index"
        for p in topics
        if p.resolve() not in from_index
    ]
    _, from_pages = check_links([index, *topics], root)
    results = sorted(p for p in (docs / "results").rglob("*") if p.is_file())
    problems += [
        f"{p.relative_to(root)}: no benchmark page links it"
        for p in results
        if p.resolve() not in from_pages
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    problems = check(args.root.resolve())
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
