"""The ECG token builder through ``hlmtune.data_builders``, and the pack's from-scratch recipe on it.

Synthetic WFDB records -> heartbeat tokens -> memory-mapped shards -> ``ecg_tokens_dataset`` ->
``full_finetune_distributed`` without a checkpointer: the path the Heart Language Model takes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recipe_runner import mean, read_steps, run_recipe

HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))


@pytest.fixture(scope="module")
def ecg_shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ecg")
    for cmd in (
        [HLMTUNE, "synth-ecg", "--out", str(root / "records"), "--n-records", "4", "--duration", "600"],
        [HLMTUNE, "tokenize", "--records", str(root / "records"), "--scheme", "annotation", "--out",
         str(root / "shards"), "--no-progress"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "shards"


def test_builder_is_exported_and_reads_shards(ecg_shards):
    from hlmtune.data_builders import ecg_tokens_dataset
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer

    tok = ECGTokenizer(manifest_path=str(ecg_shards / "manifest.json"), max_seq_len=64)
    ds = ecg_tokens_dataset(tok, shards_dir=str(ecg_shards), max_seq_len=64)
    assert len(ds) > 0
    item = ds[0]
    assert len(item["tokens"]) == len(item["labels"]) <= 64
    assert max(item["tokens"]) < tok.vocab_size


def test_ecg_model_trains_from_scratch_with_the_pack_recipe(ecg_shards, tmp_path):
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer

    vocab = ECGTokenizer(manifest_path=str(ecg_shards / "manifest.json")).vocab_size
    cfg = yaml.safe_load((Path(__file__).parent.parent / "configs" / "tiny_full.yaml").read_text())
    cfg.pop("checkpointer")  # no checkpoint: random initialisation
    cfg.pop("model_dir")
    cfg["tokenizer"] = {"_component_": "hlmtune.ecg_tokenizer.tokenizer.ecg_tokenizer",
                        "manifest_path": str(ecg_shards / "manifest.json"), "max_seq_len": 32}
    cfg["model"].update(vocab_size=vocab, max_seq_len=32)
    cfg["dataset"] = {"_component_": "hlmtune.data_builders.ecg_tokens_dataset", "shards_dir": str(ecg_shards),
                      "max_seq_len": 32}
    cfg["data_loader"] = {"split": "contiguous", "num_workers": 0, "pin_memory": False}
    cfg.update(max_steps_per_epoch=15, batch_size=2, data_dir=str(tmp_path))
    cfg["optimizer"]["lr"] = 3e-3
    path = tmp_path / "ecg_full.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    run_recipe("full_finetune_distributed", str(path), out, model_dir=tmp_path, data_dir=tmp_path, nproc=2)
    steps = read_steps(out)
    losses = [s["loss"] for s in steps]
    assert mean(losses[-4:]) < mean(losses[:4]) - 0.5, losses
    assert (out / "epoch_0" / "model.pt").exists()
    run = json.loads((out / "metrics" / "run.json").read_text())
    assert run["method"] == "pretrain" and run["world_size"] == 2
