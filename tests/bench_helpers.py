"""Helpers of the benchmark tests: a ``benchmarks/`` script loaded as a module, and the check every
script reading ``$HLM_DATA`` shares."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the folder is not a package; as when the script runs, its
    folder is on ``sys.path`` for the benchmarks' shared modules, ``peers.py`` and ``training_patients.py``)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_needs_hlm_data(main: Callable, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``main([])`` refuses without ``$HLM_DATA``, and names ``$HLM_DATA/mitdb`` when it is missing."""
    monkeypatch.delenv("HLM_DATA", raising=False)
    with pytest.raises(SystemExit, match="set HLM_DATA"):
        main([])
    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    with pytest.raises(SystemExit, match=f"{tmp_path / 'mitdb'}: not a folder"):
        main([])
