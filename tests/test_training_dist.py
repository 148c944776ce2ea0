"""Process-group helpers at world size 1 (multi-rank training runs in tests/test_recipes.py), rank 0's
decision shared by two gloo ranks, and ranks that die with their launcher (a real 2-rank run, killed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hlmtune.training import dist as hd


def test_resolve_device():
    assert hd.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="device=cpu"):
            hd.resolve_device("cuda")
    with pytest.raises(RuntimeError, match="not supported"):
        hd.resolve_device("mps")


def test_plain_process_becomes_rank_zero_of_one(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    info = hd.init_distributed("cpu")
    try:
        assert (info.rank, info.world_size, info.nodes, info.backend) == (0, 1, 1, "gloo")
        assert info.is_rank_zero
        assert hd.all_gather_floats([1.5, 2.0], info.device) == [[1.5, 2.0]]
    finally:
        hd.teardown_distributed()
    # Unregistered but kept alive: gloo's destructor can deadlock on the GIL (dist.py).
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert hd.RETIRED_GROUPS and hd.RETIRED_GROUPS[-1] is not None
    retired = len(hd.RETIRED_GROUPS)
    hd.teardown_distributed()  # nothing to tear down: nothing kept
    assert len(hd.RETIRED_GROUPS) == retired


def _say_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        Path(out, str(rank)).write_text(hd.rank_zero_value(f"decided by rank {rank}"))
    finally:
        dist.destroy_process_group()


def test_rank_zero_value_is_rank_zeros_on_every_rank(tmp_path):
    assert hd.rank_zero_value({"onednn": True}) == {"onednn": True}  # no process group: itself
    torch.multiprocessing.spawn(_say_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    assert [(tmp_path / r).read_text() for r in ("0", "1")] == ["decided by rank 0"] * 2


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_ranks_die_with_a_killed_launcher_and_hold_their_output_dir(text_data_dir, tmp_path):
    """`kill -9 -- -PGID` of a 2-rank `hlmtune run` (a scheduler, a closed terminal): no rank survives.

    While the run lives, a second run into its output_dir is refused in one line (exit 2).
    """
    import os
    import signal
    import subprocess
    import time

    from proc_utils import alive, children
    from recipe_runner import COLLECTOR, HLMTUNE

    from hlmtune.tiny import write_tiny_assets

    model = tmp_path / "tiny"
    write_tiny_assets(model)
    out = tmp_path / "run"
    common = ["lora_finetune_distributed", "--config", "tiny_lora", f"model_dir={model}",
              f"data_dir={text_data_dir}", f"output_dir={out}", "batch_size=1"]
    launcher = subprocess.Popen(
        # epochs=1000: the run lives until killed, however slowly the second run starts on a loaded
        # host (one epoch of the stand-in data ended first once, and the second run then took the lock).
        [HLMTUNE, "run", "--nproc_per_node", "2", *common, "max_steps_per_epoch=100000", "epochs=1000",
         f"metric_logger._component_={COLLECTOR}", f"metric_logger.log_dir={out}/metrics"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ranks = []
    try:
        steps = out / "metrics" / "steps.jsonl"
        deadline = time.time() + 300
        while not (steps.exists() and steps.stat().st_size > 0) and launcher.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert launcher.poll() is None, "the run ended before it could be killed"
        ranks = children(launcher.pid)
        assert len(ranks) == 2, ranks

        second = subprocess.run([HLMTUNE, "run", *common, "max_steps_per_epoch=2"], capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"error: output_dir {out} is in use by a live run (pid {ranks[0]}" in second.stderr or \
            f"error: output_dir {out} is in use by a live run (pid {ranks[1]}" in second.stderr, second.stderr[-3000:]
        assert "Traceback" not in second.stderr

        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group only: ranks run in their own sessions
        launcher.wait()
        deadline = time.time() + 15
        while any(alive(r) for r in ranks) and time.time() < deadline:
            time.sleep(0.1)
        survivors = [r for r in ranks if alive(r)]
        assert not survivors, f"ranks {survivors} outlived their launcher"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for r in ranks:
            if alive(r):
                os.kill(r, signal.SIGKILL)
