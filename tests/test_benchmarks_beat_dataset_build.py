"""benchmarks/beat_dataset_build.py on synthetic records: the config's dataset keys reach the
dataset, every row is printed with its ratio to the config's, bad input is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from bench_helpers import assert_needs_hlm_data, load_benchmark

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("beat_dataset_build")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from hlmtune.ecg_tokenizer.synth import write_synthetic_database

    folder = tmp_path_factory.mktemp("bench") / "synth"
    folder.mkdir()
    return folder, write_synthetic_database(folder, n_records=2, fs=128, duration_s=90.0, seed=5)


def test_the_config_s_example_keys_reach_the_dataset(bench, records, tmp_path):
    folder, names = records
    cfg = yaml.safe_load((ROOT / "configs" / "ecg_lora.yaml").read_text())["dataset"]
    opts = bench.dataset_options(ROOT / "configs" / "ecg_lora.yaml")
    assert "_component_" not in opts and "split_file" not in opts and "extra_records" not in opts
    assert opts["rr_reference"] == cfg["rr_reference"] and opts["num_examples"] == cfg["num_examples"]
    manifest = bench.tokenize([(folder, "synth", None)], tmp_path / "tokens")
    assert sorted(r["record"] for r in manifest["records"]) == [f"synth/{n}" for n in names]
    ds = bench.build(manifest, opts)
    assert len(ds) == cfg["num_examples"] and ds.options.rr_reference == cfg["rr_reference"]
    assert ds.options.template_beats == cfg["template_beats"] and ds.p_wave is None
    with_p = bench.build(manifest, {**opts, **bench.VARIANTS["p_wave_beats 8"]})
    assert with_p.p_wave is not None and len(with_p.example(5).feature_tokens) == 1
    with_lead2 = bench.build(manifest, {**opts, **bench.VARIANTS["second_lead 32"]})
    assert len(with_lead2.example(5).tokens) == len(ds.example(5).tokens) + 32


def test_prints_every_row_with_its_ratio(bench, records, capsys):
    folder, _ = records
    assert bench.main(["--records", str(folder), "--repeats", "2", "--examples", "50"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"2 records, ") and f"{folder}; 2 repeats, 50 examples each" in out.splitlines()[0]
    rows = {m.group(1).strip(): m for m in
            re.finditer(r"^(.{22}) +([\d.]+) +([\d.]+) +([\d.]+) +([\d,]+) +([\d.]+)$", out, re.M)}
    assert list(rows) == ["ecg_lora.yaml", *bench.VARIANTS], out
    assert rows["ecg_lora.yaml"].group(4) == "1.00" and rows["ecg_lora.yaml"].group(6) == "1.00"
    build = {k: float(m.group(2)) for k, m in rows.items()}
    rate = {k: int(m.group(5).replace(",", "")) for k, m in rows.items()}
    for k, m in rows.items():  # each ratio is this row's over the config's (build: best seconds, rounded)
        assert build[k] > 0 and rate[k] > 0
        assert float(m.group(4)) == pytest.approx(build[k] / build["ecg_lora.yaml"], rel=0.15, abs=0.01)
        assert float(m.group(6)) == pytest.approx(rate[k] / rate["ecg_lora.yaml"], abs=0.006)


def test_refuses_bad_input(bench, monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main(["--records", str(tmp_path), "--examples", "0"])
    assert e.value.code == 2
    assert_needs_hlm_data(bench.main, monkeypatch, tmp_path)
