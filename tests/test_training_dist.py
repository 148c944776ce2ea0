"""Process-group helpers at world size 1 (multi-rank paths run in tests/test_recipes.py)."""

from __future__ import annotations

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
