"""What every fuzz case runs under: a time limit and a capped address space, and the exported
tensors read back as bytes (shared by tests/trust/test_fuzz.py and tests/trust/test_fuzz_dcp.py)."""

import contextlib
import os
import resource
import signal
import sys

from hf_ckpt_integrations.verify import read_hf_dir

CASE_MEMORY = 2 * 2**30  # address space one case may add (a runaway allocation: MemoryError)


class Hang(Exception):
    pass


def _address_space():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))


@contextlib.contextmanager
def time_limit(seconds, memory=CASE_MEMORY):
    """SIGALRM raises in Python code; a hang inside C (hashing a DAG, ``re`` backtracking) never
    returns to Python, so faulthandler kills the whole run with every thread's stack at twice the
    limit. The address space is capped too, by ``memory`` bytes more than now (None: not capped),
    and restored afterwards."""
    import faulthandler

    def on_alarm(signum, frame):
        raise Hang(f"no result after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(2 * seconds, exit=True, file=sys.__stderr__)
    limits = resource.getrlimit(resource.RLIMIT_AS)
    capped = memory is not None and os.path.exists("/proc/self/status")
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory, limits[1]))
    try:
        yield
    finally:
        if capped:
            resource.setrlimit(resource.RLIMIT_AS, limits)
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def exported_tensors(dst):
    """``{name: (dtype, shape, bytes)}`` of the HF directory ``dst``."""
    out = {}
    for name, (path, dtype, shape, off, nbytes) in read_hf_dir(dst).items():
        with open(path, "rb") as fh:
            fh.seek(off)
            out[name] = (dtype, tuple(shape), fh.read(nbytes))
    return out
