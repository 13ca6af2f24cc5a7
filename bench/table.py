"""The benchmark's result rows: targets, PASS/MISS, the Markdown table the README and docs/benchmarks.md show, the JSON file."""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

PASS, MISS, NOT_RUN, DIAGNOSTIC, FAILED = "PASS", "MISS", "not run", "diagnostic", "error"


@dataclass(frozen=True)
class Target:
    """`ratio op bound`, e.g. Target(">=", 3.0) for "at least 3x the baseline"; `stretch` a second, harder bound
    of the same direction, reported but not required."""

    op: str  # ">=" or "<="
    bound: float
    stretch: float | None = None

    def met(self, ratio: float, bound: float | None = None) -> bool:
        b = self.bound if bound is None else bound
        return ratio >= b if self.op == ">=" else ratio <= b

    def text(self) -> str:
        sign = "≥" if self.op == ">=" else "≤"
        out = f"{sign} {_num(self.bound)}×"
        return out + (f" (stretch {_num(self.stretch)}×)" if self.stretch is not None else "")


@dataclass(frozen=True)
class Row:
    """One line of the table. `measured` and `baseline` are the absolute figures behind `ratio`
    (= measured / baseline, in the unit both share); `result` is PASS/MISS against `target`, "not run" when the
    row or its baseline could not be measured, "diagnostic" for rows that have no target."""

    key: str  # the row group (`--only`)
    name: str
    measured: str
    baseline: str
    ratio: float | None
    target: str
    result: str
    note: str = ""


def judged(
    key: str, name: str, measured: str, baseline: str, ratio: float | None, target: Target, note: str = ""
) -> Row:
    """A row checked against `target`; a ratio that could not be measured is "not run", never a PASS."""
    if ratio is None or not math.isfinite(ratio):
        return Row(key, name, measured, baseline, None, target.text(), NOT_RUN, note)
    result = PASS if target.met(ratio) else MISS
    if result == PASS and target.stretch is not None:
        note = "; ".join(
            x for x in (note, f"stretch {'met' if target.met(ratio, target.stretch) else 'missed'}") if x
        )
    return Row(key, name, measured, baseline, ratio, target.text(), result, note)


def not_run(key: str, name: str, target: Target | None, why: str, measured: str = "—") -> Row:
    return Row(key, name, measured, "—", None, target.text() if target else "", NOT_RUN, why)


def count_row(key: str, name: str, count: int | None, baseline: str, note: str = "") -> Row:
    """A count whose target is zero (e.g. compiles after warm-up): no ratio."""
    if count is None:
        return Row(key, name, "—", baseline, None, "0", NOT_RUN, note)
    return Row(key, name, str(count), baseline, None, "0", PASS if count == 0 else MISS, note)


def _num(x: float) -> str:
    return f"{x:g}" if abs(x) >= 0.1 else f"{x:.3f}"


def fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "—"
    return f"{ratio:.2f}×" if ratio < 10 else f"{ratio:.1f}×"


HEAD = ("benchmark", "measured", "baseline (same run)", "ratio", "target", "result")


def markdown(rows: list[Row]) -> str:
    """The table, one line per Row, then the rows' notes as numbered footnotes (a row's name ends in its [n]).
    Cells are padded so the plain text lines up; `|` inside a cell is escaped."""
    notes: list[str] = []
    body = []
    for r in rows:
        name = r.name
        if r.note:
            notes.append(r.note)
            name += f" [{len(notes)}]"
        body.append((name, r.measured, r.baseline, fmt_ratio(r.ratio), r.target, r.result))
    body = [tuple(c.replace("|", "\\|") for c in cells) for cells in body]
    widths = [max(len(x[i]) for x in [HEAD, *body]) for i in range(len(HEAD))]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    out = [line(HEAD), sep, *(line(c) for c in body)]
    if notes:
        out += [""] + [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(out)


def write_json(path: str | pathlib.Path, rows: list[Row], meta: dict[str, Any], raw: dict[str, Any]) -> None:
    """rows (as in the table, ratio as a number), the run's settings (`meta`) and every sample behind the medians
    (`raw`)."""
    doc = {"meta": meta, "rows": [asdict(r) for r in rows], "raw": raw}
    pathlib.Path(path).write_text(json.dumps(doc, indent=2, default=_plain) + "\n")


def _plain(x: Any) -> Any:
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")
