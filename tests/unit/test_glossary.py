"""The glossary of docs/architecture.md, applied: retired words stay retired where they would mislead.

One word for one thing.  A pipeline *stage* is torch's (a chunk as it runs); the ranks along the
``pp`` axis are *pp ranks*; a ZeRO stage is always "ZeRO stage N" or "ZeRO-N"; ``SP`` is the
sequence-parallel symbol, so sympy is never imported as ``sp``; a count of micro-batches is
``num_microbatches`` (``n_microbatches`` only as the keyword of torch's schedules); the program
``torch.compile`` makes is the *Inductor* program, never "the compiled program" (autopar's
``CompiledProgram``).  The scan covers the product code and the docs (not
docs/reference-errata.md, which quotes the reference's own words).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RETIRED = {
    "sympy as sp": (r"^\s*import sympy as sp\b", "import sympy: SP is the sequence-parallel symbol"),
    "stage for a pp rank": (r"\b(first|last|middle|scored|slowest|fullest) stages?\b|\bper-stage\b",
                            "a pp rank (a stage is torch's chunk as it runs)"),
    "bare ZeRO stage": (r"(?<!ZeRO )(?<!ZeRO-)\b[Ss]tages? [0-3](?:[-–][0-3])?\b", "ZeRO stage N, or ZeRO-N"),
    "n_microbatches": (r"\bn_microbatches\b(?!=)", "num_microbatches (n_microbatches= is torch's keyword)"),
    "compiled program for Inductor's": (r"compiled program", "the Inductor program"),
}
# Where each retired word is looked for: product code and docs, or only the modules about Inductor.
SCOPE = {"compiled program for Inductor's": ("autopar/runtime/stepping/inductor.py",
                                             "autopar/runtime/stepping/pipelined.py")}


def _files() -> list[Path]:
    out = [p for folder in ("autopar", "passes", "cost") for p in sorted((ROOT / folder).rglob("*.py"))]
    out += [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "reference-errata.md"]
    return out + [ROOT / "README.md"]


def _hits(word: str, files) -> list[str]:
    pattern = re.compile(RETIRED[word][0], re.MULTILINE)
    out = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                out.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return out


@pytest.mark.parametrize("word", list(RETIRED))
def test_retired_words_stay_retired(word):
    files = [ROOT / f for f in SCOPE[word]] if word in SCOPE else _files()
    hits = _hits(word, files)
    assert not hits, f"retired word ({word}); write {RETIRED[word][1]}:\n" + "\n".join(hits)


def test_the_scan_finds_what_it_retires(tmp_path):
    """Each pattern catches the word it retires and leaves the glossary's own words alone."""
    samples = {"sympy as sp": ("import sympy as sp", "import sympy"),
               "stage for a pp rank": ("the last stage holds the head", "the last pp rank holds the head"),
               "bare ZeRO stage": ("Stages 0-2 call once per bucket", "ZeRO stages 0-2 call once per bucket"),
               "n_microbatches": ("n_microbatches = plan.mb", "Schedule1F1B(stage, n_microbatches=4)"),
               "compiled program for Inductor's": ("its compiled program", "the Inductor program")}
    assert set(samples) == set(RETIRED)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        for word, (bad, good) in samples.items():
            path = tmp_path / "sample.py"
            path.write_text(bad + "\n" + good + "\n")
            assert [h.split(": ", 1)[1] for h in _hits(word, [path])] == [bad], word
    finally:
        ROOT = saved
