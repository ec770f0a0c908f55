"""The README's zoo table is the one docs/zoo.json gives (``python benchmarks/zoo.py --readme``
writes it): it cannot drift from the recorded sweep."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.zoo_engine import COLUMNS, README_BEGIN, README_END, readme_table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_zoo_table_matches_the_recorded_sweep():
    doc = json.loads((ROOT / "docs" / "zoo.json").read_text())
    text = (ROOT / "README.md").read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    assert text[start:end] == readme_table(doc["results"], doc["plans"], COLUMNS), (
        "README.md's zoo table differs from docs/zoo.json: run `python benchmarks/zoo.py --readme`")


def test_no_recorded_pair_is_silently_wrong_or_failed():
    doc = json.loads((ROOT / "docs" / "zoo.json").read_text())
    bad = [(t, p, o["outcome"]) for t, row in doc["results"].items() for p, o in row.items()
           if o["outcome"] in ("silently wrong", "failed")]
    assert not bad, bad
