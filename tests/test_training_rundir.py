"""The run's output_dir: one live run holds it, stale locks are taken over, folder problems are RunErrors."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from hlmtune.training import rundir
from hlmtune.training.errors import RunError
from hlmtune.training.rundir import LOCK_NAME, OutputDirInUse, RunDirLock, check_run_dirs

_HOLDER = (
    "import sys, time\n"
    "from hlmtune.training.rundir import RunDirLock\n"
    "RunDirLock.acquire(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "time.sleep(300)\n"
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_run_holds_the_folder_until_it_dies(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirInUse) as e:
            RunDirLock.acquire(out)
        msg = str(e.value)
        assert f"pid {holder.pid} on {socket.gethostname()}" in msg and str(out / LOCK_NAME) in msg
        assert "another output_dir" in msg
        holder.send_signal(signal.SIGKILL)  # no cleanup: the lock file stays behind, stale
        holder.wait()
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid
        lock = RunDirLock.acquire(out)
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        again = RunDirLock.acquire(out)  # the same process: shared, not refused
        again.release()
        assert (out / LOCK_NAME).exists()
        lock.release()
        assert not (out / LOCK_NAME).exists()  # a finished run leaves no lock
    finally:
        if holder.poll() is None:
            holder.kill()


def test_without_flock_the_recorded_holder_decides(tmp_path, monkeypatch):
    """File systems without flock: a dead pid on this host is stale, a live or remote one is not."""
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "run"
    out.mkdir()
    cases = [({"pid": _dead_pid(), "host": socket.gethostname()}, True),
             ({"pid": os.getppid(), "host": socket.gethostname()}, False),
             ({"pid": _dead_pid(), "host": "another-node"}, False)]
    for owner, taken in cases:
        (out / LOCK_NAME).write_text(json.dumps(owner))
        if taken:
            RunDirLock.acquire(out).release()
        else:
            with pytest.raises(OutputDirInUse, match=f"pid {owner['pid']} on {owner['host']}"):
                RunDirLock.acquire(out)


def test_folder_problems_are_run_errors(tmp_path):
    taken = tmp_path / "file"
    taken.write_text("x")
    cfg = OmegaConf.create({"output_dir": str(taken), "metric_logger": {"log_dir": str(tmp_path / "m")}})
    with pytest.raises(RunError, match=f"output_dir {taken}: is a file"):
        check_run_dirs(cfg)
    with pytest.raises(RunError, match="is a file"):
        RunDirLock.acquire(taken / "sub")
    cfg = OmegaConf.create({"output_dir": str(tmp_path / "o"), "metric_logger": {
        "log_dir": "${output_dir}/metrics", "wrapped": {"log_dir": str(taken / "logs")}}})
    with pytest.raises(RunError, match=f"metric_logger.wrapped.log_dir {taken / 'logs'}: cannot be created: {taken} is a file"):
        check_run_dirs(cfg)
    cfg = OmegaConf.create({"output_dir": str(tmp_path / "o"), "resume_from_checkpoint": True})
    with pytest.raises(RunError, match="holds no complete checkpoint .* run without it to start fresh"):
        check_run_dirs(cfg)
    (tmp_path / "o" / "checkpoints" / "step_5").mkdir(parents=True)
    (tmp_path / "o" / "checkpoints" / "step_5" / "state.json").write_text("{}")
    check_run_dirs(cfg)
    assert not (tmp_path / "o" / LOCK_NAME).exists() and not rundir._HELD


@pytest.mark.slow
def test_recipe_reports_folder_problems_in_one_line(text_data_dir, tmp_path):
    """Through `hlmtune run`: no checkpoint to resume, and a DiskLogger log_dir under a file
    (its __del__ used to add an AttributeError hiding the first error)."""
    from recipe_runner import HLMTUNE

    from hlmtune.tiny import write_tiny_assets

    model = tmp_path / "tiny"
    write_tiny_assets(model)
    taken = tmp_path / "taken"
    taken.write_text("x")
    common = ["lora_finetune_distributed", "--config", "tiny_lora", f"model_dir={model}", f"data_dir={text_data_dir}",
              f"output_dir={tmp_path / 'run'}", "max_steps_per_epoch=2"]
    cases = {
        "holds no complete checkpoint": ["resume_from_checkpoint=True"],
        f"metric_logger.log_dir {taken}/logs: cannot be created: {taken} is a file": [
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger", f"metric_logger.log_dir={taken}/logs"],
    }
    for expected, overrides in cases.items():
        proc = subprocess.run([HLMTUNE, "run", *common, *overrides], capture_output=True, text=True, timeout=300)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and last.startswith("error: ") and expected in last, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "has no attribute '_file'" not in proc.stderr
