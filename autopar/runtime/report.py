"""``pm.report(path)``: a running program's page, its measurements beside the cost model's prediction.

:func:`write_report` writes the same page as ``autopar report`` (autopar/views/report.py, report_html.py)
for the plan a :class:`~autopar.runtime.module.ParallelModule` runs, with the last step's measurements:
``pm.last_step_stats`` (step time and tokens/s against the prediction) and ``pm.comm_stats()`` (each
kind of collective's bytes against ``Cost.comm_table`` for this rank's pp rank, the byte convention of
docs/architecture.md).  The prediction is ``pm.predicted_cost`` (a GPU, or a CPU measured into
``$AUTOPAR_HARDWARE_PROFILE`` by ``autopar calibrate``); on a CPU without a profile the ``cpu`` preset's
figures price it (:func:`autopar.planning.autoplan.estimate_step` with ``any_hardware``), from the sizes of
``inputs``, a batch as given to ``train_step``, and the page says that its times are no measurement of
this machine.  Every rank may call it; each writes its own page (its comm rows are its own).
"""
from __future__ import annotations

from autopar.errors import AutoparError

__all__ = ["write_report"]


def _cost(pm, inputs):
    if pm.predicted_cost is not None:
        return pm.predicted_cost, "the cost model on this machine's hardware figures"
    if inputs is None:
        raise AutoparError("autopar: pm.report() has no prediction to set the measurements against: the program "
                           "made none (a CPU without $AUTOPAR_HARDWARE_PROFILE, or no train_step yet); pass "
                           "pm.report(path, inputs=(ids,)) with a batch as given to train_step, or run `autopar "
                           "calibrate` and set AUTOPAR_HARDWARE_PROFILE")
    from autopar.planning.autoplan import estimate_step
    from autopar.runtime.stepping.batching import global_sizes

    batch, seq = global_sizes(tuple(inputs), pm.plan, local=pm.step_env.local_batch)
    width = 2 if pm.mixed_precision else 4
    cost = estimate_step(pm.program.structure, pm.plan, seq or 1, int(batch), dtype_bytes=width, any_hardware=True)
    if cost is None:
        raise AutoparError(f"autopar: the cost model cannot price plan '{pm.plan}' for this model; pm.report "
                           f"needs its prediction")
    return cost, "the cost model with the cpu preset's figures (no measurement of this machine: its times are " \
                 "not comparable; `autopar calibrate` makes them so)"


def write_report(pm, path, *, inputs=None, title: str | None = None) -> str:
    """Write ``pm``'s page to ``path`` (see the module docstring) and return the path."""
    from autopar.views.report import comm_stats_rows, plan_page, step_stats_rows
    from autopar.views.report_html import plan_html
    from autopar.views.report_plots import pyplot

    pyplot()
    cost, basis = _cost(pm, inputs)
    import torch.distributed as dist

    coords = pm.coords()
    pp_rank = coords["pp"][0] if "pp" in coords else 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    measured = step_stats_rows(pm.last_step_stats) + comm_stats_rows(pm.comm_stats(), cost.comm_table(pp_rank))
    page = plan_page(cost, measured=measured, title=title or f"autopar program: plan {pm.plan} (rank {rank})",
                     source=f"a running program, rank {rank} (pp rank {pp_rank}); predictions: {basis}")
    text = plan_html(page)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)

