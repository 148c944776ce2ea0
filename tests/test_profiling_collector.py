"""CollectorLogger: unit behaviour, and as the metric logger of torchtune's built-in recipe."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

from hlmtune.profiling import collector as collector_mod
from hlmtune.profiling.collector import CollectorLogger, infer_method, overrides_from_argv
from hlmtune.profiling.runs import load_run


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _ListLogger:
    """A minimal user logger that records what it receives."""

    def __init__(self) -> None:
        self.calls: List[Any] = []

    def log(self, name, data, step):
        self.calls.append(("log", name, data, step))

    def log_dict(self, payload, step):
        self.calls.append(("log_dict", dict(payload), step))

    def log_config(self, config):
        self.calls.append(("log_config",))

    def log_run_info(self, info):
        self.calls.append(("log_run_info", dict(info)))

    def close(self):
        self.calls.append(("close",))

    def custom(self):
        return "delegated"


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


def _steps(d: Path) -> List[Dict[str, Any]]:
    return [json.loads(l) for l in (d / "steps.jsonl").read_text().splitlines()]


def test_builtin_style_timing_memory_keys_and_forwarding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(collector_mod, "_now", clock)
    user = _ListLogger()
    log = CollectorLogger(log_dir=str(tmp_path / "m"), wrapped=user, warmup_steps=2)
    log.log_config({"log_every_n_steps": 2, "device": "cpu"})
    # torchtune built-in: logs every 2 steps, GiB memory keys without unit, per-GPU tokens/s.
    times = {2: 3.0, 4: 2.0, 6: 2.2, 8: 1.8}
    for step, dt in times.items():
        clock.t += dt
        payload = {"loss": 1.0, "lr": 0.1, "tokens_per_second_per_gpu": 50.0,
                   "peak_memory_alloc": 1.5, "peak_memory_reserved": 2.0, "peak_memory_active": 1.6}
        log.log_dict(payload, step=step)
    assert log.custom() == "delegated"  # unknown attributes go to the wrapped logger
    log.close()
    recs = _steps(tmp_path / "m")
    # First call has nothing to time against; then (delta between calls) / steps elapsed.
    assert recs[0]["iteration_time_s"] is None and recs[0]["steps_elapsed"] == 2
    assert [r["iteration_time_s"] for r in recs[1:]] == pytest.approx([1.0, 1.1, 0.9])
    assert all(r["iteration_time_source"] == "collector" for r in recs[1:])
    assert recs[1]["peak_memory_alloc_gib"] == 1.5 and recs[1]["peak_memory_alloc_gib_rank0"] == 1.5
    assert "peak_memory_alloc" not in recs[1]
    assert recs[1]["tokens_per_second"] == 50.0
    assert recs[1]["peak_rss_gib"] > 0.01 and recs[1]["peak_rss_gib_rank0"] == recs[1]["peak_rss_gib"]
    # The wrapped logger saw exactly the recipe's payloads, then close.
    sent = [c for c in user.calls if c[0] == "log_dict"]
    assert [c[2] for c in sent] == [2, 4, 6, 8] and "iteration_time_s" not in sent[0][1]
    assert user.calls[-1] == ("close",)
    s = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert s["complete"] is True
    post = [1.1, 0.9]  # steps 6 and 8 (> warmup 2)
    assert s["iteration_time_s_mean"] == pytest.approx(np.mean(post))
    assert s["iteration_time_s_p90"] == pytest.approx(np.percentile(post, 90))
    # total: timed records x steps, plus the untimed first record's 2 steps at the post-warmup mean
    assert s["total_time_s"] == pytest.approx(2 * (1.0 + 1.1 + 0.9) + 2 * 1.0)
    assert s["total_time_extrapolated_steps"] == 2
    assert s["peak_memory_reserved_gib"] == 2.0


def test_pack_recipe_keys_kept_and_run_info_wins(tmp_path: Path) -> None:
    user = _ListLogger()
    log = CollectorLogger(log_dir=str(tmp_path / "m"), wrapped=user, method="my_method")
    log.log_run_info({"recipe": "lora_finetune_distributed", "method": "lora", "world_size": 2, "batch_size": 4})
    log.log_dict({"iteration_time_s": 0.25, "tokens": 100, "peak_rss_gib": 2.0,
                  "peak_rss_gib_rank0": 2.0, "peak_rss_gib_rank1": 1.9}, step=1)
    log.close()
    (rec,) = _steps(tmp_path / "m")
    assert rec["iteration_time_s"] == 0.25 and rec["iteration_time_source"] == "recipe"
    assert rec["peak_rss_gib_rank1"] == 1.9 and rec["peak_rss_gib"] == 2.0
    run = json.loads((tmp_path / "m" / "run.json").read_text())
    assert run["method"] == "my_method"  # explicit constructor argument beats the recipe
    assert run["world_size"] == 2 and run["batch_size"] == 4 and run["run_info_from_recipe"] is True
    assert run["status"] == "closed" and run["versions"]["torch"] and run["versions"]["torchtune"] == "0.6.1"
    assert ("log_run_info", {"recipe": "lora_finetune_distributed", "method": "lora", "world_size": 2, "batch_size": 4}) in user.calls


def test_wrapped_spec_is_instantiated_and_config_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    monkeypatch.setattr(sys, "argv", ["lora_finetune_single_device.py", "--config", "x.yaml", "batch_size=4", "~profiler"])
    spec = {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(tmp_path / "logs"), "filename": "l.txt"}
    log = CollectorLogger(log_dir=str(tmp_path / "run1" / "metrics"), wrapped=spec)
    cfg = OmegaConf.create({
        "output_dir": str(tmp_path / "out"), "batch_size": 4, "gradient_accumulation_steps": 2, "device": "cpu", "dtype": "bf16",
        "model": {"_component_": "torchtune.models.llama3.qlora_llama3_8b"},
        "dataset": {"_component_": "torchtune.datasets.alpaca_cleaned_dataset", "packed": False},
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer", "prompt_template": "torchtune.data.GrammarErrorCorrectionTemplate"},
        "mirror": "${batch_size}",
    })
    log.log_config(cfg)
    log.log_dict({"loss": 2.0}, step=1)
    log.close()
    run = json.loads((tmp_path / "run1" / "metrics" / "run.json").read_text())
    assert run["run_name"] == "run1"
    assert run["recipe"] == "lora_finetune_single_device" and run["method"] == "qlora"
    assert run["model"] == "qlora_llama3_8b" and run["dataset"] == "alpaca_cleaned_dataset"
    assert run["template"] == "GrammarErrorCorrectionTemplate"
    assert run["overrides"] == ["batch_size=4", "~profiler"]
    assert run["config"]["mirror"] == 4  # resolved
    assert (run["batch_size"], run["gradient_accumulation_steps"], run["dtype"]) == (4, 2, "bf16")
    assert (tmp_path / "logs" / "l.txt").read_text().startswith("Step 1 | loss:2.0")
    assert (tmp_path / "out" / "torchtune_config.yaml").exists()  # DiskLogger.log_config still ran


def test_bad_wrapped_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="_component_"):
        CollectorLogger(log_dir=str(tmp_path), wrapped={"log_dir": "x"})
    with pytest.raises(TypeError, match="has no log\\(\\)"):
        CollectorLogger(log_dir=str(tmp_path), wrapped=object())
    with pytest.raises(ValueError, match="warmup_steps"):
        CollectorLogger(log_dir=str(tmp_path), warmup_steps=-1)


def test_non_zero_rank_only_forwards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    user = _ListLogger()
    log = CollectorLogger(log_dir=str(tmp_path / "m"), wrapped=user)
    log.log_dict({"loss": 1.0}, step=1)
    log.close()
    assert not (tmp_path / "m").exists()
    assert [c[0] for c in user.calls] == ["log_dict", "close"]


def test_killed_run_reads_as_partial_and_rerun_supersedes(tmp_path: Path) -> None:
    d = tmp_path / "m"
    log = CollectorLogger(log_dir=str(d))
    for i in range(1, 4):
        log.log_dict({"iteration_time_s": 0.5, "loss": 1.0}, step=i)
    # killed: no close(); the file was flushed line by line
    r = load_run(d)
    assert r["summary"]["complete"] is False and r["summary"]["steps"] == 3
    assert any("summary.json missing" in n for n in r["notes"])
    log._steps_f.close()
    (d / "api_summary.json").write_text("{}")  # a profile of the killed run
    log2 = CollectorLogger(log_dir=str(d))
    log2.log_dict({"iteration_time_s": 0.4}, step=1)
    log2.close()
    moved = list(d.glob("superseded-*"))
    assert len(moved) == 1 and len(_steps(moved[0])) == 3
    assert (moved[0] / "api_summary.json").exists() and not (d / "api_summary.json").exists()
    assert len(_steps(d)) == 1 and load_run(d)["summary"]["complete"] is True


def test_timing_and_tokens_per_second_against_the_wall_clock(tmp_path: Path) -> None:
    """Real clock, as under a built-in recipe: steps of known length and known token counts,
    timed by this test around the loop, never through the collector's own clock function."""
    import time

    sleeps = [0.03, 0.08, 0.02, 0.05, 0.04]
    tokens = [300, 120, 50, 400, 10]
    log = CollectorLogger(log_dir=str(tmp_path / "m"), warmup_steps=0)
    returned = []  # test's clock when each log_dict call returned
    for step, (d, n) in enumerate(zip(sleeps, tokens), start=1):
        t0 = time.perf_counter()
        time.sleep(d)  # the step's work
        recipe_t = time.perf_counter() - t0  # the recipe's own step timer (torchtune style)
        log.log_dict({"loss": 1.0, "tokens_per_second_per_gpu": n / recipe_t}, step=step)
        returned.append(time.perf_counter())
    log.close()
    recs = _steps(tmp_path / "m")
    timed = recs[1:]  # the first call has nothing to time against
    # Each gap holds its step's sleep and little else.
    for r, d in zip(timed, sleeps[1:]):
        assert d <= r["iteration_time_s"] < d + 0.02, (r["iteration_time_s"], d)
    # The gaps add up to the wall time between the first and the last call, measured here.
    wall = returned[-1] - returned[0]
    assert sum(r["iteration_time_s"] for r in timed) == pytest.approx(wall, abs=0.005)
    # tokens/s: the tokens of each step over a time no longer than the collector's gap.
    for r, n in zip(timed, tokens[1:]):
        assert n / r["tokens_per_second"] <= r["iteration_time_s"]
        assert n / r["tokens_per_second"] > 0.7 * r["iteration_time_s"]
    s = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert s["total_time_s"] >= wall


def test_own_memory_readings_step_vs_since_start_on_rank_0(tmp_path: Path) -> None:
    """A recipe that logs no memory (a built-in recipe on CPU): the collector's per-interval
    peak excludes what happened before the first step, the since-start peak includes it."""
    from hlmtune.training.memory import PeakMemory

    if not PeakMemory("cpu").per_step:
        pytest.skip("this system does not let a process reset its RSS high-water mark (/proc/self/clear_refs)")
    log = CollectorLogger(log_dir=str(tmp_path / "m"))
    setup = np.ones(300 * 2**20 // 8)  # "model load"
    del setup
    log.log_dict({"loss": 1.0}, step=1)
    step = np.ones(60 * 2**20 // 8)
    del step
    log.log_dict({"loss": 1.0}, step=2)
    log.log_dict({"loss": 1.0}, step=3)
    log.close()
    r1, r2, r3 = _steps(tmp_path / "m")
    # First record: its interval began inside setup, so only the since-start value.
    assert "peak_rss_gib" not in r1 and r1["peak_rss_since_start_gib"] > 0.25
    assert r2["peak_rss_gib"] - r3["peak_rss_gib"] > 40 / 1024  # step 2 saw its 60 MiB, step 3 did not
    assert r1["peak_rss_since_start_gib"] - r2["peak_rss_gib"] > 150 / 1024  # setup's peak is not a step's
    assert r3["peak_rss_since_start_gib"] >= r1["peak_rss_since_start_gib"]
    assert r3["peak_rss_gib_rank0"] == r3["peak_rss_gib"] and r3["memory_ranks"] == 1
    assert r3["memory_source_cpu"] == "collector"


def test_pack_recipe_memory_is_kept_and_covers_its_ranks(tmp_path: Path) -> None:
    log = CollectorLogger(log_dir=str(tmp_path / "m"))
    log.log_dict({"peak_rss_gib": 2.0, "peak_rss_since_start_gib": 3.0, "peak_rss_gib_rank0": 2.0,
                  "peak_rss_gib_rank1": 1.5, "peak_rss_since_start_gib_rank0": 3.0,
                  "peak_rss_since_start_gib_rank1": 2.5}, step=1)
    log.close()
    (r,) = _steps(tmp_path / "m")
    assert (r["peak_rss_gib"], r["peak_rss_since_start_gib"], r["memory_ranks"]) == (2.0, 3.0, 2)
    assert "memory_source_cpu" not in r  # the collector measured nothing itself


def test_helpers() -> None:
    assert infer_method("lora_finetune_distributed", "lora_llama3_8b") == "lora"
    assert infer_method("lora_finetune_single_device", "qlora_llama3_8b") == "qlora"
    assert infer_method("lora_dpo_distributed", "lora_llama3") == "lora_dpo"
    assert infer_method("full_finetune_distributed", "llama3_8b") == "full"
    assert infer_method("qat_distributed", "llama3_8b") == "qat"
    assert infer_method("my_recipe", None) == "my_recipe"
    assert overrides_from_argv(["r.py", "--config", "a=b.yaml", "x.y=1", "--flag", "~z"]) == ["x.y=1", "~z"]


# --------------------------------------------------------------------------- end to end
def _tiny_config(tmp_path: Path, data_file: Path) -> Path:
    from hlmtune.tiny import write_tiny_assets

    a = write_tiny_assets(tmp_path / "model")
    out = tmp_path / "out"
    cfg = f"""
output_dir: {out}
model:
  _component_: torchtune.models.llama3.lora_llama3
  lora_attn_modules: ['q_proj', 'v_proj']
  apply_lora_to_mlp: False
  lora_rank: 4
  lora_alpha: 8
  vocab_size: {a['vocab_size']}
  num_layers: {a['num_layers']}
  num_heads: {a['num_heads']}
  num_kv_heads: {a['num_kv_heads']}
  embed_dim: {a['embed_dim']}
  max_seq_len: {a['max_seq_len']}
  intermediate_dim: {a['intermediate_dim']}
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: {a['tokenizer_path']}
  special_tokens_path: {a['special_tokens_path']}
  max_seq_len: 128
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {a['model_dir']}
  checkpoint_files: [model.safetensors]
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: LLAMA3
resume_from_checkpoint: False
save_adapter_weights_only: True
dataset:
  _component_: torchtune.datasets.alpaca_dataset
  source: json
  data_files: {data_file}
  split: train
  packed: False
seed: 0
shuffle: True
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  fused: False
  lr: 3e-4
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 2
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
epochs: 1
max_steps_per_epoch: 4
gradient_accumulation_steps: 1
clip_grad_norm: null
compile: False
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
log_peak_memory_stats: False
device: cpu
dtype: fp32
enable_activation_checkpointing: False
enable_activation_offloading: False
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: False
"""
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg)
    return path


def _builtin_step_tokens(cfg_path: Path, *, batch_size: int, steps: int) -> List[int]:
    """Label tokens (not ignore_index) of each optimizer step's batch under torchtune's
    ``lora_finetune_single_device``: its sampler order, its dataset, its token rule."""
    import yaml
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
    from torchtune.datasets import alpaca_dataset
    from torchtune.models.llama3 import llama3_tokenizer

    cfg = yaml.safe_load(cfg_path.read_text())
    t = cfg["tokenizer"]
    tok = llama3_tokenizer(path=t["path"], special_tokens_path=t["special_tokens_path"], max_seq_len=t["max_seq_len"])
    d = cfg["dataset"]
    ds = alpaca_dataset(tok, source=d["source"], data_files=d["data_files"], split=d["split"], packed=False)
    sampler = StatefulDistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    order = list(sampler)
    return [sum(sum(1 for lab in ds[i]["labels"] if lab != -100) for i in order[k * batch_size:(k + 1) * batch_size])
            for k in range(steps)]


@pytest.mark.slow
def test_collector_under_torchtune_builtin_recipe(tmp_path: Path, text_data_dir: Path) -> None:
    """`tune run lora_finetune_single_device` with the collector set from the command line."""
    cfg = _tiny_config(tmp_path, text_data_dir / "alpaca_cleaned.jsonl")
    tune = Path(sys.executable).with_name("tune")
    cmd = [
        str(tune), "run", "lora_finetune_single_device", "--config", str(cfg),
        "metric_logger._component_=hlmtune.profiling.collector.CollectorLogger",
        f"metric_logger.log_dir={tmp_path / 'out' / 'metrics'}",
        "metric_logger.wrapped._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.wrapped.log_dir={tmp_path / 'out' / 'logs'}",
        "metric_logger.warmup_steps=1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t_wall = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    t_wall = time.perf_counter() - t_wall  # wall time around the whole run, measured here
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = tmp_path / "out" / "metrics"
    recs = _steps(m)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert {"loss", "lr", "tokens_per_second_per_gpu", "tokens_per_second", "peak_rss_since_start_gib",
                "peak_rss_since_start_gib_rank0"} <= set(r)
        assert 0.05 < r["peak_rss_since_start_gib"] < 64 and r["memory_ranks"] == 1  # rank 0 only
    assert all(0 < r["peak_rss_gib"] <= r["peak_rss_since_start_gib"] for r in recs[1:])
    # Independent count: the tokens of each step's batch, rebuilt from the recipe's sampler
    # (torchtune's: StatefulDistributedSampler, seed 0, 1 replica) and the same dataset.
    tokens = _builtin_step_tokens(cfg, batch_size=2, steps=4)
    timed = recs[1:]  # the first record has nothing to time against
    for r, n in zip(timed, tokens[1:]):
        # The recipe's own step timer runs inside the collector's gap between two log_dict calls:
        # tokens / tokens_per_second (the recipe's time) <= iteration_time_s, and close to it.
        assert n / r["tokens_per_second"] <= r["iteration_time_s"] * (1 + 1e-9)
        assert n / r["tokens_per_second"] > 0.6 * r["iteration_time_s"], (n, r)
    assert sum(r["iteration_time_s"] for r in timed) < t_wall
    assert recs[-1]["elapsed_s"] < t_wall
    run = json.loads((m / "run.json").read_text())
    assert run["status"] == "closed" and run["recipe"] == "lora_finetune_single_device"
    assert (run["method"], run["model"], run["dataset"]) == ("lora", "lora_llama3", "alpaca_dataset")
    assert run["batch_size"] == 2 and run["world_size"] == 1 and run["device"] == "cpu"
    assert "metric_logger._component_=hlmtune.profiling.collector.CollectorLogger" in run["overrides"]
    s = json.loads((m / "summary.json").read_text())
    post = [r["iteration_time_s"] for r in recs[1:]]
    assert s["complete"] is True and s["iteration_time_s_mean"] == pytest.approx(statistics.mean(post))
    assert s["iteration_time_s_median"] == pytest.approx(statistics.median(post))
    # The user's DiskLogger still got every step, unchanged.
    (disk,) = list((tmp_path / "out" / "logs").glob("log_*.txt"))
    lines = disk.read_text().strip().splitlines()
    assert [l.split(" |")[0] for l in lines] == ["Step 1", "Step 2", "Step 3", "Step 4"]
    assert f"loss:{recs[0]['loss']}" in lines[0]


def test_scalar_log_repeat_step_and_resumed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(collector_mod, "_now", clock)
    log = CollectorLogger(log_dir=str(tmp_path / "m"), warmup_steps=1)
    # A resumed run: the first logged step is 101 (log_every_n_steps 1): it covers one step.
    for step in (101, 102, 103):
        clock.t += 2.0
        log.log("val_loss", 0.5, step=step)  # joins the next record, never a timing record
        log.log_dict({"loss": 1.0}, step=step)
        clock.t += 0.5
        log.log_dict({"peak_rss_gib": 9.0}, step=step)  # extra record for the same step
    log.close()
    recs = _steps(tmp_path / "m")
    assert [(r["step"], r["steps_elapsed"]) for r in recs] == [(101, 1), (101, 0), (102, 1), (102, 0), (103, 1), (103, 0)]
    assert recs[0]["val_loss"] == 0.5 and recs[1]["iteration_time_s"] is None
    # timed from the previous *step*, the extra record in between does not shorten it
    assert recs[2]["iteration_time_s"] == pytest.approx(2.5) and recs[4]["iteration_time_s"] == pytest.approx(2.5)
    s = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert s["steps"] == 3 and s["timed_records"] == 2  # warmup = step 101, the run's first
    assert s["total_time_s"] == pytest.approx(2.5 * 3) and s["peak_rss_gib"] == 9.0


def test_process_cpu_time_counts_work_not_waiting(tmp_path: Path) -> None:
    """``process_cpu_s`` grows by the CPU work between two calls, not by time spent asleep."""
    import time

    log = CollectorLogger(log_dir=str(tmp_path / "m"), warmup_steps=0)
    log.log_dict({"loss": 1.0}, step=1)
    time.sleep(0.3)  # waiting: no CPU
    log.log_dict({"loss": 1.0}, step=2)
    t0 = time.process_time()
    x = 0
    while time.process_time() - t0 < 0.3:  # working: 0.3 s of CPU
        x += 1
    log.log_dict({"loss": 1.0}, step=3)
    log.close()
    recs = _steps(tmp_path / "m")
    cpu = [r["process_cpu_s"] for r in recs]
    assert cpu[1] - cpu[0] < 0.1, cpu
    assert 0.3 <= cpu[2] - cpu[1] < 0.5, cpu
