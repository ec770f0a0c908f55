"""The zoo sweep: every causal LM that transformers knows, under each plan, against one process.

``python benchmarks/zoo.py [--types llama,gpt2] [--plans "dp=2,zero=3;tp=2,sp"] [--json PATH]
[--markdown PATH] [--jobs-timeout 120]`` takes every model type of
``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, builds it from
transformers' default config shrunk the way ``autopar verify`` shrinks one, trains it 3 fp32
steps under each plan on 2 gloo ranks and on one process, and sorts each (model type, plan)
into one class: ``equal``, ``refused`` (``refused (trace)``), ``failed``, ``silently wrong``,
``no-build``.  The engine (the shrinking, the batches, the ranks, the reference, the classes)
is ``benchmarks/zoo_engine.py`` (:func:`~benchmarks.zoo_engine.run_types`, each model type on a
fresh gloo world of 2 local processes); this script runs it over every type and writes the tables.

The CI subset is tests/e2e/test_zoo.py (it calls the same ``run_types``); the recorded sweep is
docs/zoo.md.  Other measurements live beside this file in benchmarks/.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from autopar.verification import sources  # noqa: E402
from autopar.verification.compare import LOSS_ATOL, PARAM_ATOL  # noqa: E402
from benchmarks.zoo_engine import (BATCH, CLASSES, COLUMNS, JOB_TIMEOUT_S, PLANS, README_BEGIN,  # noqa: E402
                                    README_END, SEQ, STEPS, WORLD, cell, model_types, readme_table, run_types)

__all__ = ["markdown_table", "summary", "write_readme", "main"]


def _traces(row: dict) -> bool:
    return any(o["outcome"] not in ("no-build", "refused (trace)") for o in row.values())


def summary(results: dict, plans: list[str]) -> list[str]:
    """One line per plan: counts per class and the share of equal among the types that trace."""
    tracing = [t for t, row in results.items() if _traces(row)]
    lines = [f"{len(results)} model types, {len(tracing)} trace (build and pass torch.export under some plan)"]
    for plan in plans:
        counts = {c: sum(1 for row in results.values() if row[plan]["outcome"] == c) for c in CLASSES}
        equal = sum(1 for t in tracing if results[t][plan]["outcome"] == "equal")
        share = f"{100 * equal / len(tracing):.0f}%" if tracing else "n/a"
        lines.append(f"{plan}: " + ", ".join(f"{c} {n}" for c, n in counts.items() if n) +
                     f"; equal {equal}/{len(tracing)} = {share} of the types that trace")
    wrong = [(t, p) for t, row in results.items() for p, o in row.items() if o["outcome"] == "silently wrong"]
    lines.append("silently wrong: " + (", ".join(f"{t} under {p}" for t, p in wrong) if wrong else "none"))
    return lines


def markdown_table(results: dict, plans: list[str]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    head = "| model type | " + " | ".join(COLUMNS.get(p, p) for p in plans) + " |"
    rows = [head, "|" + "---|" * (len(plans) + 1)]
    for model_type, row in sorted(results.items()):
        rows.append(f"| {model_type} | " + " | ".join(esc(cell(row[p])) for p in plans) + " |")
    return "\n".join(rows)


def _text_table(results: dict, plans: list[str]) -> str:
    width = max([10] + [len(t) for t in results])
    lines = [f"{'model type':<{width}}  " + "  ".join(f"{COLUMNS.get(p, p):<40}" for p in plans)]
    for model_type, row in sorted(results.items()):
        lines.append(f"{model_type:<{width}}  " + "  ".join(f"{cell(row[p], 32):<40}" for p in plans))
    return "\n".join(lines)


def write_readme(json_path: Path, readme: Path) -> None:
    """Replace the README's zoo table (between its markers) with the one ``json_path`` gives."""
    doc = json.loads(json_path.read_text())
    text = readme.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + readme_table(doc["results"], doc["plans"], COLUMNS) + text[end:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", help="comma-separated model types (default: every causal LM type)")
    ap.add_argument("--plans", help=f"semicolon-separated plans (default: {';'.join(PLANS)})")
    ap.add_argument("--optimizer", default="sgd", choices=sorted(sources.OPTIMIZERS))
    ap.add_argument("--json", help="write every outcome (with tracebacks) here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--jobs-timeout", type=float, default=JOB_TIMEOUT_S, help="seconds per plan before a hang is "
                    "declared (default %(default)s)")
    ap.add_argument("--readme", action="store_true", help="only rewrite README.md's zoo table from docs/zoo.json")
    args = ap.parse_args(argv)
    if args.readme:
        write_readme(REPO / "docs" / "zoo.json", REPO / "README.md")
        return 0
    torch.set_num_threads(1)
    types = [t.strip() for t in args.types.split(",") if t.strip()] if args.types else model_types()
    plans = [p.strip() for p in args.plans.split(";") if p.strip()] if args.plans else list(PLANS)
    results: dict = {}
    json_path = args.json

    start = time.perf_counter()
    for model_type in types:  # one type at a time; the JSON is rewritten after each, so a long sweep can stop
        results.update(run_types([model_type], plans, optimizer=args.optimizer, job_timeout=args.jobs_timeout,
                                 progress=lambda line: print(f"[{len(results) + 1}/{len(types)}] {line}", flush=True)))
        if json_path:
            _write_json(json_path, results, plans, args)
    print()
    print(_text_table(results, plans))
    print()
    for line in summary(results, plans):
        print(line)
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(results, plans) + "\n\n" + "\n".join(
            f"- {line}" for line in summary(results, plans)) + "\n")
    if json_path:
        _write_json(json_path, results, plans, args)
    return 0


def _write_json(path: str, results: dict, plans: list[str], args) -> None:
    import transformers

    doc = {"transformers": transformers.__version__, "torch": torch.__version__, "plans": plans,
           "seq": SEQ, "batch": BATCH, "steps": STEPS, "world": WORLD, "optimizer": args.optimizer,
           "loss_atol": LOSS_ATOL, "param_atol": PARAM_ATOL, "results": results}
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
