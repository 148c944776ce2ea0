"""PNG plots of a ``hlmtune collect`` table, in the style of the papers' figures.

- ``iteration_time_vs_devices.png``: mean iteration time vs devices, one panel per dataset,
  one line per method/model/template/dtype series;
- ``template_method_bars.png``: per template, per method bars of iteration time for 1 and the
  largest N devices;
- ``peak_memory_vs_devices.png``: peak memory over steps (CUDA allocated, else CPU RSS) vs
  devices, one panel per method;
- ``speedup_efficiency_vs_devices.png``: speedup (T1/TN) and efficiency with the ideal line;
  both ratio axes start at 0 (a 2% efficiency loss must not look like a cliff);
- ``overhead_vs_devices.png``: overhead TN - T1/N vs devices;
- ``api_share_stacked.png``: stacked bars of the headline CUDA API / kernel / memcpy (or
  torch.profiler) shares per run and rank, when API summaries exist.

Series labels name their fields (``method=lora, dtype=fp32, pin_memory=False, workers=0``)
and leave out fields that are the same for every series of the figure (said once in the
title instead), so a legend never reads as a bare list of values.
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


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    _plt().close(fig)
    tmp.replace(path)
    return path


def write_plots(rows: List[Dict[str, Any]], api_rows: List[Dict[str, Any]], out: str | Path) -> List[Path]:
    """Write every plot that has data.

    Args:
        rows (List[Dict[str, Any]]): table rows from :func:`hlmtune.profiling.analysis.build_table`.
        api_rows (List[Dict[str, Any]]): long API rows (may be empty).
        out (str | Path): output directory.

    Returns:
        List[Path]: written PNG files.
    """
    plt = _plt()
    out = Path(out)
    files: List[Path] = []
    series_keys = ("method", "model", "template", "dtype", "pin_memory", "num_workers",
                   "batch_size", "gradient_accumulation_steps", "max_seq_len")
    ns = sorted({r["devices"] for r in rows if isinstance(r.get("devices"), int)})

    # 1. iteration time vs devices, one panel per dataset.
    datasets = sorted({str(r["dataset"]) for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        ds_rows = [r for r in rows if str(r["dataset"]) == ds]
        keys, shared = _varying(ds_rows, series_keys)
        for label, pts in _series(ds_rows, keys, "iteration_time_s_mean").items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_title(f"dataset: {ds}" + (f"\n{shared}" if shared else ""), fontsize=8)
        ax.set_xlabel("devices")
        ax.set_xticks(ns)
        ax.set_ylabel("mean iteration time (s)")
        ax.legend(fontsize=7)
    files.append(_save(fig, out / "iteration_time_vs_devices.png"))

    # 2. per template, per method bars for 1 and max-N devices.
    maxn = max((r["devices"] for r in rows if isinstance(r.get("devices"), int)), default=1)
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
    files.append(_save(fig, out / "template_method_bars.png"))

    # 3. peak memory vs devices per method.
    mem_key = ("peak_memory_alloc_over_steps_gib" if any(r.get("peak_memory_alloc_over_steps_gib") is not None for r in rows)
               else "peak_rss_over_steps_gib")
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4), squeeze=False)
    for ax, m in zip(axes[0], methods):
        m_rows = [r for r in rows if str(r["method"]) == m]
        keys, shared = _varying(m_rows, ("model", "dataset", "template", "dtype", *series_keys[4:]))
        for label, pts in _series(m_rows, keys, mem_key).items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", label=label)
        ax.set_title(f"method: {m}" + (f"\n{shared}" if shared else ""), fontsize=8)
        ax.set_xlabel("devices")
        ax.set_xticks(ns)
        ax.set_ylabel(f"{mem_key} (GiB)")
        ax.legend(fontsize=7)
    files.append(_save(fig, out / "peak_memory_vs_devices.png"))

    # 4. speedup and efficiency with the ideal line; 5. overhead.
    all_keys, shared = _varying(rows, series_keys + ("dataset",))
    sp = _series(rows, all_keys, "speedup")
    ef = _series(rows, all_keys, "efficiency")
    ov = _series(rows, all_keys, "overhead_s")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    if shared:
        fig.suptitle(shared, fontsize=8)
    a1.plot(ns, ns, "k--", label="ideal (speedup = N)")
    a2.plot(ns, [1.0] * len(ns), "k--", label="ideal (efficiency = 1)")
    for label, pts in sp.items():
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    for label, pts in ef.items():
        a2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    a1.set_xlabel("devices")
    a1.set_xticks(ns)
    a1.set_ylabel("speedup T1/TN")
    a2.set_xlabel("devices")
    a2.set_xticks(ns)
    a2.set_ylabel("efficiency speedup/N")
    # Ratios start at 0 so the distance from ideal reads in proportion.
    a1.set_ylim(0, 1.05 * max([max(ns, default=1)] + [p[1] for pts in sp.values() for p in pts]))
    a2.set_ylim(0, 1.05 * max([1.0] + [p[1] for pts in ef.values() for p in pts]))
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    files.append(_save(fig, out / "speedup_efficiency_vs_devices.png"))

    fig, ax = plt.subplots(figsize=(5, 4))
    if shared:
        ax.set_title(shared, fontsize=8)
    ax.axhline(0.0, color="k", linestyle="--", label="ideal (no overhead)")
    for label, pts in ov.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("devices")
    ax.set_xticks(ns)
    ax.set_ylabel("overhead TN - T1/N (s)")
    ax.legend(fontsize=7)
    files.append(_save(fig, out / "overhead_vs_devices.png"))

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
