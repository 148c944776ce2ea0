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
    # the same run again gives the same bytes: `hlmtune cv --baseline` compares fine-tunes from
    # pretrained models named by their checkpoint bytes, which a rerun must reproduce
    again = tmp_path / "again"
    run_hlm("full_finetune_distributed", "ecg_pretrain", again, shards=shards, nproc=2,
            overrides=[*PRETRAIN, "max_steps_per_epoch=20"])
    assert losses(again) == losses(out)
    assert (again / "epoch_0" / "model.pt").read_bytes() == (out / "epoch_0" / "model.pt").read_bytes()


def test_lora_learns_classes_and_eval_has_every_field(shards, lora_run, tmp_path):
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
    assert "reference annotations' R-peak positions" in m["notice"] and "QRS detector" not in report
    assert m["beats"] == {"positions": "annotations"}
    # per record: test patients only, their confusions adding up to the whole; predictions.npz
    # names the record of each beat
    import numpy as np

    by_rec = r["per_record"]
    assert set(by_rec) <= set(shards["test"]) and by_rec
    assert np.sum([v["confusion"] for v in by_rec.values()], axis=0).tolist() == r["confusion"]
    saved = np.load(tmp_path / "eval" / "predictions.npz")
    assert {str(x): int((saved["record"] == x).sum()) for x in set(saved["record"].tolist())} == \
        {rec: v["n"] for rec, v in by_rec.items()}
    assert "## Per record: HLM (this run)" in report and f"| {next(iter(by_rec))} |" in report
    # by the target beat's timing (ecg_lora reads normalized RR tokens): buckets add up to the
    # whole, and predictions.npz keeps each beat's ratio
    timing = r["by_timing"]
    assert set(timing) <= {"premature", "on_time", "unknown"} and "on_time" in timing
    assert np.sum([v["confusion"] for v in timing.values()], axis=0).tolist() == r["confusion"]
    ratio = saved["rr_ratio"]
    assert ratio.shape == (64,) and int((ratio < 0.8).sum()) == timing.get("premature", {"n": 0})["n"]
    assert "## By the target beat's timing: HLM (this run)" in report and "| on time (>= 0.8) |" in report


def test_lora_two_ranks(shards, pretrained, tmp_path):
    out = tmp_path / "run"
    run_hlm("lora_finetune_distributed", "ecg_lora", out, shards=shards, nproc=2,
            overrides=[*FINETUNE, f"pretrain_dir={pretrained}", "max_steps_per_epoch=15"])
    assert _drop(losses(out)) > 1.0
    # reproduced bit for bit (the adapters of a rerun), as hlmtune cv's comparisons assume
    again = tmp_path / "again"
    run_hlm("lora_finetune_distributed", "ecg_lora", again, shards=shards, nproc=2,
            overrides=[*FINETUNE, f"pretrain_dir={pretrained}", "max_steps_per_epoch=15"])
    assert losses(again) == losses(out)
    assert (again / "epoch_0" / "adapter_model.pt").read_bytes() == (out / "epoch_0" / "adapter_model.pt").read_bytes()


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
           "extra_records=null",
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


def _member(lora_run: Path, root: Path, *, noise: float, **dataset) -> Path:
    """A second "run" of the same config: the LoRA run's merged weights plus seeded noise."""
    import torch
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(lora_run / "torchtune_config.yaml")
    cfg.output_dir = str(root)
    for k, v in dataset.items():
        cfg.dataset[k] = v
    (root / "epoch_0").mkdir(parents=True)
    OmegaConf.save(cfg, root / "torchtune_config.yaml")
    sd = torch.load(lora_run / "epoch_0" / "model-00001-of-00001.bin", map_location="cpu", weights_only=True)
    g = torch.Generator().manual_seed(3)
    sd = {k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1 else v
          for k, v in sd.items()}
    torch.save(sd, root / "epoch_0" / "model-00001-of-00001.bin")
    return root


def test_ensemble_predicts_the_class_of_highest_mean_log_probability(shards, lora_run, tmp_path):
    """The ensemble's confusion matrix (and its calibrated one, and predictions.npz) against a
    one-prompt-at-a-time reference over both models."""
    import numpy as np
    import torch
    from torchtune import config

    from hlmtune.hlm import calibrate as cal
    from hlmtune.hlm import evaluate as ev

    other = _member(lora_run, tmp_path / "seed1", noise=2.0)
    cfg = ev.load_run_config(str(lora_run), [])
    _, ds, _, _, _ = ev._test_dataset(cfg, config.instantiate(cfg.tokenizer), "DS2")
    classes = list(ds.classes)
    bias = [0.0, 1.5, -0.75, 0.5, 0.25][: len(classes)]
    calibration = tmp_path / "calibration.json"
    cal.write_calibration(calibration, classes=classes, bias=bias, records=shards["train"], source="test", summary={})
    m = _eval(lora_run, tmp_path / "eval", "--max-examples", "96", "--ensemble", str(other),
              "--calibration", str(calibration))
    names = m["row_order"]
    assert m["result"] == names[0] and sorted(m["results"]) == sorted(names)
    assert names == ["HLM ensemble of 2 runs (mean class log-prob) + class bias fitted on DS1 CV",
                     "HLM ensemble of 2 runs (mean class log-prob)", "member 1 (run)", "member 2 (seed1)"]
    assert m["calibration"] == str(calibration)
    names = names[1:]
    assert m["ensemble"] == [str(lora_run / "epoch_0" / "model-00001-of-00001.bin"),
                             str(other / "epoch_0" / "model-00001-of-00001.bin")]
    # reference: each prompt alone through each model, log-softmax over the class tokens, mean, argmax
    choices = [ds.vocab.label_base + ds.vocab.classes.index(c) for c in classes]
    n = m["n_examples"]
    lps = []
    for run in (lora_run, other):
        model = ev.load_model(cfg, run / "epoch_0" / "model-00001-of-00001.bin")
        with torch.inference_mode():
            lps.append(torch.stack([torch.log_softmax(model(torch.tensor([ds.prompt(k)]))[0, -1, choices], -1)
                                    for k in range(n)]))
    truth = [classes.index(ds.label_of(k)) for k in range(n)]
    want = [[0] * len(classes) for _ in classes]
    for t, p in zip(truth, ((lps[0] + lps[1]) / 2).argmax(-1).tolist()):
        want[t][p] += 1
    assert m["results"][names[0]]["confusion"] == want
    singles = [[[0] * len(classes) for _ in classes] for _ in lps]
    for lp, conf in zip(lps, singles):
        for t, p in zip(truth, lp.argmax(-1).tolist()):
            conf[t][p] += 1
    assert [m["results"][x]["confusion"] for x in names[1:]] == singles
    assert singles[0] != singles[1]  # the members disagree somewhere: the mean decides something
    assert "Mean over the 2 runs" in (tmp_path / "eval" / "report.md").read_text()
    # calibrated: argmax of the mean plus the file's bias
    calibrated = [[0] * len(classes) for _ in classes]
    for t, p in zip(truth, (((lps[0] + lps[1]) / 2) + torch.tensor(bias)).argmax(-1).tolist()):
        calibrated[t][p] += 1
    assert m["results"][m["result"]]["confusion"] == calibrated != want
    # predictions.npz: every row's log-probabilities per test beat, in the results' order
    saved = np.load(tmp_path / "eval" / "predictions.npz")
    assert saved["rows"].tolist() == m["row_order"] and saved["truth"].tolist() == truth
    mean = ((lps[0] + lps[1]) / 2).numpy()
    for got, ref in zip(saved["logprobs"], (mean + np.array(bias, dtype=np.float32), mean, lps[0].numpy(), lps[1].numpy())):
        assert np.allclose(got, ref, atol=1e-4)
    # a bias fitted on a test patient is refused before any model runs
    cal.write_calibration(calibration, classes=classes, bias=bias, records=[shards["test"][0]], source="t", summary={})
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--calibration", str(calibration)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and shards["test"][0] in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_ensemble_refuses_members_built_for_other_prompts_or_trained_on_test_records(shards, lora_run, tmp_path):
    other = _member(lora_run, tmp_path / "ctx", noise=0.0, context_beats=3)
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--max-examples", "8", "--ensemble", str(other)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"--ensemble {other}: its test prompts differ" in proc.stderr and "dataset.context_beats" in proc.stderr
    # command-line overrides apply to every run of the ensemble: the member is then built alike
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "dataset.context_beats=16", "--max-examples", "8",
                           "--out", str(tmp_path / "same"), "--ensemble", str(other)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    leaky = _member(lora_run, tmp_path / "leak", noise=0.0, records=[shards["test"][0]])
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--ensemble", str(leaky)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "read only by `hlmtune eval`" in proc.stderr
    for bad, why in ((tmp_path, "not a run folder"), (lora_run, "already in the ensemble")):
        proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--ensemble", str(bad)],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr[-2000:]


def test_eval_on_a_folder_of_another_rate_and_database_and_its_refusals(shards, lora_run, tmp_path):
    """--test-records: 128 Hz svdb-style records score with ids of their folder; a copy of a
    training record under another name is refused by its signal."""
    import shutil

    from hlm_fixtures import svdb_style_folder

    folder = svdb_style_folder(tmp_path / "otherdb", names=("900", "901"), seconds=90)
    out = tmp_path / "eval"
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--test-records", str(folder),
                           "--max-examples", "48", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["test_split"] == f"records of {folder}" and m["test_databases"] == ["otherdb"]
    assert "tested on 2 records of otherdb" in m["notice"] and "128 Hz" in m["notice"]
    assert set(m["results"][m["result"]]["per_record"]) <= {"otherdb/900", "otherdb/901"}
    assert m["test_records_dropped"] >= 2  # each record's annotation past the end
    copy = tmp_path / "copydb"
    copy.mkdir()
    rec = shards["train"][0]
    for ext in ("hea", "dat", "atr"):
        shutil.copyfile(Path(shards["db"]) / f"{rec}.{ext}", copy / f"{rec}.{ext}")
    bad = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--test-records", str(copy),
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode == 2 and f"same signal as test records ({rec} = copydb/{rec})" in bad.stderr, bad.stderr
    assert "--skip-trained-records scores the folder's other records" in bad.stderr
    # --skip-trained-records: the folder's other records are scored, the trained one is named
    other = svdb_style_folder(tmp_path / "other", names=("902",), seconds=90)
    for ext in ("hea", "dat", "atr"):
        shutil.copyfile(other / f"902.{ext}", copy / f"902.{ext}")
    (copy / "RECORDS").write_text(f"{rec}\n902\n")
    out = tmp_path / "skip"
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--test-records", str(copy), "--max-examples",
                           "24", "--skip-trained-records", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["test_records_left_out"] == [f"copydb/{rec}"]
    assert set(m["results"][m["result"]]["per_record"]) == {"copydb/902"}
    assert "tested on 1 records of copydb" in m["notice"]
    assert f"1 more left out because the run trained on them (copydb/{rec})" in m["notice"]
    only = tmp_path / "onlytrained"
    only.mkdir()
    for ext in ("hea", "dat", "atr"):
        shutil.copyfile(Path(shards["db"]) / f"{rec}.{ext}", only / f"{rec}.{ext}")
    none_left = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--test-records", str(only),
                                "--skip-trained-records", "--out", str(tmp_path / "none")], capture_output=True, text=True)
    assert none_left.returncode == 2 and "the run trained on every record of it" in none_left.stderr, none_left.stderr


def test_eval_on_detected_beats_scores_every_reference_beat_once(shards, lora_run, tmp_path):
    """--beats detector through the CLI: the test records tokenized again with the gqrs detector's
    beats; every scored reference beat is classified once or missed (the "no beat" column), every
    detection without a reference beat is an extra (the "no beat" row), and the report says so."""
    import numpy as np

    out = tmp_path / "eval"
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), "--beats", "detector", "--out", str(out)],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    b = m["beats"]
    assert (b["positions"], b["detector"], b["window_s"]) == ("detector", "gqrs", 0.15)
    assert b["sensitivity"] > 0.9 and b["positive_predictivity"] > 0.9, b  # gqrs finds these records' beats
    r = m["results"][m["result"]]
    c = len(m["classes"])
    conf = np.array(r["confusion"])  # (C + 1, C + 1): truth x prediction, index C = "no beat"
    assert conf.shape == (c + 1, c + 1) and conf[c, c] == 0
    assert conf[:c, c].sum() == b["missed"] and conf[:c, :c].sum() == b["matched"]
    assert conf[c, :c].sum() == b["extra"]
    # the same stretch of the same records as the annotation-mode test set (the test shards' sampto):
    # as many reference beats of the scored classes, up to a beat or two at each record edge
    from hlmtune.ecg_tokenizer.shards import read_manifest

    test = [x for x in read_manifest(Path(shards["shards"]))["records"] if x["record"] in shards["test"]]
    annotated = sum(x["label_counts"].get(k, 0) for x in test for k in m["classes"])
    assert abs(b["matched"] + b["missed"] - annotated) <= 2 * len(test), (b, annotated)
    assert "beats found by the gqrs QRS detector, matched to the reference beats within 150 ms" in m["notice"]
    found = f"the gqrs QRS detector found {b['matched']} of the {b['matched'] + b['missed']} reference beats"
    assert found in (out / "report.md").read_text().split("\n## ", 1)[0]  # above the tables
    assert (out / "confusion.csv").read_text().splitlines()[0].endswith(",no beat")


def test_an_ensemble_of_seeds_evaluates_on_detected_beats_and_on_another_folder(shards, lora_run, tmp_path):
    """A job's seed runs (another ``dataset.seed``: the same test prompts) make one ensemble with
    --beats detector and with --test-records: each member's test set is built from the same beats
    as the first run's (detected ones, or the folder's), not from the annotated test split."""
    from hlm_fixtures import svdb_style_folder

    seed1 = _member(lora_run, tmp_path / "seed1", noise=0.5, seed=1)
    folder = svdb_style_folder(tmp_path / "otherdb", names=("900",), seconds=60)
    for mode, extra in (("detector", ("--beats", "detector")), ("folder", ("--test-records", str(folder)))):
        m = _eval(lora_run, tmp_path / mode, "--ensemble", str(seed1), *extra)
        assert m["row_order"][:3] == ["HLM ensemble of 2 runs (mean class log-prob)", "member 1 (run)",
                                      "member 2 (seed1)"], (mode, m["row_order"])
        if mode == "detector":
            assert m["beats"]["positions"] == "detector" and m["beats"]["matched"] > 0
        else:
            assert m["test_databases"] == ["otherdb"]


def test_a_run_with_the_second_lead_trains_and_evaluates_in_every_mode(shards, pretrained, tmp_path):
    """dataset.second_lead through the real CLI: the fine-tune's prompts carry the second lead's
    samples (32 more tokens), its loss falls, `hlmtune eval` scores the test records and a folder of
    another database (tokenized with its second lead), and a folder whose records have one lead is
    refused with the record named."""
    import wfdb

    from hlm_fixtures import svdb_style_folder

    run = tmp_path / "run"
    run_hlm("lora_finetune_distributed", "ecg_lora", run, shards=shards,
            overrides=[*FINETUNE, f"pretrain_dir={pretrained}", "max_steps_per_epoch=20", "dataset.second_lead=32"])
    assert _drop(losses(run)) > 1.0
    m = _eval(run, tmp_path / "eval")
    assert m["n_examples"] == 64 and m["train_records"]
    folder = svdb_style_folder(tmp_path / "otherdb", names=("900",), seconds=60)
    m = _eval(run, tmp_path / "eval_other", "--test-records", str(folder))
    assert set(m["results"][m["result"]]["per_record"]) == {"otherdb/900"}
    lead2 = json.loads((tmp_path / "eval_other" / "test_tokens" / "manifest.json").read_text())["records"][0]["lead2"]
    assert lead2 == "ECG2"
    one = tmp_path / "onelead"
    one.mkdir()
    rec, ann = wfdb.rdrecord(str(folder / "900")), wfdb.rdann(str(folder / "900"), "atr")
    wfdb.wrsamp("950", fs=128, units=["mV"], sig_name=["ECG1"], p_signal=rec.p_signal[:, :1], fmt=["212"],
                write_dir=str(one))
    wfdb.wrann("950", "atr", ann.sample[:-1], symbol=ann.symbol[:-1], write_dir=str(one))
    bad = subprocess.run([HLMTUNE, "eval", "--config", str(run), "--test-records", str(one), "--out",
                          str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode != 0 and "onelead/950: second_lead needs a second signal" in bad.stderr, bad.stderr[-2000:]


def test_the_header_describes_what_the_run_trained_on_not_the_override(shards, lora_run, tmp_path):
    """An evaluation-time split override changes the test records, not what the run trained on."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"DS1": list(shards["train"][:1]), "DS2": list(shards["test"])}))
    proc = subprocess.run([HLMTUNE, "eval", "--config", str(lora_run), f"dataset.split_file={other}",
                           "--max-examples", "16", "--out", str(tmp_path / "e")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert m["notice"].startswith(f"Inter-patient evaluation: trained on {len(shards['train'])} records")
    assert len(m["train_records"]) == len(shards["train"])
