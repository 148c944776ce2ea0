"""benchmarks/rr_reference_throughput.py on synthetic records: every row printed and timed, the
shipped config's reference marked, beat tables as the annotations give them, bad flags refused."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench_helpers import assert_needs_hlm_data, load_benchmark

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("rr_reference_throughput")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from hlmtune.ecg_tokenizer.synth import write_synthetic_database

    folder = tmp_path_factory.mktemp("synth")
    return folder, write_synthetic_database(folder, n_records=2, fs=128, duration_s=60.0, seed=3)


def test_tables_hold_the_annotated_intervals(bench, records):
    import wfdb

    folder, names = records
    tables = bench._tables([(folder, names)])
    assert len(tables) == 2
    for (table, fs), name in zip(tables, names):
        ann = wfdb.rdann(str(folder / name), "atr")  # an independent reader
        beats = np.array([s for s, sym in zip(ann.sample, ann.symbol) if sym in "NAV"])  # "+": rhythm changes
        assert fs == 128.0 and beats.size > 40
        assert table["sample"].tolist() == beats.tolist()
        assert table["rr"][0] == -1 and table["rr"][1:].tolist() == np.diff(beats).tolist()


def test_prints_every_computation_and_marks_the_shipped_one(bench, records, capsys):
    folder, names = records
    assert bench.main(["--records", str(folder), "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    beats = sum(t.size for t, _ in bench._tables([(folder, names)]))
    assert out.startswith(f"2 records, {beats:,} beats: {folder} (2 records); 2 repeats")
    rows = {m.group(1).strip(): m for m in re.finditer(r"^(.{34}) +([\d.]+) +([\d.]+) +([\d,]+) +([\d.]+)(.*)$", out, re.M)}
    assert set(rows) == set(bench.computations()), out
    assert float(rows["median of 256"].group(5)) == 1.0
    ds = yaml.safe_load((ROOT / "configs" / "ecg_lora.yaml").read_text())["dataset"]
    shipped = f"{ds.get('rr_reference', 'median')} of {ds['normalized_rr']}"
    marked = [k for k, m in rows.items() if "ecg_lora.yaml" in m.group(6)]
    assert marked == [shipped]


def test_marks_the_reference_a_config_names(bench, records, capsys, tmp_path):
    folder, _ = records
    for ref, beats in (("gated_regular", 32), ("mean", 256)):
        cfg = tmp_path / f"{ref}.yaml"
        cfg.write_text(yaml.safe_dump({"dataset": {"normalized_rr": beats, "rr_reference": ref}}))
        assert bench.main(["--records", str(folder), "--repeats", "1", "--config", str(cfg)]) == 0
        marked = [line.split("  ")[0] for line in capsys.readouterr().out.splitlines() if line.endswith(f"<- {cfg.name}")]
        assert marked == [f"{ref} of {beats}"]
    cfg.write_text(yaml.safe_dump({"dataset": {"normalized_rr": 64}}))
    bench.main(["--records", str(folder), "--repeats", "1", "--config", str(cfg)])
    assert f"{cfg} ships median of 64: not one of the rows above" in capsys.readouterr().out


def test_refuses_bad_input(bench, monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main(["--records", str(tmp_path), "--repeats", "0"])
    assert e.value.code == 2
    assert_needs_hlm_data(bench.main, monkeypatch, tmp_path)
