"""`make help` says how long each target takes on the CI machine class (2 cores, no GPU): the figures
must stay true.  parity/make_durations.json holds the wall times measured for them by
parity/make_durations.py (which re-measures and rewrites it); a figure more than 2x away from its
measurement, or a measured target without a figure, fails here.  `make parity` and `make roofline`
are not in the table (their figures are kept by hand)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"^\s+make (?P<target>[\w-]+)\s.*~(?P<value>\d+(?:\.\d+)?) ?(?P<unit>min|s)\s*$")


def stated_durations(help_text: str) -> dict[str, float]:
    """{target: seconds} from the figures ("~6 min", "~5 s") at the end of `make help`'s lines."""
    out = {}
    for line in help_text.splitlines():
        m = FIGURE.match(line)
        if m:
            out[m["target"]] = float(m["value"]) * (60 if m["unit"] == "min" else 1)
    return out


def test_figures_are_parsed():
    text = "  make install        deps (keeps torch)   ~2 min\n  make report   tables   ~5 s\n  make x   no figure\n"
    assert stated_durations(text) == {"install": 120.0, "report": 5.0}


def test_make_help_durations_match_the_measurements():
    help_text = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout
    stated = stated_durations(help_text)
    measured = json.loads((ROOT / "parity" / "make_durations.json").read_text())
    assert measured, "parity/make_durations.json is empty: run python parity/make_durations.py"
    wrong = []
    for target, record in measured.items():
        seconds = record["seconds"]
        if target not in stated:
            wrong.append(f"make {target}: measured {seconds:.0f} s, but `make help` gives no figure")
        elif not 0.5 <= stated[target] / seconds <= 2.0:
            wrong.append(f"make {target}: `make help` says ~{stated[target]:.0f} s, measured {seconds:.0f} s "
                         f"on {record['date']} ({record['machine']})")
    assert not wrong, "\n".join(wrong) + "\n(fix the figure in the Makefile's help, or re-measure with " \
                                         "python parity/make_durations.py TARGET)"
