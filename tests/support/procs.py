"""Stopping a launcher cleanly when a test's time limit runs out (test support only)."""

import subprocess


def wait_or_stop(proc: subprocess.Popen, timeout: float, grace: float = 60) -> bool:
    """Wait up to ``timeout`` s for ``proc``; return True if it ended by itself.

    Past the limit: SIGTERM first — torchrun then stops its workers, which run in their own
    sessions and would outlive a SIGKILLed launcher, eating the CPU of every later test — and
    SIGKILL only if it is still there after ``grace`` s.
    """
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return False
