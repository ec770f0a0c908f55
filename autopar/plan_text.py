"""The plan's text form: :func:`parse_plan` and :func:`format_plan` (``Plan.parse``, ``str(plan)``).

Syntax (comma-separated, whitespace and key case ignored, each option at most once)::

    dp=N  tp=N  sp  cp=N[:ring|allgather|ulysses]  ep=N
    pp=N[:gpipe|1f1b|interleaved|zbv|dualpipev]  vpp=N  mb=N
    zero=0|1|2|3  recompute=none|selective|full  capacity=F

``"none"`` or ``""`` is the default plan (one rank, nothing sharded).  ``format_plan`` writes the
canonical text, and parsing it gives the plan back.  A token that is not an option, an option
given twice, a flag with a value or a value that is not a number is an ``autopar:`` error naming
the token and the syntax.  Neighbours: :mod:`autopar.plan` (the ``Plan``),
:mod:`autopar.plan_checks` (the rules the parsed plan then meets).
"""
from __future__ import annotations

import difflib

from autopar.errors import AutoparError
from autopar.plan_checks import INT_OPTIONS, fmt_list
from autopar.plan_space import CP_VARIANTS, RECOMPUTE_MODES, SCHEDULES, ZERO_STAGES

__all__ = ["parse_plan", "format_plan", "OPTIONS", "SYNTAX"]

OPTIONS = ("dp", "tp", "sp", "cp", "ep", "pp", "vpp", "mb", "zero", "recompute", "capacity")
"""The plan text's option names."""
SYNTAX = (
    f"dp=N, tp=N, sp, cp=N[:{'|'.join(CP_VARIANTS)}], ep=N, "
    f"pp=N[:{'|'.join(SCHEDULES)}], vpp=N, mb=N, zero={'|'.join(map(str, ZERO_STAGES))}, "
    f"recompute={'|'.join(RECOMPUTE_MODES)}, capacity=F"
)


def parse_plan(cls, text):
    """The ``cls`` (``Plan``) that ``text`` writes (see the module docstring); a ``cls`` is returned as is."""
    if isinstance(text, cls):
        return text
    if not isinstance(text, str):
        raise AutoparError(
            f"autopar: a plan must be a string like 'tp=2,dp=2' or a Plan, got "
            f"{type(text).__name__}"
        )
    stripped = text.strip()
    if stripped.lower() in ("", "none"):
        return cls()
    if stripped.lower() == "auto":
        raise AutoparError(
            "autopar: 'auto' is not a fixed plan; pass plan='auto' to "
            "autopar.parallelize (or call autopar.search) to choose one, or write "
            "the degrees out, e.g. 'tp=2,dp=2'"
        )
    fields: dict = {}
    seen: set[str] = set()
    for raw in stripped.split(","):
        token = raw.strip()
        if not token:
            continue
        key, eq, value = (part.strip() for part in token.partition("="))
        key = key.lower()
        if key not in OPTIONS:
            near = f"; did you mean '{_close_option(key)}'?" if _close_option(key) else ""
            raise AutoparError(
                f"autopar: unknown plan option {key!r} in {text!r}; expected one of "
                f"{fmt_list(OPTIONS)} (syntax: {SYNTAX}){near}"
            )
        if key in seen:
            raise AutoparError(
                f"autopar: plan option {key!r} is given twice in {text!r}; give each "
                f"option once"
            )
        seen.add(key)
        if key == "sp":
            if eq:
                raise AutoparError(
                    f"autopar: plan option 'sp' is a flag and takes no value, got "
                    f"{token!r} in {text!r}; write 'sp' to turn sequence parallelism on, "
                    f"or leave it out"
                )
            fields["sp"] = True
            continue
        if not eq or not value:
            raise AutoparError(
                f"autopar: plan option {key!r} needs a value, got {token!r} in {text!r}; "
                f"syntax: {SYNTAX}"
            )
        fields.update(_parse_value(key, value, text))
    return cls(**fields)


def format_plan(plan) -> str:
    """The canonical text of ``plan``: ``parse_plan(Plan, format_plan(p)) == p``."""
    parts: list[str] = []
    if plan.tp > 1:
        parts.append(f"tp={plan.tp}")
    if plan.sp:
        parts.append("sp")
    if plan.cp > 1:
        parts.append(f"cp={plan.cp}:{plan.cp_variant}")
    if plan.pp > 1:
        parts.append(f"pp={plan.pp}:{plan.schedule}")
    if plan.schedule == "interleaved":
        parts.append(f"vpp={plan.vpp}")  # zbv/dualpipev imply their 2 chunks
    if plan.dp > 1:
        parts.append(f"dp={plan.dp}")
    if plan.ep > 1:
        parts.append(f"ep={plan.ep}")
    if plan.zero:
        parts.append(f"zero={plan.zero}")
    if plan.mb > 1:
        parts.append(f"mb={plan.mb}")
    if plan.recompute != "none":
        parts.append(f"recompute={plan.recompute}")
    if plan.capacity is not None:
        parts.append(f"capacity={plan.capacity!r}")
    return ",".join(parts) or "none"


def _parse_value(key: str, value: str, text: str) -> dict:
    """The fields one ``key=value`` token of plan ``text`` sets (``sp`` is handled by the caller)."""
    fields: dict = {}
    if key in ("cp", "pp"):
        number, colon, variant = (p.strip() for p in value.partition(":"))
        if colon:
            allowed = CP_VARIANTS if key == "cp" else SCHEDULES
            if variant.lower() not in allowed:
                what = "context-parallel variant" if key == "cp" else "pipeline schedule"
                raise AutoparError(
                    f"autopar: unknown {what} {variant!r} in {text!r}; expected one "
                    f"of {fmt_list(allowed)} (e.g. {key}={number or 2}:{allowed[0]})"
                )
            fields["cp_variant" if key == "cp" else "schedule"] = variant.lower()
        fields[key] = _parse_int(key, number, text)
    elif key in INT_OPTIONS:
        fields[key] = _parse_int(key, value, text)
    elif key == "recompute":
        if value.lower() not in RECOMPUTE_MODES:
            raise AutoparError(
                f"autopar: unknown recompute mode {value!r} in {text!r}; expected one "
                f"of {fmt_list(RECOMPUTE_MODES)}"
            )
        fields["recompute"] = value.lower()
    else:  # capacity
        try:
            fields["capacity"] = float(value)
        except ValueError:
            raise AutoparError(
                f"autopar: capacity needs a number, got {value!r} in {text!r}; "
                f"write e.g. capacity=1.25"
            ) from None
    return fields


def _parse_int(key: str, value: str, text: str) -> int:
    try:
        return int(value, 10)
    except ValueError:
        raise AutoparError(
            f"autopar: plan option {key!r} needs an integer, got {value!r} in {text!r}; "
            f"write e.g. {key}=2"
        ) from None


def _close_option(key: str) -> str | None:
    match = difflib.get_close_matches(key, OPTIONS, n=1, cutoff=0.6)
    return match[0] if match else None
