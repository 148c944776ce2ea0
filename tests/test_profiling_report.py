"""The collect folder's report.md and table.md: figures explained and linked, no empty columns."""

from __future__ import annotations

import re

from hlmtune.profiling.analysis import collect
from test_profiling_plots import _two_regimes


def _table_columns(md: str) -> list:
    """Each Markdown table of ``md`` as {header: [cells]}."""
    tables, lines = [], md.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            head = [c.strip() for c in line.strip("|").split(" | ")]
            body = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                body.append([c.strip() for c in row.strip("|").split(" | ")])
            tables.append({h: [r[j] for r in body] for j, h in enumerate(head)})
    return tables


def test_table_md_shows_key_figures_first_and_no_empty_column(tmp_path, monkeypatch):
    _two_regimes(tmp_path, monkeypatch)
    collect([tmp_path / "runs"], tmp_path / "out")
    md = (tmp_path / "out" / "table.md").read_text()
    tables = _table_columns(md)
    assert len(tables) == 2
    key = list(tables[0])
    # the varying group key identifies rows, then the key figures in order
    assert key[:4] == ["batch_size", "nodes", "devices", "steps"]
    assert key.index("iteration_time_s_mean") < key.index("tokens_per_second") < key.index("speedup") < key.index("efficiency")
    for t in tables:
        for col, cells in t.items():
            assert any(c for c in cells), f"column {col} is empty in every row"
    assert "peak_memory_alloc_over_steps_gib" not in md  # CUDA columns without a value (CPU runs)
    assert "run_dirs" not in md and str(tmp_path) not in md  # paths stay in the CSV
    assert "All rows: method=lora" in md
    csv_head = (tmp_path / "out" / "table.csv").read_text().splitlines()[0]
    assert "peak_memory_alloc_over_steps_gib" in csv_head and "run_dirs" in csv_head  # the CSV keeps all


def test_report_md_explains_each_figure_and_links_what_exists(tmp_path, monkeypatch):
    _two_regimes(tmp_path, monkeypatch)
    res = collect([tmp_path / "runs"], tmp_path / "out")
    out = tmp_path / "out"
    report = (out / "report.md").read_text()
    assert str(out / "report.md") in res["files"]
    links = re.findall(r"\]\(([^)]+)\)", report)
    assert links and all((out / link).exists() for link in links)
    for png in ("speedup_efficiency_vs_devices.png", "iteration_time_vs_devices.png", "peak_memory_vs_devices.png",
                "overhead_vs_devices.png", "template_method_bars.png"):
        assert f"![{png}]({png})" in report
    assert "api_share_stacked.png" not in report  # no API summaries in these runs: not linked
    # the regimes of these rows: one strong (same global batch), one weak (twice the work)
    assert "1 multi-device row(s) did the same work" in report and "1 did other work" in report
    assert "strong scaling" in report and "weak scaling" in report and "mismatched" in report


def test_no_plots_no_image_links(tmp_path, monkeypatch):
    _two_regimes(tmp_path, monkeypatch)
    collect([tmp_path / "runs"], tmp_path / "out", plots=False)
    report = (tmp_path / "out" / "report.md").read_text()
    assert ".png" not in report and "(table.md)" in report
