"""Plots: every figure is written, is a real PNG, shows the table's numbers, and fits its canvas."""

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
    assert a_sp.get_ylabel() == "speedup T1/TN (or tokens/s ratio)" and a_ef.get_ylabel() == "efficiency speedup/N"
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


def _two_regimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **extra) -> None:
    """A sweep as the shipped tiny grid runs it: devices 1, 2 x per-device batch 2, 4, each run 8 steps.

    Global batch 4 on 2 devices (batch 2) is the same work as batch 4 on one (strong scaling);
    batch 4 on 2 devices did twice the 1-device work (weak scaling: T refused).
    """
    from test_profiling_analysis import make_run

    for batch in (2, 4):
        for n in (1, 2):
            make_run(tmp_path / "runs" / f"b{batch}-n{n}", monkeypatch, world_size=n,
                     step_times=[0.1 * batch * (0.6 if n == 2 else 1.0)] * 8, tokens_per_step=100 * batch * n,
                     extra_info={"batch_size": batch, **extra})


def test_speedup_plot_has_a_point_per_device_count_in_each_regime(tmp_path, monkeypatch):
    _two_regimes(tmp_path, monkeypatch)
    figs = _capture(monkeypatch)
    res = collect([tmp_path / "runs"], tmp_path / "out")
    rows = {(r["batch_size"], r["devices"]): r for r in res["rows"]}
    assert rows[(2, 2)].get("speedup") is not None  # same global batch as (4, 1): T-based
    assert rows[(4, 2)].get("speedup") is None and rows[(4, 2)].get("speedup_tput") is not None  # twice the work
    a_sp, a_ef = [a for a in figs["speedup_efficiency_vs_devices.png"].axes if a.get_ylabel()][:2]
    sp = _lines(a_sp)
    assert sp["batch=2"][0] == [1, 2] and sp["batch=4 (tokens/s)"][0] == [1, 2]
    assert sp["batch=2"][1][1] == pytest.approx(rows[(2, 2)]["speedup"])
    assert sp["batch=4 (tokens/s)"][1][1] == pytest.approx(rows[(4, 2)]["speedup_tput"])
    assert _lines(a_ef)["batch=4 (tokens/s)"][1][1] == pytest.approx(rows[(4, 2)]["efficiency_tput"])


def test_every_title_fits_and_time_and_memory_axes_start_at_zero(tmp_path, monkeypatch):
    # Long values shared by every row: the title line that named them ran off both sides.
    _two_regimes(tmp_path, monkeypatch, model="lora_llama3_8b_with_a_rather_long_builder_name",
                 template="torchtune.data.AlpacaToMessages_and_a_long_suffix", dtype="bf16")
    figs = _capture(monkeypatch)
    collect([tmp_path / "runs"], tmp_path / "out")
    assert len(figs) == 5
    for name, fig in figs.items():
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(fig)  # the saved figure was closed: draw it again at its saved size
        canvas.draw()
        renderer = canvas.get_renderer()
        tight = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # inches -> pixels
        canvas = fig.bbox
        assert tight.x0 >= canvas.x0 - 1 and tight.x1 <= canvas.x1 + 1 and tight.y1 <= canvas.y1 + 1, name
        for text in [ax.title for ax in fig.axes] + ([fig._suptitle] if fig._suptitle else []):
            if not text.get_text():
                continue
            box = text.get_window_extent(renderer)
            assert box.x0 >= canvas.x0 - 1 and box.x1 <= canvas.x1 + 1, (name, text.get_text())
            assert box.y1 <= canvas.y1 + 1, (name, text.get_text())
    for name in ("iteration_time_vs_devices.png", "peak_memory_vs_devices.png", "speedup_efficiency_vs_devices.png"):
        for ax in figs[name].axes:
            if ax.get_ylabel():
                assert ax.get_ylim()[0] == 0, (name, ax.get_ylabel())
