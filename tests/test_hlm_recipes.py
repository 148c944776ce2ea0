"""Every ECG config end to end on CPU at 1 and 2 ranks, through the real CLI.

pretrain (random init) -> LoRA / QLoRA / QAT from the pretrained weights -> DPO from the LoRA
classifier; each run's loss falls, and its output loads for inference (``hlmtune eval`` reads
the export and runs the model). ``ecg_lora.yaml`` also runs unchanged under torchtune's own
``lora_finetune_single_device`` on CPU. Real MIT-BIH records when ``HLM_DATA`` is set,
synthetic ones otherwise (``hlm_fixtures``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hlm_fixtures import HLMTUNE, losses, make_shards, run_hlm

pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Small runs: short context, few steps (the model is hlm_1m, 0.95M parameters).
PRETRAIN = ["dataset.max_seq_len=256", "batch_size=4", "optimizer.lr=3e-3", "lr_scheduler.num_warmup_steps=3"]
FINETUNE = ["batch_size=16", "lr_scheduler.num_warmup_steps=3", "dataset.num_examples=1024"]


def _drop(xs, k=4):
    return sum(xs[:k]) / k - sum(xs[-k:]) / k


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("hlm_shards"))


@pytest.fixture(scope="module")
def pretrained(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain") / "run"
    run_hlm("full_finetune_distributed", "ecg_pretrain", out, shards=shards,
            overrides=[*PRETRAIN, "max_steps_per_epoch=40"])
    return out


@pytest.fixture(scope="module")
def lora_run(shards, pretrained, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    run_hlm("lora_finetune_distributed", "ecg_lora", out, shards=shards,
            overrides=[*FINETUNE, f"pretrain_dir={pretrained}", "max_steps_per_epoch=30"])
    return out


def _eval(config, out: Path, *extra: str) -> dict:
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(config), "--max-examples", "64", "--out", str(out), *extra],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


def test_pretraining_from_scratch_learns(pretrained):
    """A random-init LM starts at ~ln(vocab) and must fall well below it on real beats."""
    ls = losses(pretrained)
    assert len(ls) == 40 and ls[0] > 5.0
    assert _drop(ls) > 1.0, ls
    assert (pretrained / "epoch_0" / "model.pt").exists()
    run = json.loads((pretrained / "metrics" / "run.json").read_text())
    assert run["method"] == "pretrain"


def test_pretraining_two_ranks(shards, tmp_path):
    out = tmp_path / "run"
    run_hlm("full_finetune_distributed", "ecg_pretrain", out, shards=shards, nproc=2,
            overrides=[*PRETRAIN, "max_steps_per_epoch=20"])
    assert _drop(losses(out)) > 0.5
    assert json.loads((out / "metrics" / "run.json").read_text())["world_size"] == 2


def test_lora_learns_classes_and_eval_has_every_field(lora_run, tmp_path):
    ls = losses(lora_run)
    # The class token was never a pretraining target: the loss starts high and must drop fast.
    assert _drop(ls) > 1.5, ls
    m = _eval(lora_run, tmp_path / "eval")
    assert m["split_kind"] == "inter_patient" and m["task"] == "beat" and m["n_examples"] == 64
    assert set(m) >= {"notice", "test_split", "train_records", "n_test_examples", "classes", "results", "baselines"}
    r = m["results"]["HLM (this run)"]
    assert set(r) >= {"per_class", "macro_f1", "accuracy", "confusion", "off_vocabulary_argmax", "n"}
    assert set(r["per_class"]) == {"N", "S", "V", "F"} and sum(map(sum, r["confusion"])) == 64
    for c in r["per_class"].values():
        assert set(c) >= {"se", "ppv", "f1", "support"}
    assert (tmp_path / "eval" / "confusion.png").stat().st_size > 1000
    report = (tmp_path / "eval" / "report.md").read_text()
    assert report.startswith("**Inter-patient evaluation") and "de Chazal et al. 2004" in report


def test_lora_two_ranks(shards, pretrained, tmp_path):
    out = tmp_path / "run"
    run_hlm("lora_finetune_distributed", "ecg_lora", out, shards=shards, nproc=2,
            overrides=[*FINETUNE, f"pretrain_dir={pretrained}", "max_steps_per_epoch=15"])
    assert _drop(losses(out)) > 1.0


@pytest.mark.parametrize("nproc", [None, 2])
def test_qlora_trains_and_loads(shards, pretrained, tmp_path, nproc):
    out = tmp_path / "run"
    run_hlm("lora_finetune_distributed", "ecg_qlora", out, shards=shards, nproc=nproc,
            overrides=[*FINETUNE, f"pretrain_dir={pretrained}", "max_steps_per_epoch=15"])
    assert _drop(losses(out)) > 1.0
    assert json.loads((out / "metrics" / "run.json").read_text())["method"] == "qlora"
    if nproc is None:
        _eval(out, tmp_path / "eval")  # the merged NF4 export loads and classifies


@pytest.mark.parametrize("nproc", [None, 2])
def test_dpo_from_the_classifier(shards, lora_run, tmp_path, nproc):
    out = tmp_path / "run"
    run_hlm("lora_dpo_distributed", "ecg_dpo", out, shards=shards, nproc=nproc,
            overrides=[f"sft_dir={lora_run}", "batch_size=8", "dataset.num_examples=256", "max_steps_per_epoch=12",
                       "optimizer.lr=2e-3", "lr_scheduler.num_warmup_steps=1"])
    rows = [json.loads(x) for x in (out / "metrics" / "steps.jsonl").read_text().splitlines()]
    # step 1: policy == reference, every reward 0 (a tie); after it the margins must grow.
    assert abs(rows[0]["rewards/margins"]) < 1e-6
    assert rows[-1]["rewards/margins"] > 0 and rows[-1]["loss"] < rows[0]["loss"]
    if nproc is None:
        _eval(out, tmp_path / "eval")


@pytest.mark.parametrize("nproc", [None, 2])
def test_qat_writes_a_quantized_model_that_classifies(shards, pretrained, tmp_path, nproc):
    out = tmp_path / "run"
    run_hlm("qat_distributed", "ecg_qat", out, shards=shards, nproc=nproc,
            overrides=[*FINETUNE, f"pretrain_dir={pretrained}", "max_steps_per_epoch=12", "fake_quant_after_n_steps=2",
                       "optimizer.lr=2e-3"])
    assert _drop(losses(out)) > 0.5
    assert (out / "quantized" / "model-8da4w.pt").exists()
    if nproc is None:
        m = _eval(out, tmp_path / "eval", "--quantized", "--ptq-run", str(out))
        assert set(m["results"]) == {"float (QAT-trained)", "int4 weights, QAT", "int4 weights, post-training (no QAT)"}


@pytest.mark.parametrize("config", ["ecg_lora", "ecg_qlora"])
def test_torchtune_single_device_recipe_runs_the_config_unchanged(shards, pretrained, tmp_path, config):
    """The configs use only components and keys torchtune's own LoRA recipe understands."""
    tune = str(Path(sys.executable).with_name("tune"))
    out = tmp_path / "run"
    cmd = [tune, "run", "lora_finetune_single_device", "--config", str(CONFIGS / f"{config}.yaml"),
           f"shards_dir={shards['shards']}", f"split_file={shards['split_file']}", f"pretrain_dir={pretrained}",
           f"output_dir={out}", "max_steps_per_epoch=3", "batch_size=8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "epoch_0" / "model-00001-of-00001.bin").exists() and (out / "epoch_0" / "adapter_model.pt").exists()


def test_eval_refuses_a_run_trained_on_test_records(shards, lora_run, tmp_path):
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), f"dataset.records=[{shards['test'][0]}]"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "read only by `hlmtune eval`" in proc.stderr and "Traceback" not in proc.stderr


def test_random_beat_split_says_so_on_the_first_line(lora_run, tmp_path):
    """Asked for explicitly, a random beat split is evaluated on its held-out beats, and labelled."""
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "dataset.split=random", "--max-examples", "32",
                           "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].startswith("RANDOM BEAT SPLIT")
    assert (tmp_path / "report.md").read_text().startswith("**RANDOM BEAT SPLIT")
    assert json.loads((tmp_path / "metrics.json").read_text())["split_kind"] == "random_beats"


def test_af_evaluation_reports_af_f1(lora_run, tmp_path):
    """The AF task's report path: segments of RR tokens -> <af>/<not_af>, AF F1 in the JSON."""
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "dataset._component_=hlmtune.data_builders.ecg_af_dataset",
                           "--max-examples", "16", "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    r = m["results"]["HLM (this run)"]
    assert m["task"] == "af" and m["classes"] == ["AF", "not AF"] and "af_f1" in r and m["baselines"] == []
