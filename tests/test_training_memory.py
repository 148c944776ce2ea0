"""PeakMemory: a step's own peak vs the peak since process start (CPU: VmHWM and its reset)."""

from __future__ import annotations

import numpy as np
import pytest

from hlmtune.training.memory import PeakMemory, since_start_name

_MIB = 2**20


def _touch(mib: int) -> np.ndarray:
    a = np.ones(mib * _MIB // 8)  # written, so resident
    return a


def test_step_peak_is_the_steps_own_and_since_start_keeps_setup() -> None:
    tracker = PeakMemory("cpu")
    if not tracker.per_step:
        pytest.skip("this system does not let a process reset its RSS high-water mark (/proc/self/clear_refs)")
    setup = _touch(300)  # "model load": the largest allocation, before training
    del setup
    tracker.begin_step()
    big = _touch(120)
    del big
    s1 = tracker.end_step()
    tracker.begin_step()
    small = _touch(10)
    del small
    s2 = tracker.end_step()
    gib = 1 / 1024
    assert set(s1) == {"peak_rss_gib", "peak_rss_since_start_gib"}
    # Step 1 saw its 120 MiB, step 2 did not: each step peak is its own (reset in between).
    assert s1["peak_rss_gib"] - s2["peak_rss_gib"] > 100 * gib, (s1, s2)
    # Since start covers the 300 MiB setup that neither step saw.
    assert s2["peak_rss_since_start_gib"] - s1["peak_rss_gib"] > 150 * gib, (s1, s2)
    assert s2["peak_rss_since_start_gib"] == s1["peak_rss_since_start_gib"]
    assert s1["peak_rss_since_start_gib"] >= s1["peak_rss_gib"]


def test_names() -> None:
    assert since_start_name("peak_memory_alloc_gib") == "peak_memory_alloc_since_start_gib"
    assert PeakMemory("cuda").names == ("peak_memory_alloc_gib", "peak_memory_reserved_gib", "peak_memory_active_gib")
