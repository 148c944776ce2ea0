"""Shared pytest fixtures.

Real data (MIT-BIH, text samples) is found through the ``HLM_DATA`` environment variable
(``make test`` sets it to ``../shared/data``); tests that need it are skipped with a clear
reason when it is not set, never pointed at a hard-coded path.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest


def _data_root() -> Path | None:
    root = os.environ.get("HLM_DATA")
    return Path(root) if root else None


@pytest.fixture(scope="session")
def hlm_data() -> Path:
    """Root of the real data folder (``$HLM_DATA``)."""
    root = _data_root()
    if root is None:
        pytest.skip("HLM_DATA is not set: real-data tests need it (make test sets it)")
    if not root.is_dir():
        pytest.fail(f"HLM_DATA={root} is not a directory")
    return root


@pytest.fixture(scope="session")
def mitdb_dir(hlm_data: Path) -> Path:
    """The complete MIT-BIH Arrhythmia Database (``$HLM_DATA/mitdb``)."""
    path = hlm_data / "mitdb"
    if not (path / "100.hea").exists():
        pytest.fail(f"{path} does not hold MIT-BIH records (100.hea missing)")
    return path


@pytest.fixture(scope="session")
def text_data_dir(hlm_data: Path) -> Path:
    """Real samples of the text datasets (``$HLM_DATA/text``)."""
    path = hlm_data / "text"
    if not (path / "alpaca_cleaned.jsonl").exists():
        pytest.fail(f"{path} does not hold the text samples (alpaca_cleaned.jsonl missing)")
    return path


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Every test starts from the same RNG state."""
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover
        pass
