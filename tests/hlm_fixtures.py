"""Shared inputs of the Heart Language Model tests: token shards of a few records, and runs.

With ``HLM_DATA`` set the shards come from real MIT-BIH records (five minutes of each; train
records from DS1, test records from DS2, written as a split file); without it from the pack's
synthetic WFDB records, so a fresh clone still trains, fine-tunes and evaluates the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))
COLLECTOR = "hlmtune.profiling.collector.CollectorLogger"
# DS1 records with S, V and F beats in their first minutes; DS2 records for testing.
TRAIN_RECORDS = ["101", "106", "118", "119", "208", "209", "223"]
TEST_RECORDS = ["100", "105", "213", "232"]
SECONDS = 300


def make_shards(root: Path) -> Dict[str, object]:
    """Tokenize the test records (with their second lead); returns ``{"shards", "split_file", "real"}``."""
    from hlmtune.files import atomic_write_text
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    data = os.environ.get("HLM_DATA")
    if data and (Path(data) / "mitdb" / "100.hea").exists():
        db, train, test = Path(data) / "mitdb", TRAIN_RECORDS, TEST_RECORDS
        options = RecordOptions(sampto=360 * SECONDS, second_lead=True)
        real = True
    else:
        from hlmtune.hlm.pipeline import synthetic_database

        db = synthetic_database(root / "synth", n_records=6, duration_s=240)
        lists = json.loads((db / "splits.json").read_text())
        train, test, options, real = lists["DS1"], lists["DS2"], RecordOptions(second_lead=True), False
    split_file = root / "splits.json"
    atomic_write_text(split_file, json.dumps({"DS1": train, "DS2": test}))
    s = tokenize_directory(db, root / "tokens", params=TokenizerParams(), options=options, records=train + test,
                           workers=1, progress=False)
    assert s.ok, s.format()
    return {"shards": root / "tokens", "split_file": split_file, "real": real, "train": train, "test": test, "db": db}


def run_hlm(recipe: str, config: str, out: Path, *, shards: Dict[str, object], nproc: Optional[int] = None,
            overrides: Sequence[str] = (), check: bool = True) -> subprocess.CompletedProcess:
    """``hlmtune run`` of an ECG config on the test shards, recorded by the collector."""
    cmd = [HLMTUNE, "run"] + (["--nproc_per_node", str(nproc)] if nproc else []) + [
        recipe, "--config", config, f"shards_dir={shards['shards']}", f"split_file={shards['split_file']}",
        # the test shards hold one database: the configs' extra training patients (svdb) are not in them
        "extra_records=null",
        f"output_dir={out}", f"metric_logger._component_={COLLECTOR}", f"metric_logger.log_dir={out}/metrics",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- stderr tail ---\n{proc.stderr[-4000:]}")
    return proc


def losses(out: Path) -> List[float]:
    """Per-step losses the collector wrote (``out/metrics/steps.jsonl``), as data."""
    rows = [json.loads(line) for line in (out / "metrics" / "steps.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows]


def svdb_style_folder(folder: Path, names=("800", "801"), seconds: float = 60.0) -> Path:
    """Records as the MIT-BIH Supraventricular Arrhythmia Database ships them: 128 Hz, CRLF
    headers, leads ECG1/ECG2 (no MLII), and a beat annotation one sample past the signal's end."""
    import wfdb

    from hlmtune.ecg_tokenizer.synth import write_synthetic_database

    written = write_synthetic_database(folder, n_records=len(names), fs=128, duration_s=seconds, seed=7)
    for old, new in zip(written, names):
        rec = wfdb.rdrecord(str(folder / old))
        ann = wfdb.rdann(str(folder / old), "atr")
        for ext in ("hea", "dat", "atr"):
            (folder / f"{old}.{ext}").unlink()
        wfdb.wrsamp(new, fs=128, units=["mV", "mV"], sig_name=["ECG1", "ECG2"], p_signal=rec.p_signal,
                    fmt=["212", "212"], write_dir=str(folder))
        past = rec.p_signal.shape[0]  # one sample past the last one
        wfdb.wrann(new, "atr", np.append(ann.sample, past), symbol=[*ann.symbol, "N"], write_dir=str(folder))
        hea = folder / f"{new}.hea"
        hea.write_bytes(hea.read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
    (folder / "RECORDS").write_text("\n".join(names) + "\n")
    return folder
