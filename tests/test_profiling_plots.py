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
