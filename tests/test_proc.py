"""hlmtune.proc: children that die with their parent, and callbacks before a fast exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proc_utils import child_outlives_a_killed_parent

from hlmtune.proc import child_dies_with_us

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux prctl")


def test_a_child_started_with_the_hook_dies_with_its_killed_parent(tmp_path):
    call = "import subprocess; from hlmtune.proc import child_dies_with_us; " \
           "subprocess.Popen(CMD, preexec_fn=child_dies_with_us()); import time; time.sleep(300)"
    assert not child_outlives_a_killed_parent(tmp_path, call)


def test_without_the_hook_the_child_outlives_its_parent(tmp_path):
    """The check above can fail: the same child, started plainly, trains on after its parent's kill -9."""
    call = "import subprocess; subprocess.Popen(CMD); import time; time.sleep(300)"
    assert child_outlives_a_killed_parent(tmp_path, call, timeout_s=2.0)


def test_the_hook_leaves_a_living_parent_s_child_alone(tmp_path):
    out = subprocess.run([sys.executable, "-c", "print('ran')"], preexec_fn=child_dies_with_us(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "ran\n"


def test_the_hook_is_absent_where_there_is_no_prctl(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert child_dies_with_us() is None


def test_a_child_whose_parent_died_before_the_hook_ran_kills_itself():
    """Between fork and prctl the parent may die, and then no signal comes: the hook sees a new parent."""
    code = ("import os; from hlmtune.proc import child_dies_with_us; arm = child_dies_with_us(); sent = []; "
            "os.getppid = lambda: 1; os.kill = lambda pid, sig: sent.append((pid == os.getpid(), sig)); "
            "arm(); print(sent)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[(True, 9)]", out.stderr
