"""The launcher stop used by every engine run in the tests."""

import subprocess
import sys

from procs import wait_or_stop


def test_wait_or_stop_terminates_past_the_limit():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert wait_or_stop(proc, timeout=0.5, grace=5) is False
    assert proc.returncode is not None  # gone, not left running


def test_wait_or_stop_reports_a_normal_end():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert wait_or_stop(proc, timeout=30) is True and proc.returncode == 0
