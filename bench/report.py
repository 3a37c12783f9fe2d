"""Turn bench/results/*.csv into the README's result tables.

    python bench/report.py            # rewrite the block between the README's bench markers
    python bench/report.py --print    # print the tables instead (what `make bench` shows on a CPU)

For each feature and each device, the latest run (its ``run_id``) becomes one table: a row
per (case, impl), a column per metric, the unit in the header.  Older runs stay in the CSVs.
"""
from __future__ import annotations

import argparse
import csv
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- bench-tables:begin -->", "<!-- bench-tables:end -->"


def load_rows() -> dict[str, list[dict]]:
    out = {}
    for path in sorted(RESULTS.glob("*.csv")):
        with path.open() as f:
            out[path.stem] = list(csv.DictReader(f))
    return out


def latest_runs(rows: list[dict]) -> list[list[dict]]:
    """The rows of the newest run on each device, newest device run first."""
    by_device: dict[str, str] = {}
    for r in rows:
        if r["run_id"] > by_device.get(r["device"], ""):
            by_device[r["device"]] = r["run_id"]
    runs = [[r for r in rows if r["device"] == dev and r["run_id"] == rid] for dev, rid in by_device.items()]
    return sorted(runs, key=lambda run: run[0]["run_id"], reverse=True)


def _fmt(value: str) -> str:
    try:
        v = float(value)
    except ValueError:
        return value
    if v != v:
        return "n/a"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def table(run: list[dict], *, gpu_only: bool = False) -> str:
    head = run[0]
    if gpu_only and head["device"].startswith("CPU"):
        return ""
    columns: OrderedDict[str, None] = OrderedDict()
    cells: OrderedDict[tuple, dict] = OrderedDict()
    for r in run:
        key = (r["case"], r["impl"])
        cells.setdefault(key, {})
        if r["metric"] == "missing":
            cells[key]["note"] = "missing: " + r["unit"]
            columns.setdefault("note", None)
            continue
        col = f"{r['metric']} ({r['unit']})" if r["unit"] else r["metric"]
        columns.setdefault(col, None)
        cells[key][col] = _fmt(r["value"])
    cols = list(columns)
    lines = [f"*{head['device']}, torch {head['torch']}, triton {head['triton']}, "
             f"commit {head['commit']}, {head['date']}*", "",
             "| case | impl | " + " | ".join(cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for (case, impl), vals in cells.items():
        lines.append(f"| {case} | {impl} | " + " | ".join(vals.get(c, "") for c in cols) + " |")
    return "\n".join(lines)


def render(*, gpu_only: bool = False) -> str:
    parts = []
    for feature, rows in load_rows().items():
        tables = [t for t in (table(run, gpu_only=gpu_only) for run in latest_runs(rows)) if t]
        if tables:
            parts.append(f"#### {feature}\n\n" + "\n\n".join(tables))
    return "\n\n".join(parts) if parts else "_No benchmark has been recorded yet._"


def update_readme() -> bool:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md lacks the markers {BEGIN} ... {END}")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    new = before + BEGIN + "\n" + render() + "\n" + END + after
    if new != text:
        README.write_text(new)
        return True
    return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the tables instead of writing the README")
    ap.add_argument("--gpu-only", action="store_true", help="only runs recorded on a GPU")
    args = ap.parse_args(argv)
    if args.print:
        print(render(gpu_only=args.gpu_only))
    else:
        print("README.md " + ("updated" if update_readme() else "unchanged"))


if __name__ == "__main__":
    main()
