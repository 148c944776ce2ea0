"""PNG plots of a ``hlmtune collect`` table, in the style of the papers' figures.

- ``iteration_time_vs_devices.png``: mean iteration time vs devices, one panel per dataset,
  one line per method/model/template/dtype series;
- ``template_method_bars.png``: per template, per method bars of iteration time for 1 and the
  largest N devices;
- ``peak_memory_vs_devices.png``: peak memory over steps (CUDA allocated, else CPU RSS) vs
  devices, one panel per method;
- ``speedup_efficiency_vs_devices.png``: speedup (T1/TN; by tokens/s where the runs did
  unequal work, labelled so) and efficiency with the ideal line;
- ``overhead_vs_devices.png``: overhead TN - T1/N vs devices;
- ``api_share_stacked.png``: stacked bars of the headline CUDA API / kernel / memcpy (or
  torch.profiler) shares per run and rank, when API summaries exist.

Series labels name their fields (``method=lora, dtype=fp32, pin_memory=False, workers=0``)
and leave out fields that are the same for every series of the figure (said once in the
title instead, wrapped to the figure's width), so a legend never reads as a bare list of
values. Time, memory and ratio axes start at 0, so a 0.04 s difference never looks like a cliff.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # headless: clusters and CI have no display
    import matplotlib.pyplot as plt

    return plt


# Field -> short legend name.
_FIELD_NAMES = {"num_workers": "workers", "gradient_accumulation_steps": "grad_accum", "batch_size": "batch"}


def _field(k: str, v: Any) -> str:
    return f"{_FIELD_NAMES.get(k, k)}={v}"


def _series_label(r: Dict[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(_field(k, r[k]) for k in keys if r.get(k) not in (None, "?"))


def _varying(rows: List[Dict[str, Any]], keys: Sequence[str]) -> Tuple[List[str], str]:
    """(keys whose value differs between rows, "k=v, ..." of the keys shared by all rows)."""
    varying, shared = [], []
    for k in keys:
        vals = {str(r.get(k)) for r in rows}
        if len(vals) > 1:
            varying.append(k)
        elif rows and rows[0].get(k) not in (None, "?"):
            shared.append(_field(k, rows[0][k]))
    return varying, ", ".join(shared)


def _series(rows: List[Dict[str, Any]], keys: Sequence[str], y: str) -> Dict[str, List[Tuple[int, float]]]:
    """Points (devices, y) per series; a series is the rows sharing the values of ``keys``."""
    out: Dict[str, List[Tuple[int, float]]] = {}
    for r in rows:
        if isinstance(r.get("devices"), int) and r.get(y) is not None:
            out.setdefault(_series_label(r, keys) or "all runs", []).append((r["devices"], r[y]))
    return {k: sorted(v) for k, v in out.items()}


def _wrap(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped at ", " to fit ``width_in`` inches at ``fontsize`` points.

    A character of matplotlib's default sans font is about 0.6 em wide; 0.9 of the width
    leaves the margins.
    """
    per_line = max(10, int(0.9 * width_in * 72 / (0.6 * fontsize)))
    lines: List[str] = []
    for part in text.split("\n"):
        line = ""
        for piece in part.split(", "):
            candidate = f"{line}, {piece}" if line else piece
            if line and len(candidate) > per_line:
                lines.append(line + ",")
                line = piece
            else:
                line = candidate
        lines.append(line)
    return "\n".join(lines)


def _title(ax, text: str, fontsize: float = 8) -> None:
    """An axes title wrapped to the axes' width (a long shared-fields line never leaves the figure)."""
    fig = ax.get_figure()
    width_in = fig.get_figwidth() * ax.get_position().width
    ax.set_title(_wrap(text, width_in, fontsize), fontsize=fontsize)


def _from_zero(ax, values: Sequence[float], floor: float = 0.0) -> None:
    """y axis from 0 to a little above the largest value (times, memory, ratios read in proportion)."""
    top = max([floor] + [v for v in values if v is not None])
    ax.set_ylim(0, 1.08 * top if top > 0 else 1.0)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    _plt().close(fig)
    tmp.replace(path)
    return path


SERIES_KEYS = ("method", "model", "template", "dtype", "pin_memory", "num_workers",
               "batch_size", "gradient_accumulation_steps", "max_seq_len")


def _device_counts(rows: List[Dict[str, Any]]) -> List[int]:
    return sorted({r["devices"] for r in rows if isinstance(r.get("devices"), int)})


def plot_iteration_time(rows: List[Dict[str, Any]]):
    """Mean iteration time vs devices, one panel per dataset, one line per series."""
    plt = _plt()
    ns = _device_counts(rows)
    datasets = sorted({str(r["dataset"]) for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        ds_rows = [r for r in rows if str(r["dataset"]) == ds]
        keys, shared = _varying(ds_rows, SERIES_KEYS)
        ys = []
        for label, pts in _series(ds_rows, keys, "iteration_time_s_mean").items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ys += [p[1] for p in pts]
        _title(ax, f"dataset: {ds}" + (f"\n{shared}" if shared else ""))
        ax.set_xlabel("devices")
        ax.set_xticks(ns)
        ax.set_ylabel("mean iteration time (s)")
        _from_zero(ax, ys)
        ax.legend(fontsize=7)
    return fig


def plot_template_bars(rows: List[Dict[str, Any]]):
    """Per template, per method bars of mean iteration time at 1 and the largest N devices."""
    plt = _plt()
    maxn = max(_device_counts(rows), default=1)
    templates = sorted({str(r["template"]) for r in rows})
    methods = sorted({str(r["method"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(5, 2.5 * len(templates)), 4))
    bars = [(m, n) for m in methods for n in sorted({1, maxn})]
    width = 0.8 / max(1, len(bars))
    for i, (m, n) in enumerate(bars):
        ys = []
        for t in templates:
            vals = [r["iteration_time_s_mean"] for r in rows if str(r["template"]) == t and str(r["method"]) == m
                    and r["devices"] == n and r.get("iteration_time_s_mean") is not None]
            ys.append(sum(vals) / len(vals) if vals else 0.0)
        ax.bar([j + i * width for j in range(len(templates))], ys, width=width, label=f"method={m}, devices={n}")
    ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(templates))])
    ax.set_xticklabels([f"template: {t}" for t in templates], fontsize=8)
    ax.set_ylabel("mean iteration time (s)")
    ax.legend(fontsize=7)
    return fig


def plot_peak_memory(rows: List[Dict[str, Any]]):
    """Peak memory over steps (CUDA allocated, else CPU RSS) vs devices, one panel per method."""
    plt = _plt()
    ns = _device_counts(rows)
    mem_key = ("peak_memory_alloc_over_steps_gib" if any(r.get("peak_memory_alloc_over_steps_gib") is not None for r in rows)
               else "peak_rss_over_steps_gib")
    methods = sorted({str(r["method"]) for r in rows})
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4), squeeze=False)
    for ax, m in zip(axes[0], methods):
        m_rows = [r for r in rows if str(r["method"]) == m]
        keys, shared = _varying(m_rows, ("model", "dataset", "template", "dtype", *SERIES_KEYS[4:]))
        ys = []
        for label, pts in _series(m_rows, keys, mem_key).items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", label=label)
            ys += [p[1] for p in pts]
        _title(ax, f"method: {m}" + (f"\n{shared}" if shared else ""))
        ax.set_xlabel("devices")
        ax.set_xticks(ns)
        ax.set_ylabel(f"{mem_key} (GiB)")
        _from_zero(ax, ys)
        ax.legend(fontsize=7)
    return fig


def speedup_series(rows: List[Dict[str, Any]], keys: Sequence[str]) -> Dict[str, Dict[str, List[Tuple[int, float]]]]:
    """Speedup and efficiency points per series, T-based where collect computed it, else by throughput.

    A series whose N-device rows did other work than their 1-device baseline (weak scaling:
    every device keeps its batch) has no T1/TN; its points are the steady-state tokens/s ratio
    instead, and its label says so (``(tokens/s)``).

    Returns:
        Dict[str, Dict[str, List[Tuple[int, float]]]]: ``{"speedup": {label: points},
        "efficiency": {label: points}}``.
    """
    out: Dict[str, Dict[str, List[Tuple[int, float]]]] = {"speedup": {}, "efficiency": {}}
    by_label: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        if isinstance(r.get("devices"), int):
            by_label.setdefault(_series_label(r, keys) or "all runs", []).append(r)
    for label, members in by_label.items():
        timed = any(r.get("speedup") is not None and r["devices"] > 1 for r in members)
        s_key, e_key, name = ("speedup", "efficiency", label) if timed else (
            "speedup_tput", "efficiency_tput", f"{label} (tokens/s)")
        for what, key in (("speedup", s_key), ("efficiency", e_key)):
            pts = sorted((r["devices"], r[key]) for r in members if r.get(key) is not None)
            if pts:
                out[what][name] = pts
    return out


def plot_speedup(rows: List[Dict[str, Any]]):
    """Speedup and efficiency vs devices with the ideal lines, both ratio axes from 0."""
    plt = _plt()
    ns = _device_counts(rows)
    keys, shared = _varying(rows, SERIES_KEYS + ("dataset",))
    series = speedup_series(rows, keys)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    if shared:
        fig.suptitle(_wrap(shared, 10, 8), fontsize=8)
    a1.plot(ns, ns, "k--", label="ideal (speedup = N)")
    a2.plot(ns, [1.0] * len(ns), "k--", label="ideal (efficiency = 1)")
    for ax, what in ((a1, "speedup"), (a2, "efficiency")):
        for label, pts in series[what].items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xlabel("devices")
        ax.set_xticks(ns)
        ax.legend(fontsize=7)
    a1.set_ylabel("speedup T1/TN (or tokens/s ratio)")
    a2.set_ylabel("efficiency speedup/N")
    # Ratios start at 0 so the distance from ideal reads in proportion.
    _from_zero(a1, [p[1] for pts in series["speedup"].values() for p in pts], floor=max(ns, default=1))
    _from_zero(a2, [p[1] for pts in series["efficiency"].values() for p in pts], floor=1.0)
    return fig


def plot_overhead(rows: List[Dict[str, Any]]):
    """Overhead TN - T1/N vs devices (T-based rows only: it needs equal work)."""
    plt = _plt()
    ns = _device_counts(rows)
    keys, shared = _varying(rows, SERIES_KEYS + ("dataset",))
    fig, ax = plt.subplots(figsize=(5, 4))
    if shared:
        _title(ax, shared)
    ax.axhline(0.0, color="k", linestyle="--", label="ideal (no overhead)")
    for label, pts in _series(rows, keys, "overhead_s").items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("devices")
    ax.set_xticks(ns)
    ax.set_ylabel("overhead TN - T1/N (s)")
    ax.legend(fontsize=7)
    return fig


# File name -> figure function, in the order the report describes them.
PLOTS = {
    "iteration_time_vs_devices.png": plot_iteration_time,
    "template_method_bars.png": plot_template_bars,
    "peak_memory_vs_devices.png": plot_peak_memory,
    "speedup_efficiency_vs_devices.png": plot_speedup,
    "overhead_vs_devices.png": plot_overhead,
}


def write_plots(rows: List[Dict[str, Any]], api_rows: List[Dict[str, Any]], out: str | Path) -> List[Path]:
    """Write every plot that has data.

    Args:
        rows (List[Dict[str, Any]]): table rows from :func:`hlmtune.profiling.analysis.build_table`.
        api_rows (List[Dict[str, Any]]): long API rows (may be empty).
        out (str | Path): output directory.

    Returns:
        List[Path]: written PNG files.
    """
    out = Path(out)
    files = [_save(make(rows), out / name) for name, make in PLOTS.items()]
    if api_rows:
        files.append(write_api_stacked(api_rows, out / "api_share_stacked.png"))
    return files


def write_api_stacked(api_rows: List[Dict[str, Any]], path: str | Path) -> Path:
    """Stacked bars: per run and rank, the headline metrics' share of their category (%).

    Args:
        api_rows (List[Dict[str, Any]]): long rows (``run``, ``rank``, ``section``,
            ``category``, ``name``, ``share``).
        path (str | Path): PNG path.

    Returns:
        Path: the written file.
    """
    plt = _plt()
    head = [r for r in api_rows if r["section"] == "headline" and r.get("share") is not None]
    bars = sorted({(str(r["run"]), str(r["rank"])) for r in head})
    cats = sorted({str(r["category"]) for r in head})
    fig, axes = plt.subplots(1, max(1, len(cats)), figsize=(max(5, 1.2 * len(bars)) * max(1, len(cats)) / 1.5, 4.5), squeeze=False)
    for ax, cat in zip(axes[0], cats):
        names = sorted({r["name"] for r in head if r["category"] == cat})
        bottom = [0.0] * len(bars)
        for name in names:
            ys = []
            for run, rank in bars:
                v = [r["share"] for r in head if (str(r["run"]), str(r["rank"])) == (run, rank) and r["name"] == name and r["category"] == cat]
                ys.append(100.0 * v[0] if v else 0.0)
            ax.bar(range(len(bars)), ys, bottom=bottom, label=name)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([f"{run}\nrank {rank}" for run, rank in bars], fontsize=7, rotation=30)
        ax.set_ylabel(f"share of {cat} time (%)")
        ax.set_title(cat)
        ax.legend(fontsize=6)
    return _save(fig, Path(path))
