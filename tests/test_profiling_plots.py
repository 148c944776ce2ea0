"""Plots: every figure is written, is a real PNG and is not blank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hlmtune.profiling.analysis import collect


def _assert_non_empty_png(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100
    # A drawn figure has many distinct colours, an empty canvas has one.
    assert np.unique(img.reshape(-1, img.shape[-1]), axis=0).shape[0] > 20


def test_all_plots_written_for_two_methods_and_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_profiling_analysis import make_run

    for method in ("lora", "qlora"):
        for template in ("alpaca", "grammar"):
            for n, steps in ((1, 8), (2, 4), (4, 2)):
                make_run(tmp_path / "runs" / f"{method}-{template}-{n}", monkeypatch, world_size=n,
                         step_times=[0.5 + 0.1 * n] * steps, tokens_per_step=100 * n, method=method, template=template,
                         rss_gib=1.0 + (method == "qlora"))
    res = collect([tmp_path / "runs"], tmp_path / "out")
    assert len(res["rows"]) == 12 and res["problems"] == []
    names = {Path(f).name for f in res["files"] if f.endswith(".png")}
    assert names == {"iteration_time_vs_devices.png", "template_method_bars.png", "peak_memory_vs_devices.png",
                     "speedup_efficiency_vs_devices.png", "overhead_vs_devices.png"}
    for name in names:
        _assert_non_empty_png(tmp_path / "out" / name)


def _capture(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Record each figure write_plots saves, by file name (the PNG is still written)."""
    from hlmtune.profiling import plots

    figs = {}
    real = plots._save

    def save(fig, path):
        figs[Path(path).name] = fig
        return real(fig, path)

    monkeypatch.setattr(plots, "_save", save)
    return figs


def _lines(ax) -> dict:
    """{legend label: (x list, y list)} of an axis' plotted lines."""
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}


def test_plots_show_the_table_series_labels_and_ratio_axes_from_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the figures show: one series per configuration with one point per device count, the
    table's numbers, named axes, legends that name their fields, ratio axes that start at 0."""
    from test_profiling_analysis import make_run

    # Near-ideal scaling (efficiency ~0.98): the axis must not stretch a 2% loss over the panel.
    for workers in (0, 2):
        for n, steps in ((1, 8), (2, 4), (4, 2)):
            make_run(tmp_path / "runs" / f"w{workers}-{n}", monkeypatch, world_size=n,
                     step_times=[0.5 / 0.98 ** (n - 1) + 0.01 * workers] * steps, tokens_per_step=100 * n,
                     extra_info={"num_workers": workers})
    figs = _capture(monkeypatch)
    res = collect([tmp_path / "runs"], tmp_path / "out")
    rows = res["rows"]

    ax_it = figs["iteration_time_vs_devices.png"].axes[0]
    assert ax_it.get_xlabel() == "devices" and ax_it.get_ylabel() == "mean iteration time (s)"
    series = _lines(ax_it)
    assert set(series) == {"workers=0", "workers=2"}  # only the varying field, named
    assert "pin_memory=False" in ax_it.get_title() and "method=lora" in ax_it.get_title()  # shared fields said once
    for w in (0, 2):
        xs, ys = series[f"workers={w}"]
        table = sorted((r["devices"], r["iteration_time_s_mean"]) for r in rows if r["num_workers"] == w)
        assert xs == [1, 2, 4]  # one point per device count
        assert ys == pytest.approx([t for _, t in table])

    fig = figs["speedup_efficiency_vs_devices.png"]
    a_sp, a_ef = [a for a in fig.axes if a.get_ylabel()][:2]
    assert a_sp.get_ylabel() == "speedup T1/TN" and a_ef.get_ylabel() == "efficiency speedup/N"
    assert a_sp.get_ylim()[0] == 0 and a_ef.get_ylim()[0] == 0 and a_ef.get_ylim()[1] >= 1.0
    eff = _lines(a_ef)
    assert eff["ideal (efficiency = 1)"][1] == [1.0, 1.0, 1.0]
    xs, ys = eff["workers=0"]
    table = sorted((r["devices"], r["efficiency"]) for r in rows if r["num_workers"] == 0)
    assert xs == [1, 2, 4] and ys == pytest.approx([e for _, e in table])
    assert min(ys) > 0.9  # the data really is near-ideal, and the axis still starts at 0

    ax_mem = figs["peak_memory_vs_devices.png"].axes[0]
    assert ax_mem.get_ylabel() == "peak_rss_over_steps_gib (GiB)"
    mem = _lines(ax_mem)
    assert mem["workers=0"][1] == pytest.approx(
        [r["peak_rss_over_steps_gib"] for r in sorted(rows, key=lambda r: r["devices"]) if r["num_workers"] == 0])

    bars = figs["template_method_bars.png"].axes[0]
    labels = {t.get_text() for t in bars.get_legend().get_texts()}
    assert labels == {"method=lora, devices=1", "method=lora, devices=4"}
