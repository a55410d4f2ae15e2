"""What counts as a figure of a run's raw output, and which numbers a table shows that are none.

A number a table shows is a figure of the raw output (JSON or CSV) when, rounded as the table
shows it, it is a value of the file (seconds may be shown as ms, ms as s, bytes as MB or MiB), a
count or percentile of a stored list, or a ratio: of two figures shown in its row, of one of them
to the same column's figure in another row or to a scalar at the top of the file (the run's
baseline), or of two figures of the record (a JSON object, a CSV row) that a figure shown in
the same cell comes from; a ratio may be shown as `r`, as `r x 100 %`, or with a sign as the change
`(r - 1) x 100 %`. A number shown with a sign may also be the difference of two figures of its
row.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

NUMBER = re.compile(r"(?<![\w.])([+-]?)(\d+(?:\.\d+)?)\s?(x|×|%)?(?![\w.])")
# Display units a stored figure may be shown in: itself, s as ms, ms as s, bytes as MB or MiB.
SCALES = (1.0, 1e3, 1e-3, 1e-6, 2.0**-20)
SHORT_LIST = 16  # a list this short is also its elements; a longer one only its statistics
QUANTILES = (0.5, 0.9, 0.95, 0.99)


@dataclass(frozen=True)
class Shown:
    """One number as a table shows it."""

    value: float
    decimals: int
    suffix: str  # "", "x" or "%"
    signed: bool  # shown with a sign: a change, as in "+3.9%"
    row: int
    column: int
    position: int  # the how-manieth number of its cell

    @property
    def tolerance(self) -> float:
        return 0.5 * 10.0**-self.decimals * (1 + 1e-9) + 1e-12


@dataclass(frozen=True)
class Figure:
    """One figure of a raw file, in one display unit, and the key it is stored under."""

    value: float
    key: str  # its path in its record ("result.goodput_rps"), "gaps_s#q" for a list's statistic
    record: int  # its record's index in `Raw.records`


@dataclass
class Raw:
    """The figures of one or more raw output files."""

    figures: list[Figure] = field(default_factory=list)  # sorted by value after `seal`
    baselines: list[float] = field(default_factory=list)  # the scalars at a file's top
    records: list[list[float]] = field(default_factory=list)  # each record's own scalars

    def add(self, records: Iterable[list[tuple[str, float]]]) -> None:
        for record in records:
            index = len(self.records)
            self.records.append([v for _, v in record if not _.count("#")])
            # a table shows a number's sign apart from it
            self.figures += [Figure(abs(v) * s, key, index) for key, v in record for s in SCALES]

    def seal(self) -> Raw:
        self.figures.sort(key=lambda f: f.value)
        self._values = [f.value for f in self.figures]
        return self

    def near(self, target: float, tolerance: float) -> list[Figure]:
        lo = bisect.bisect_left(self._values, target - tolerance)
        hi = bisect.bisect_right(self._values, target + tolerance)
        return self.figures[lo:hi]


def _quantile(sorted_values: list[float], q: float) -> Iterator[float]:
    """`q` under the usual conventions: linear interpolation, nearest rank, lower, higher."""
    n = len(sorted_values)
    pos = q * (n - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    yield sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
    yield sorted_values[max(0, math.ceil(q * n) - 1)]
    yield sorted_values[lo]
    yield sorted_values[hi]
    yield sorted_values[min(n - 1, int(q * n))]


def _list_figures(key: str, numbers: list[float]) -> Iterator[tuple[str, float]]:
    yield f"{key}#len", float(len(numbers))
    if not numbers:
        return
    ordered = sorted(numbers)
    yield from ((f"{key}#min", ordered[0]), (f"{key}#max", ordered[-1]))
    yield from ((f"{key}#sum", sum(ordered)), (f"{key}#mean", sum(ordered) / len(ordered)))
    for q in QUANTILES:
        yield from ((f"{key}#q{q}", v) for v in _quantile(ordered, q))
    if len(numbers) <= SHORT_LIST:
        yield from ((key, v) for v in ordered)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record(node: dict[str, object], prefix: str = "") -> Iterator[tuple[str, float]]:
    """A dict's figures, its nested dicts' and its lists of numbers' included, by key path."""
    for name, value in node.items():
        key = f"{prefix}{name}"
        if _is_number(value):
            yield key, float(value)  # type: ignore[arg-type]
        elif isinstance(value, dict):
            yield from _record(value, f"{key}.")
        elif isinstance(value, list):
            numbers = [float(v) for v in value if _is_number(v)]
            if len(numbers) == len(value):
                yield from _list_figures(key, numbers)
            else:
                yield f"{key}#len", float(len(value))


def _records(node: object) -> Iterator[list[tuple[str, float]]]:
    """One record per dict in `node`, lists of numbers (a row, in a list of rows) as records."""
    if isinstance(node, dict):
        yield list(_record(node))
        for value in node.values():
            if not isinstance(value, dict):
                yield from _records(value)
    elif isinstance(node, list):
        for value in node:
            if isinstance(value, list) and not any(isinstance(v, (dict, list)) for v in value):
                # a row of a table: its numbers keyed by their place
                yield [(f"#{j}", float(v)) for j, v in enumerate(value) if _is_number(v)]
            else:
                yield from _records(value)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def load_raw(paths: list[Path]) -> Raw:
    """Every figure of `paths` (JSON or CSV), in every display unit."""
    raw = Raw()
    for path in paths:
        if path.suffix == ".csv":
            with path.open(newline="") as f:
                header, *rows = list(csv.reader(f))
            cells = (
                [(name, _number(c)) for name, c in zip(header, row, strict=False)] for row in rows
            )
            raw.add([(name, n) for name, n in row if n is not None] for row in cells)
            continue
        data = json.loads(path.read_text())
        raw.add(_records(data))
        if isinstance(data, dict):
            raw.baselines += [float(v) for v in data.values() if _is_number(v) and v]
    return raw.seal()


def _plain(cell: str) -> str:
    cell = re.sub(r"`[^`]*`", " ", cell)
    cell = re.sub(r"\]\([^)]*\)", "]", cell)
    return cell.replace("−", "-").replace("**", "")


def shown_numbers(rows: list[list[str]], skip: set[int]) -> list[Shown]:
    """The numbers of a table's body rows, label columns `skip` aside."""
    shown = []
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            if c in skip:
                continue
            for i, match in enumerate(NUMBER.finditer(_plain(cell))):
                sign, text, suffix = match.group(1), match.group(2), match.group(3) or ""
                decimals = len(text.split(".")[1]) if "." in text else 0
                unit = suffix.replace("×", "x")
                shown.append(Shown(float(text), decimals, unit, bool(sign), r, c, i))
    return shown


def _matches_ratio(number: Shown, ratio: float) -> bool:
    forms = [ratio]
    if number.suffix == "%":
        forms = [abs(ratio - 1) * 100] if number.signed else [ratio * 100]
    return any(abs(form - number.value) <= number.tolerance for form in forms)


def _candidates(number: Shown, raw: Raw) -> list[Figure]:
    found = raw.near(number.value, number.tolerance)
    if number.suffix == "%":  # a share stored as a fraction
        found += raw.near(number.value / 100, number.tolerance / 100)
    return found


def unmatched(numbers: list[Shown], raw: Raw) -> list[Shown]:
    """The numbers that are no figure of `raw` (see the module's docstring). The numbers at one
    place of one column show one figure: each must be a value of the key most of them match."""
    candidates = {n: _candidates(n, raw) for n in numbers}
    places: dict[tuple[int, int], list[Shown]] = {}
    for number in numbers:
        places.setdefault((number.column, number.position), []).append(number)
    exact: dict[Shown, list[Figure]] = {}
    for place in places.values():
        counts: dict[str, int] = {}
        for number in place:
            for key in {f.key for f in candidates[number]}:
                counts[key] = counts.get(key, 0) + 1
        if not counts:
            continue
        best = max(counts.values())
        keys = {key for key, count in counts.items() if count == best}
        for number in place:
            found = [f for f in candidates[number] if f.key in keys]
            if found:
                exact[number] = found
    rest = [n for n in numbers if n not in exact]
    return [
        n
        for n in rest
        if not any(_matches_ratio(n, r) for r in _ratios(n, exact, raw))
        and not (n.signed and not n.suffix and _is_difference(n, exact))
    ]


def _is_difference(number: Shown, exact: dict[Shown, list[Figure]]) -> bool:
    """Whether a signed number is the difference of two figures shown in its row."""
    values = [f.value for other in exact if other.row == number.row for f in exact[other]]
    return any(abs(abs(a - b) - number.value) <= number.tolerance for a in values for b in values)


def _ratios(number: Shown, exact: dict[Shown, list[Figure]], raw: Raw) -> Iterator[float]:
    """Ratios of two figures shown in `number`'s row, of one of them to the same column's
    figure in another row or to the run's baseline, or of two figures of a record that a figure
    shown in the same cell comes from."""
    row = [other for other in exact if other.row == number.row]
    values = [f.value for other in row for f in exact[other] if f.value]
    yield from (a / b for a in values for b in values if a != b)
    yield from (a / b for a in values for b in raw.baselines)
    cell = [f for other in row if other.column == number.column for f in exact[other]]
    for index in {f.record for f in cell}:
        record = [v for v in raw.records[index] if v]
        yield from (a / b for a in record for b in record if a != b)
    for mine in row:
        for other in exact:
            if other.column == mine.column:  # its own row too: a baseline row shows 1.00
                for a in exact[mine]:
                    for b in exact[other]:
                        if a.value and b.value:
                            yield a.value / b.value
                            yield b.value / a.value
