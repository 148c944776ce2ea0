"""``hlmtune gpu-check`` on CPU: every check's command validates, the report writer's rows, the judges."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hlmtune import gpu_check
from hlmtune.gpu_check import Check, judge_compile, judge_cuda_memory, judge_training, run_checks


def _steps(run_dir: Path, rows) -> Path:
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics" / "steps.jsonl").write_text("".join(json.dumps({"step": i + 1, **r}) + "\n" for i, r in enumerate(rows)))
    return run_dir


def test_dry_run_builds_and_validates_every_check(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hlmtune.cli", "gpu-check", "--dry-run", "--out", str(tmp_path / "gc")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok ", "PROBLEM"))]
    names = [ln.split()[1].rstrip(":") for ln in lines]
    assert all(ln.startswith("ok ") for ln in lines)
    # every recipe on the tiny Llama3 in both dtypes; the HLM's shipped configs; the other groups
    for config in ("tiny_lora", "tiny_qlora", "tiny_lora_dpo", "tiny_full_dpo", "tiny_full", "tiny_qat", "tiny_qat_lora",
                   "ecg_pretrain", "ecg_lora", "ecg_qlora", "ecg_dpo", "ecg_qat"):
        assert {f"recipe/{config}/bf16", f"recipe/{config}/fp32"} <= set(names), config
    for name in ("torchrun/tiny_lora/fsdp2", "torchrun/tiny_full/fsdp2", "compile/default", "compile/reduce-overhead",
                 "collector/cuda-memory", "collector/table", "profile/nsys", "profile/torch", "bnb/paged-adamw8bit",
                 "torchtune/ecg_lora"):
        assert name in names
    assert f"{len(names)} check(s) built, {len(names)} config(s) valid" in proc.stdout
    assert "--nproc_per_node 1 lora_finetune_distributed --config" in proc.stdout  # torchtune's recipe, world size 1


def test_dry_run_reports_a_config_a_check_cannot_run(tmp_path):
    inputs = gpu_check.prepare_inputs(tmp_path, None)
    checks = gpu_check.build_checks(inputs, tmp_path, None)
    bad = next(c for c in checks if c.name == "recipe/tiny_lora/bf16")
    recipe, config, overrides = bad.validate
    bad.validate = (recipe, config, overrides + ["batch_sise=2"])
    results = dict(gpu_check.dry_run(checks))
    assert "batch_sise" in results["recipe/tiny_lora/bf16"] and "batch_size" in results["recipe/tiny_lora/bf16"]
    assert results["recipe/tiny_lora/fp32"] is None


def test_without_a_gpu_one_line_and_exit_2(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "hlmtune.cli", "gpu-check", "--out", str(tmp_path / "gc")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "gc" / "report.json").exists()


def test_report_rows_for_pass_fail_skip_killed_and_a_raising_judge(tmp_path):
    py = sys.executable
    seen = {}

    def report_so_far(_check):
        seen["rows"] = json.loads((tmp_path / "gc" / "report.json").read_text())
        return "pass", "read the report", {}

    def raises(_check):
        raise RuntimeError("judge broke")

    checks = [
        Check("a/pass", [py, "-c", "pass"]),
        Check("b/exit3", [py, "-c", "import sys; print('boom'); sys.exit(3)"]),
        Check("c/killed", [py, "-c", "import time; time.sleep(60)"], limit_s=1),
        Check("d/needs", [py, "-c", "pass"], needs="no-such-tool-hlmtune"),
        Check("e/after", [py, "-c", "pass"], after=("b/exit3",)),
        Check("f/raises", [py, "-c", "pass"], judge=raises),
        Check("g/midway", [py, "-c", "pass"], judge=report_so_far),
    ]
    rows = run_checks(checks, tmp_path / "gc", {"device": "test", "torch": "x"})
    status = {r["name"]: (r["status"], r["why"]) for r in rows}
    assert status["a/pass"] == ("pass", "exit 0")
    assert status["b/exit3"][0] == "fail" and "exit 3: boom" in status["b/exit3"][1]
    assert status["c/killed"] == ("fail", "killed at its time limit (1 s)")
    assert status["d/needs"] == ("skipped", "no-such-tool-hlmtune is not on PATH")
    assert status["e/after"] == ("skipped", "needs b/exit3 to pass first")
    assert status["f/raises"] == ("fail", "RuntimeError: judge broke")
    # written as checks finish: the 7th check saw the 6 rows before it, marked unfinished
    assert not seen["rows"]["finished"] and [r["name"] for r in seen["rows"]["checks"]] == [c.name for c in checks[:6]]
    body = json.loads((tmp_path / "gc" / "report.json").read_text())
    assert body["finished"] and body["counts"] == {"pass": 2, "fail": 3, "skipped": 2}
    md = (tmp_path / "gc" / "report.md").read_text()
    assert "Device: test" in md and "| c/killed | fail | killed at its time limit (1 s) |" in md
    assert "All checks ran: 2 pass, 3 fail, 2 skipped." in md


def test_judge_training_finite_and_falling(tmp_path):
    ok = _steps(tmp_path / "ok", [{"loss": v, "iteration_time_s": 0.1} for v in (3.0, 2.9, 2.5, 2.2)])
    flat = _steps(tmp_path / "flat", [{"loss": v} for v in (3.0, 3.0, 3.1, 3.0)])
    nan = _steps(tmp_path / "nan", [{"loss": v} for v in (3.0, float("nan"), 2.0, 1.0)])
    assert judge_training(True)(Check("x", [], run_dir=ok))[0] == "pass"
    assert judge_training(True)(Check("x", [], run_dir=flat))[:2] == ("fail", "loss did not fall in 4 steps (3.0000 -> 3.0000)")
    assert judge_training(False)(Check("x", [], run_dir=flat))[0] == "pass"
    assert judge_training(False)(Check("x", [], run_dir=nan))[1].startswith("loss not finite")


def test_judge_compile_tolerance(tmp_path):
    eager = _steps(tmp_path / "eager", [{"loss": 3.0, "iteration_time_s": 0.2}, {"loss": 2.9, "iteration_time_s": 0.2}])
    near = _steps(tmp_path / "near", [{"loss": 3.0 * (1 + 5e-4)}, {"loss": 2.9}])
    far = _steps(tmp_path / "far", [{"loss": 3.0 * (1 + 5e-3)}, {"loss": 2.9}])
    assert judge_compile(eager)(Check("c", [], run_dir=near))[0] == "pass"
    status, why, extra = judge_compile(eager)(Check("c", [], run_dir=far))
    assert status == "fail" and extra["loss_rel_diff"] == pytest.approx(5e-3)


def test_judge_cuda_memory(tmp_path):
    good = _steps(tmp_path / "good", [{"peak_memory_alloc_gib": 1.0, "peak_memory_reserved_gib": 1.5, "peak_memory_active_gib": 1.0}])
    inverted = _steps(tmp_path / "inv", [{"peak_memory_alloc_gib": 2.0, "peak_memory_reserved_gib": 1.5, "peak_memory_active_gib": 1.0}])
    missing = _steps(tmp_path / "miss", [{"peak_rss_gib": 1.0}])
    assert judge_cuda_memory(good, 80.0)(Check("m", []))[0] == "pass"
    assert judge_cuda_memory(good, 1.2)(Check("m", []))[1].startswith("reserved 1.500 GiB > device total")
    assert judge_cuda_memory(inverted, 80.0)(Check("m", []))[1].startswith("allocated > reserved")
    assert judge_cuda_memory(missing, 80.0)(Check("m", []))[1].startswith("missing in steps.jsonl: peak_memory_active_gib")


@pytest.mark.slow
def test_checks_run_as_built_on_cpu(tmp_path):
    # The commands the GPU will run, on CPU (device=cpu): tiny LoRA, the HLM pretraining and the
    # LoRA fine-tune that starts from it, then the table over them; judged by the real judges.
    inputs = gpu_check.prepare_inputs(tmp_path, None)
    checks = {c.name: c for c in gpu_check.build_checks(inputs, tmp_path, None)}
    chosen = [checks[n] for n in ("recipe/tiny_lora/fp32", "recipe/ecg_pretrain/fp32", "recipe/ecg_lora/fp32",
                                  "collector/table")]
    for c in chosen:
        c.argv = ["device=cpu" if a == "device=cuda" else a for a in c.argv]
    chosen[-1].judge = gpu_check.judge_table(tmp_path / "table" / "table.csv", at_least=3)
    rows = run_checks(chosen, tmp_path / "report", {"device": "cpu (test)"})
    assert [(r["name"], r["status"]) for r in rows] == [(c.name, "pass") for c in chosen], [r["why"] for r in rows]
    assert rows[0]["extra"]["steps"] == gpu_check.STEPS and rows[0]["extra"]["loss_last"] < rows[0]["extra"]["loss_first"]
