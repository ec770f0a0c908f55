"""The report's figures: matplotlib drawings of the page model, returned as inline SVG text.

Each function takes a part of :func:`autopar.views.report.plan_page`'s model and returns one ``<svg>``
element (``fig.savefig(format="svg")``, text kept as text, no external references), so the page opens
without a network.  Hover texts (a term's formula) are SVG ``<title>`` elements placed in the group
matplotlib writes for an artist with a ``gid``.  matplotlib is an optional dependency (the ``report``
extra); :func:`pyplot` says how to install it when it is missing.  docs/report.md says why matplotlib.

Neighbours: autopar/views/report.py (the numbers), autopar/views/report_html.py (the page).
"""
from __future__ import annotations

import html
import io
import re

from autopar.errors import AutoparError

__all__ = ["pyplot", "mesh_svg", "schedule_svg", "memory_svg", "comm_svg", "time_svg", "measured_svg",
           "plans_svg", "AXIS_COLOURS"]

AXIS_COLOURS = {"pp": "#1f77b4", "dp": "#ff7f0e", "cp": "#2ca02c", "tp": "#d62728", "ep": "#9467bd",
                "dp_cp": "#8c564b", "edp": "#e377c2"}
_KIND_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#8172b3"}
_GIB = 2.0**30


def pyplot():
    """matplotlib's pyplot on the Agg backend, or an ``autopar:`` error naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise AutoparError("autopar: the report draws its figures with matplotlib, which is not installed in this "
                           "environment; install the report extra: pip install 'autopar[report]' (or pip install "
                           "matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def _svg(fig, name: str, hovers: dict[str, str] | None = None) -> str:
    """``fig`` as an ``<svg>`` element (no XML prolog, ids salted by ``name``), with ``hovers``
    (gid -> text) as ``<title>`` children of their groups."""
    plt = pyplot()
    buf = io.StringIO()
    plt.rcParams["svg.hashsalt"] = name
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    for gid, hover in (hovers or {}).items():
        text = text.replace(f'<g id="{gid}">', f'<g id="{gid}"><title>{html.escape(hover)}</title>', 1)
    return re.sub(r'id="(figure|axes|patch|text|line2d|legend|matplotlib\.axis)_(\d+)"',
                  lambda m: f'id="{name}-{m.group(1)}_{m.group(2)}"', text)


def _bytes_unit(values) -> tuple[float, str]:
    top = max([abs(v) for v in values] + [0.0])
    for unit, scale in (("GiB", _GIB), ("MiB", 2.0**20), ("KiB", 1024.0)):
        if top >= scale:
            return scale, unit
    return 1.0, "B"


def mesh_svg(mesh: dict) -> str:
    """One panel per mesh axis of degree > 1 (pp if none): the ranks in rows, coloured by their
    coordinate on that axis."""
    from matplotlib.colors import LinearSegmentedColormap
    import numpy as np

    plt = pyplot()
    axes = [a for a, d in mesh["degrees"].items() if d > 1] or ["pp"]
    cols = mesh["columns"]
    rows = -(-mesh["world"] // cols)
    fig, panels = plt.subplots(1, len(axes), figsize=(1.2 + 2.6 * len(axes), min(8.0, 2.4 + 0.2 * rows)),
                               squeeze=False)
    for ax, axis in zip(panels[0], axes):
        size = mesh["degrees"][axis]
        grid = np.full(rows * cols, np.nan)
        grid[:mesh["world"]] = mesh["coords"][axis]
        cmap = LinearSegmentedColormap.from_list(axis, ["#f4f4f4", AXIS_COLOURS[axis]])
        ax.imshow(grid.reshape(rows, cols), cmap=cmap, vmin=-0.5, vmax=max(size - 0.5, 0.5),
                  interpolation="nearest", aspect="auto")
        ax.set_title(f"{axis} = {size}", color=AXIS_COLOURS[axis], fontweight="bold")
        ax.set_xlabel(f"rank mod {cols}")
        ax.set_ylabel(f"rank // {cols}")
        if mesh["world"] <= 64:
            for r in range(mesh["world"]):
                ax.text(r % cols, r // cols, f"{r}\n{mesh['coords'][axis][r]}", ha="center", va="center", fontsize=7)
    fig.suptitle("rank -> coordinate on each axis (darker: higher index)")
    return _svg(fig, "mesh")


def schedule_svg(sched: dict) -> str:
    """The pipeline grid: pp ranks down, unit time steps across; forward, backward (input gradient)
    and weight-gradient cells coloured by kind, lighter for odd micro-batches; idle steps hatched (the bubble)."""
    plt = pyplot()
    steps, pp = sched["steps"], sched["pp"]
    fig, ax = plt.subplots(figsize=(min(16.0, 2.0 + 0.09 * steps), 0.8 + 0.45 * pp))
    label = steps * pp <= 400
    dense = not label  # thousands of cells: drawn as an image inside the SVG, axes and text stay vector
    for rank, row in enumerate(sched["rows"]):
        idle = [(t, 1) for t, cell in enumerate(row) if cell is None]
        ax.broken_barh(idle, (rank - 0.4, 0.8), facecolors="#f0f0f0", edgecolor="#bbbbbb", hatch="///",
                       linewidth=0.3, rasterized=dense)
        runs: dict[tuple, list] = {}
        for t, cell in enumerate(row):
            if cell is not None:
                runs.setdefault((cell["kind"][0], cell["microbatch"] % 2), []).append((t, 1))
                if label:
                    ax.text(t + 0.5, rank, cell["label"], ha="center", va="center", fontsize=6, color="white")
        for (kind, odd), cells in runs.items():
            ax.broken_barh(cells, (rank - 0.4, 0.8), facecolors=_KIND_COLOURS.get(kind, "#55a868"),
                           edgecolor="white", linewidth=0.3, alpha=0.65 if odd else 1.0, rasterized=dense, zorder=2)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_xlim(0, steps)
    ax.set_yticks(range(pp), [f"pp rank {r}" for r in range(pp)])
    ax.set_xlabel("time step (each action one unit)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _KIND_COLOURS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="#f0f0f0", edgecolor="#bbbbbb", hatch="///"))
    ax.legend(handles, ["forward", "backward (input grad.)", "backward (weight grad.)", "idle: bubble"],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, frameon=False)
    return _svg(fig, "schedule")


def memory_svg(mem: dict) -> str:
    """The fullest rank's memory over the step's moments, each term a band (hover: its formula), the
    peak marked, the usable and the device's total memory as lines."""
    plt = pyplot()
    moments = mem["moments"]
    names = [t for t in moments[0]["terms"] if any(m["terms"][t] > 0 for m in moments)]
    far = mem["usable_bytes"] > 4 * mem["peak_bytes"]  # the lines would flatten the bands: left off the chart
    scale, unit = _bytes_unit([mem["peak_bytes"]] if far else [mem["device_bytes"], mem["peak_bytes"]])
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    xs = list(range(len(moments)))
    ys = [[m["terms"][t] / scale for m in moments] for t in names]
    colours = plt.get_cmap("tab20").colors
    bands = ax.stackplot(xs, ys, labels=names, colors=colours[:len(names)] if names else None, step="mid")
    hovers = {}
    for i, (band, name) in enumerate(zip(bands, names)):
        band.set_gid(f"memory-term-{i}")
        hovers[f"memory-term-{i}"] = f"{name} = {mem['formulas'].get(name) or '(no formula)'}"
    peak_x = next(i for i, m in enumerate(moments) if m["moment"] == mem["peak_moment"])
    ax.plot([peak_x], [mem["peak_bytes"] / scale], marker="v", color="black", markersize=9)
    ax.annotate(f"peak {mem['peak_bytes'] / scale:.2f} {unit} ({mem['peak_moment']})",
                (peak_x, mem["peak_bytes"] / scale), textcoords="offset points", xytext=(0, 10), ha="center")
    for value, name, style in ((mem["usable_bytes"], "usable", "--"), (mem["device_bytes"], "device", ":")):
        if far:
            ax.plot([], [], color="#c44e52", linestyle=style, label=f"{name} {value / _GIB:.1f} GiB: far above")
        else:
            ax.axhline(value / scale, color="#c44e52", linestyle=style, linewidth=1.2,
                       label=f"{name} {value / scale:.1f} {unit}")
    ax.set_ylim(0, (1.3 * mem["peak_bytes"] if far else 1.08 * max(mem["device_bytes"], mem["peak_bytes"])) / scale)
    ax.set_xticks(xs, [m["moment"] for m in moments])
    ax.set_xlabel("moment of the step (cost/memory.py MOMENTS; hover a band for its formula)")
    ax.set_ylabel(unit)
    ax.set_xlim(-0.5, len(moments) - 0.5)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    ax.set_title(f"pp rank {mem['pp_rank']} (the fullest) over one step")
    return _svg(fig, "memory", hovers)


def _hbars(ax, labels, values, colours, unit):
    ax.barh(range(len(labels)), values, color=colours)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(unit)


def comm_svg(comm: dict) -> str:
    """Bytes one rank sends per step, by mesh axis and by collective."""
    plt = pyplot()
    axis_items = sorted(comm["by_axis"].items(), key=lambda kv: -kv[1])
    kind_items = sorted(comm["by_collective"].items(), key=lambda kv: -kv[1])
    scale, unit = _bytes_unit([v for _, v in axis_items + kind_items])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.9 + 0.32 * max(len(kind_items), 3)))
    _hbars(left, [a for a, _ in axis_items], [v / scale for _, v in axis_items],
           [AXIS_COLOURS.get(a, "#777777") for a, _ in axis_items], f"{unit} sent per step")
    left.set_title("by mesh axis")
    _hbars(right, [k for k, _ in kind_items], [v / scale for _, v in kind_items],
           [AXIS_COLOURS.get(k.rsplit("(", 1)[-1].rstrip(")"), "#777777") for k, _ in kind_items],
           f"{unit} sent per step")
    right.set_title("by collective (axis)")
    fig.suptitle(f"collectives of one rank of pp rank {comm['pp_rank']}")
    return _svg(fig, "comm")


def time_svg(split: list[dict], step_time: float) -> str:
    """The step as one bar split into compute, each dimension's exposed comm, bubble and optimizer
    (hover a part for its terms' formulas)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 1.9))
    colours = plt.get_cmap("tab10").colors
    left, hovers = 0.0, {}
    scale, unit = (1e-3, "ms") if step_time < 1 else (1.0, "s")
    for i, part in enumerate(split):
        bar = ax.barh([0], [part["seconds"] / scale], left=[left], color=colours[i % 10],
                      label=f"{part['group']} {part['share'] * 100:.1f}%")
        bar.patches[0].set_gid(f"time-part-{i}")
        hovers[f"time-part-{i}"] = part["group"] + ":\n" + "\n".join(part["formulas"])
        left += part["seconds"] / scale
    ax.set_yticks([])
    ax.set_xlabel(f"{unit} (step {step_time / scale:.2f} {unit}; hover a part for its formulas)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=4, frameon=False)
    return _svg(fig, "time", hovers)


def measured_svg(rows: list[dict]) -> str:
    """Each measurement against its prediction, as measured / predicted (1: exact)."""
    plt = pyplot()
    rows = [r for r in rows if r["predicted"]]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.3 * max(len(rows), 2)))
    ratios = [r["measured"] / r["predicted"] for r in rows]
    _hbars(ax, [r["name"] for r in rows], ratios,
           ["#55a868" if abs(x - 1) <= 0.05 else "#c44e52" for x in ratios], "measured / predicted")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_title("green: within 5% of the prediction")
    return _svg(fig, "measured")


def plans_svg(records: list[dict], usable_bytes: float) -> str:
    """The top plans side by side: step time, MFU and peak memory per GPU (the usable memory as a line)."""
    plt = pyplot()
    labels = [f"#{r['rank']}" for r in records]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(11, 2.8))
    a.bar(labels, [r["step_time_s"] for r in records], color="#4c72b0")
    a.set_title("step time (s)")
    b.bar(labels, [r["mfu"] * 100 for r in records], color="#55a868")
    b.set_title("MFU (%)")
    c.bar(labels, [r["memory_per_gpu_bytes"] / _GIB for r in records], color="#8172b3")
    c.axhline(usable_bytes / _GIB, color="#c44e52", linestyle="--", label="usable")
    c.set_title("peak memory per GPU (GiB)")
    c.legend(frameon=False)
    return _svg(fig, "plans")
