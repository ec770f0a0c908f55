"""The zoo sweep's engine: causal LMs of transformers, shrunk, under plans on 2 gloo ranks against one process.

:func:`run_types` takes model types of transformers (``{model_type: [plan, ...]}``), builds each from
transformers' default config shrunk the way ``autopar verify`` shrinks one
(:func:`autopar.verification.shrink.shrink_config`: few layers, small widths, no dropout,
windows and chunks shorter than the sequence; ``attn_implementation="sdpa"`` where the model
has it), trains it 3 fp32 steps under each plan on 2 gloo ranks and on one process, and sorts
each (model type, plan) into one class:

* ``equal``: losses within ``LOSS_ATOL`` and every state-dict tensor (and, under SGD, step 1's
  gradients) within ``PARAM_ATOL`` (:mod:`autopar.verification.compare`);
* ``refused``: an ``autopar:`` error before the first step (``refused (trace)``: the one that
  says torch.export could not trace the model);
* ``failed``: any other exception, or any exception once the program was compiled, or ranks
  that disagree or hang; ``silently wrong``: the run completed but differs -- the worst class;
* ``no-build``: the default config does not give a model (no config, no shrinkable fields,
  transformers cannot build it, or it does not train on one process).

The pieces are autopar verify's own (autopar/verification/: ``sources`` for the model, the
batches, the loss and the optimizers; ``shrink``; ``api._reference`` for the single process;
``compare`` for the verdict).  The ranks come from a runner: the suite passes its pooled gloo
workers (``tests/support/harness.py``: one pool of 2 for the whole session), the full sweep
``benchmarks/zoo.py`` a fresh gloo world per call (:func:`spawned_runner`, on
:func:`autopar.verification.launch.run_spawned`).  One runner call per model type runs all its
plans (:func:`zoo_job`), each rank writing each plan's outcome to a file as it finishes, so a
hanging or crashing plan costs a restart and the plans after it are resubmitted.

Its users: the CI subset tests/e2e/test_zoo.py and the full sweep ``benchmarks/zoo.py`` (the
tables of docs/zoo.md).  It lives beside the benchmark, not in tests/: benchmarks never import
the test suite (tests/unit/test_layers.py).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import io
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.verification import sources
from autopar.verification.api import _reference  # the single-process side of verify
from autopar.verification.compare import compare
from autopar.verification.shrink import shrink_config

__all__ = ["PLANS", "COLUMNS", "SEQ", "BATCH", "STEPS", "WORLD", "JOB_TIMEOUT_S", "CLASSES", "model_types",
           "run_types", "spawned_runner", "zoo_job", "cell"]

REPO = Path(__file__).resolve().parents[1]

PLANS = ["dp=2,zero=3", "tp=2,sp", "cp=2:ring", "pp=2,mb=2"]
COLUMNS = {"pp=2,mb=2": "pp=2"}  # short column titles
SEQ = 32
BATCH = 4
STEPS = 3
WORLD = 2
SEED = 0
PP_LAYERS = 4  # a pipelined plan gets 4 decoder layers; the others verify's default (2)
HANDSHAKE_S = 45.0  # how long a rank waits for the other to finish the same plan
JOB_TIMEOUT_S = 120.0
MAX_PARAMS = 50_000_000  # a shrunk model larger than this is not built (see _build)
RESTART = "zoo: the pool restarts after plan"  # a job's deliberate exit after a plan that crashed
_AUTOPAR_DIRS = ("autopar", "passes", "cost")
CLASSES = ("equal", "refused", "refused (trace)", "failed", "silently wrong", "no-build")


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _first_line(text: str, limit: int | None = None) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if limit is None or len(line) <= limit else line[:limit - 3] + "..."


def _frames(tb) -> tuple[str | None, str | None]:
    """(the innermost autopar frame, the innermost frame) of a traceback, as 'path:line'."""
    summary = traceback.extract_tb(tb)
    where = origin = None
    for frame in summary:
        path = Path(frame.filename)
        try:
            rel = path.resolve().relative_to(REPO)
        except ValueError:
            rel = None
        text = f"{rel if rel is not None else path.name}:{frame.lineno}"
        origin = f"{text} ({frame.name})"
        if rel is not None and rel.parts[0] in _AUTOPAR_DIRS:
            where = origin
    return where, origin


def _root(exc: BaseException) -> BaseException:
    """The first exception of a chain (a pass's own error, under the runner's re-raise)."""
    seen = {id(exc)}
    while (exc.__cause__ or exc.__context__) is not None and id(exc.__cause__ or exc.__context__) not in seen:
        exc = exc.__cause__ or exc.__context__
        seen.add(id(exc))
    return exc


def _outcome(outcome: str, reason: str = "", **info) -> dict:
    return {"outcome": outcome, "reason": reason, **info}


# ----------------------------------------------------------------------------- the ranks


def _drop_subgroups() -> None:
    """Destroy the process groups a plan made (as tests/support/harness.py does after a job), so that
    their gloo threads do not share the cores with the next plan."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is not None and hasattr(mesh_module, "_mesh_resources"):
        mesh_module._mesh_resources.mesh_stack.clear()
    gc.collect()


def _train(entry: dict, rank: int) -> tuple[dict, dict | None]:
    """One plan on this rank: (status, rank 0's losses and state dicts)."""
    from autopar.runtime import parallelize

    status = {"rank": rank, "phase": "build"}
    result = None
    start = time.perf_counter()
    try:
        model, kwargs = entry["source"].build(SEED)
        model.load_state_dict(entry["init"])
        batches = sources.make_batches(entry["vocab"], entry["batch"], entry["seq"], STEPS, SEED)
        status["phase"] = "parallelize"
        pm = parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=entry["plan"],
                         loss_fn=sources.next_token_loss, optimizer=sources.OPTIMIZERS[entry["optimizer"]])
        status["compile_s"] = round(time.perf_counter() - start, 2)
        status["phase"] = "state_dict"
        states = [_cpu(pm.state_dict())]
        losses = []
        with sources.seeded_steps(SEED):  # the reference's random draws (api._reference)
            for step, (inputs, target) in enumerate(batches, start=1):
                status["phase"] = f"step {step}"
                losses.append(float(pm.train_step(inputs, target)))
                status["phase"] = "state_dict"
                states.append(_cpu(pm.state_dict()))
        status["phase"] = "done"
        if rank == 0:
            result = {"losses": losses, "states": states}
        del pm, model
    except BaseException as exc:  # noqa: BLE001 - classified by the parent
        where, origin = _frames(_root(exc).__traceback__)
        if where is None:
            where = _frames(exc.__traceback__)[0]
        status.update(error=type(exc).__name__, message=str(exc) or type(exc).__name__,
                      autopar=isinstance(exc, AutoparError),  # not a pass's crash re-raised as 'autopar: pass X failed'
                      where=where, origin=origin, traceback=traceback.format_exc()[-6000:])
        traceback.clear_frames(exc.__traceback__)  # nothing may keep the program (and its groups) alive
        del exc
    status["seconds"] = round(time.perf_counter() - start, 2)
    return status, result


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def zoo_job(entries: list[dict], workdir: str, token: str) -> None:
    """A pool job (tests/support/harness.py): every plan of one model type, one after the other, on this rank.

    Each rank writes ``WORKDIR/I-RANK.json`` (its status for entry I) and rank 0 ``WORKDIR/I.pt``
    (losses and state dicts) as each plan ends; then both ranks meet on the default group's
    store before the next plan, so a rank stuck in a collective of a failed plan makes the job
    fail (and the pool restart) after ``HANDSHAKE_S`` instead of hanging the next plan."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    rank = dist.get_rank()
    store = c10d._get_default_store()
    for i, entry in enumerate(entries):
        if rank == 0:
            Path(workdir, f"{i}.started").touch()
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            status, result = _train(entry, rank)
        if result is not None:
            torch.save(result, os.path.join(workdir, f"{i}.tmp"))
            os.replace(os.path.join(workdir, f"{i}.tmp"), os.path.join(workdir, f"{i}.pt"))
        Path(workdir, f"{i}-{rank}.json").write_text(json.dumps(status))
        del result
        _drop_subgroups()
        store.set(f"zoo/{token}/{i}/{rank}", "1")
        store.wait([f"zoo/{token}/{i}/{1 - rank}"], datetime.timedelta(seconds=HANDSHAKE_S))
        errors = [json.loads(Path(workdir, f"{i}-{r}.json").read_text()).get("error") for r in range(WORLD)]
        if any(e not in (None, "AutoparError") for e in errors):  # the last plan too: the pool serves more jobs
            # A crash may leave the world group with unmatched messages (a pipeline's send without
            # its recv): every later collective would fail.  Restart the pool; the parent resubmits.
            raise RuntimeError(f"{RESTART} {i} ({', '.join(str(e) for e in errors)})")


# ----------------------------------------------------------------------------- the parent


def _prepare(model_type: str, plans: list[str], optimizer: str) -> tuple[dict, list[dict], dict]:
    """Outcomes decided here (refusals of the plan, no-builds), the pool's entries, the references."""
    import transformers

    outcomes, entries, refs = {}, [], {}
    try:
        base = transformers.AutoConfig.for_model(model_type).to_dict()
    except Exception as exc:  # noqa: BLE001
        reason = f"no default config: {type(exc).__name__}: {_first_line(exc)}"
        return {p: _outcome("no-build", reason) for p in plans}, [], {}
    built: dict[str, tuple] = {}  # one model and reference per distinct shrunk config
    for plan_text in plans:
        try:
            plan = Plan.parse(plan_text)
            plan.validate(world_size=WORLD)
            layers = PP_LAYERS if plan.pp > 1 else None
            batch, seq = sources.batch_shape(plan, BATCH, SEQ)
            sources._check_original(base, plan, layers)  # what the full-size model refuses
        except AutoparError as exc:
            outcomes[plan_text] = _outcome("refused", _first_line(exc), phase="plan")
            continue
        try:
            cfg, notes = shrink_config(base, plan, layers, seq)
        except AutoparError as exc:
            outcomes[plan_text] = _outcome("no-build", f"shrink: {_first_line(exc)}")
            continue
        key = json.dumps(cfg, sort_keys=True, default=str)
        if key not in built:
            built[key] = _build(model_type, cfg, notes, batch, seq, optimizer)
        source, init, vocab, ref, failure = built[key]
        if failure is not None:
            outcomes[plan_text] = failure
            continue
        entries.append(dict(plan=plan_text, source=source, init=init, vocab=vocab, batch=batch, seq=seq,
                            optimizer=optimizer))
        refs[plan_text] = ref
    return outcomes, entries, refs


def _build(model_type: str, cfg: dict, notes: list[str], batch: int, seq: int, optimizer: str):
    """(source, initial state, vocabulary, reference run, no-build outcome or None)."""
    attempts = [dict(cfg, attn_implementation="sdpa"), cfg]  # sdpa where the model has it
    try:  # on the meta device first: a model whose shrunk config still builds a full-size part (a
        with torch.device("meta"):  # multimodal model's towers) would take the host's memory
            meta, _ = sources.ModelSource(name=model_type, config=cfg, notes=notes).build(SEED)
        size = sum(p.numel() for p in meta.parameters())
        del meta
    except Exception:  # noqa: BLE001 - the real build below says why
        size = 0
    if size > MAX_PARAMS:
        return None, None, None, None, _outcome("no-build", f"shrunk model still has {size / 1e6:.0f}M parameters "
                                                            f"(over {MAX_PARAMS / 1e6:.0f}M): the shrinker misses part of it")
    failure = None
    for config in attempts:
        source = sources.ModelSource(name=model_type, config=config, notes=notes)
        try:
            with torch.random.fork_rng(devices=[]):
                model, kwargs = source.build(SEED)
        except Exception as exc:  # noqa: BLE001
            failure = _outcome("no-build", f"build: {_first_line(exc, 300)}")
            continue
        break
    else:
        return None, None, None, None, failure
    try:
        init = _cpu(model.state_dict())
        vocab = sources.vocab_size(model)
        batches = sources.make_batches(vocab, batch, seq, STEPS, SEED)
        ref = _reference(model, kwargs, batches, optimizer, seed=SEED)
    except Exception as exc:  # noqa: BLE001
        return None, None, None, None, _outcome("no-build", f"one process: {type(exc).__name__}: {_first_line(exc)}")
    return source, init, vocab, ref, None


def _classify(entry: dict, statuses: list[dict | None], got: dict | None, ref: dict) -> dict:
    errors = [s for s in statuses if s is not None and "error" in s]
    info = {}
    done = [s for s in statuses if s is not None]
    if done:
        info["seconds"] = max(s.get("seconds", 0) for s in done)
        if any("compile_s" in s for s in done):
            info["compile_s"] = max(s.get("compile_s", 0) for s in done)
    if errors:
        e = errors[0]
        info.update(error=e["error"], where=e["where"], origin=e["origin"], phase=e["phase"],
                    rank=e["rank"], traceback=e["traceback"])
        message = _first_line(e["message"])
        if len(errors) < len(statuses):
            message += f" (rank {e['rank']} only; " + ("the other rank " + (
                "completed" if None not in statuses else "did not finish") + ")")
        if e["error"] == "AutoparError" and e["phase"] in ("build", "parallelize") and len(errors) == len(statuses):
            kind = "refused (trace)" if "could not trace" in message else "refused"
            return _outcome(kind, message, **info)
        return _outcome("failed", f"{e['error']}: {message}", **info)
    if got is None or None in statuses:
        return _outcome("failed", "a rank did not report", **info)
    lr = sources.SGD_LR if entry["optimizer"] == "sgd" else None
    context = dict(model=entry["source"].name, plan=entry["plan"], world_size=WORLD, steps=STEPS,
                   global_batch=entry["batch"], seq_len=entry["seq"], optimizer=entry["optimizer"], notes=[])
    result = compare(ref, got, lr=lr, **context)
    info.update(loss_diff=max(result.loss_diffs), param_diff=result.worst_param_diff,
                param_tensor=result.worst_param_tensor, grad_diff=result.worst_grad_diff,
                grad_tensor=result.worst_grad_tensor)
    if result.ok:
        return _outcome("equal", "", **info)
    # An ill-conditioned model (CPM-Ant: a loss of 21 at SGD's lr 0.1) turns the rounding of any
    # reordered reduction into differences beyond the bounds within three steps: plain PyTorch on
    # the same batch in row slices differs from the whole batch as much.  There only the first
    # step (its loss, its gradients, the parameters after it) can be compared, and it must be equal.
    parts = _row_parts(entry["plan"])
    yardstick = compare(ref, _split_reference(entry, parts), lr=lr, **context)
    first = compare(_first_step(ref), _first_step(got), lr=lr, **context)
    if not yardstick.ok and first.ok:
        return _outcome("equal", "", note=(
            f"step 1 equal; later steps ill-conditioned: one process on the batch in {parts} row slices "
            f"differs from the whole batch by {max(yardstick.loss_diffs):.1e} in loss, "
            f"{yardstick.worst_param_diff:.1e} in parameters"), **info)
    return _outcome("silently wrong", _first_line(result.verdict()).removeprefix("verdict: "), **info)


def _row_parts(plan_text: str) -> int:
    """How many slices of the batch's rows the plan reduces over (dp replicas times micro-batches),
    at least 2: the reordering the yardstick applies."""
    plan = Plan.parse(plan_text)
    return max(2, plan.dp * plan.mb)


def _first_step(run: dict) -> dict:
    """``run`` (a reference's or a rank's record) cut to its first optimizer step."""
    return {**run, "losses": run["losses"][:1], "states": run["states"][:2]}


def _split_reference(entry: dict, parts: int) -> dict:
    """The single-process run again, with each batch's rows in ``parts`` slices (api._reference)."""
    with torch.random.fork_rng(devices=[]):
        model, kwargs = entry["source"].build(SEED)
    model.load_state_dict(entry["init"])
    batches = sources.make_batches(entry["vocab"], entry["batch"], entry["seq"], STEPS, SEED)
    return _reference(model, kwargs, batches, entry["optimizer"], parts=parts, seed=SEED)


def _read(workdir: str, i: int) -> tuple[list, dict | None]:
    statuses = []
    for rank in range(WORLD):
        path = Path(workdir, f"{i}-{rank}.json")
        statuses.append(json.loads(path.read_text()) if path.exists() else None)
    pt = Path(workdir, f"{i}.pt")
    got = torch.load(pt, weights_only=True) if pt.exists() else None
    return statuses, got


def spawned_runner(job: str, *args, world: int, timeout: float):
    """Run ``job`` (``"module:function"``) with ``args`` on a fresh gloo world of ``world`` local
    processes; a failure, a dead rank or the timeout raises :class:`autopar.errors.AutoparError`."""
    from benchmarks.gloo_ranks import run_ranks

    return run_ranks(_named_job, world, job, args, timeout=timeout)


def _named_job(rank: int, world: int, job: str, args: tuple):
    """``job`` (``"module:function"``) called with ``args`` on one rank of the gloo world."""
    import importlib

    module, _, name = job.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


def run_types(model_types, plans: list[str] | None = None, *, optimizer: str = "sgd",
              job_timeout: float = JOB_TIMEOUT_S, group: int = 1, progress=None,
              runner=None, runner_errors: tuple = ()) -> dict:
    """``{model_type: {plan: outcome}}``.

    ``model_types``: a list (each with every plan of ``plans``, default :data:`PLANS`) or a dict
    ``{model_type: [plan, ...]}``.  ``group`` types share one runner call (all their plans, one
    after the other); ``progress`` gets one line per model type.  ``runner(job, *args, world=,
    timeout=)`` runs a job on every rank (default :func:`spawned_runner`); ``runner_errors``: the
    exceptions by which it reports a failed, crashed or hung job (default ``AutoparError``)."""
    run_distributed = runner or spawned_runner
    pool_errors = runner_errors or (AutoparError,)
    if not isinstance(model_types, dict):
        model_types = {t: list(plans or PLANS) for t in model_types}
    say = progress or (lambda line: None)
    results = {}
    names = list(model_types)
    for first in range(0, len(names), max(1, group)):
        chunk = names[first:first + max(1, group)]
        start = time.perf_counter()
        outcomes, pending, refs = {}, [], {}
        for model_type in chunk:
            type_plans = model_types[model_type]
            try:
                decided, entries, type_refs = _prepare(model_type, type_plans, optimizer)
            except Exception as exc:  # noqa: BLE001 - a zoo sweep goes on
                decided, entries, type_refs = {p: _outcome("no-build", f"prepare: {type(exc).__name__}: "
                                                                      f"{_first_line(exc)}") for p in type_plans}, [], {}
            outcomes.update({(model_type, p): o for p, o in decided.items()})
            pending += [dict(e, model_type=model_type) for e in entries]
            refs.update({(model_type, p): r for p, r in type_refs.items()})
        while pending:
            pending = _run_pending(pending, outcomes, refs, job_timeout, run_distributed, pool_errors)
        elapsed = time.perf_counter() - start
        for model_type in chunk:
            results[model_type] = {p: outcomes[(model_type, p)] for p in model_types[model_type]}
            say(f"{model_type:<28} {elapsed / len(chunk):6.1f} s  " + "  ".join(
                f"{COLUMNS.get(p, p)}: {cell(o, 60)}" for p, o in results[model_type].items()))
    return results


def _run_pending(pending: list[dict], outcomes: dict, refs: dict, job_timeout: float, run_distributed,
                 pool_errors) -> list[dict]:
    """One pool call for ``pending``; fills ``outcomes``; returns the entries to run again (those
    after a plan the job died or hung in)."""
    with tempfile.TemporaryDirectory(prefix="autopar-zoo-") as workdir:
        error = None
        try:
            run_distributed("benchmarks.zoo_engine:zoo_job", pending, workdir, os.path.basename(workdir),
                            world=WORLD, timeout=job_timeout * len(pending))
        except pool_errors as exc:
            error = exc
        left, culprit = [], None
        for i, entry in enumerate(pending):
            key = (entry["model_type"], entry["plan"])
            statuses, got = _read(workdir, i)
            restart = error is not None and RESTART in str(error)
            if culprit is not None or (restart and not all(s is not None for s in statuses)):
                left.append(entry)  # after the plan the job died in (or left on purpose): run again
            elif all(s is not None for s in statuses):
                outcomes[key] = _classify(entry, statuses, got, refs[key])
            else:  # the plan the job died in (or hung in): failed, with what the ranks said
                culprit = entry
                outcome = _classify(entry, statuses, got, refs[key])
                reason = _pool_error(error) if error is not None else "a rank did not report"
                if "error" not in outcome:
                    outcome = _outcome("failed", reason, phase="pool", **{
                        k: v for k, v in outcome.items() if k not in ("outcome", "reason")})
                outcome["pool_error"] = reason
                outcomes[key] = outcome
        if error is not None and culprit is None and RESTART not in str(error):  # the job failed after every plan
            for e in pending:
                outcomes[(e["model_type"], e["plan"])]["job_note"] = _pool_error(error)
    return left


def _pool_error(error: BaseException) -> str:
    text = _first_line(error)
    if "did not finish within" in text:
        return "timeout: " + text.removeprefix("harness: ")
    return text.removeprefix("harness: ")


README_BEGIN = "<!-- zoo table: generated from docs/zoo.json by `python benchmarks/zoo.py --readme` -->"
README_END = "<!-- end of the zoo table -->"


def readme_table(results: dict, plans: list[str], columns: dict[str, str]) -> str:
    """The README's compact table: one row per model type that traces, a short :func:`cell` per
    plan, between :data:`README_BEGIN` and :data:`README_END`."""
    rows = [README_BEGIN, "", "| model type | " + " | ".join(columns.get(p, p) for p in plans) + " |",
            "|" + "---|" * (len(plans) + 1)]
    for model_type, row in sorted(results.items()):
        if any(o["outcome"] not in ("no-build", "refused (trace)") for o in row.values()):
            rows.append(f"| {model_type} | " + " | ".join(cell(row[p], 48).replace("|", "/") for p in plans) + " |")
    return "\n".join(rows + ["", README_END])


def cell(outcome: dict, limit: int = 110) -> str:
    kind, reason = outcome["outcome"], outcome.get("reason", "")
    if kind == "equal":
        return "equal (step 1; ill-conditioned after)" if outcome.get("note") else "equal"
    reason = reason.removeprefix("autopar: ")
    if len(reason) > limit:
        reason = reason[:limit - 3] + "..."
    return f"{kind} ({reason})" if reason else kind
