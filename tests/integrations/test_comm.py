"""The one communication layer (``comm.py``): a step run on rank 0, or on every rank, ends the same way
on every rank. Two ranks are two threads over an in-process Comm (milliseconds, no process group);
the real torch.distributed paths run in the engine tests (test_writer, test_trainer_callback)."""

import threading

import pytest

from hf_ckpt_integrations.comm import Comm, WriteError
from hf_ckpt_integrations.errors import LayoutError


class _ThreadComm(Comm):
    """Rank ``rank`` of ``world`` threads sharing ``board`` (a dict) and ``gate`` (a Barrier)."""

    def __init__(self, rank, world, board, gate):
        self.rank, self.world, self.board, self.gate = rank, world, board, gate

    def broadcast(self, obj):
        if self.rank == 0:
            self.board["b"] = obj
        self.gate.wait()
        out = self.board["b"]
        self.gate.wait()
        return out

    def all_gather(self, obj):
        self.board[self.rank] = obj
        self.gate.wait()
        out = [self.board[r] for r in range(self.world)]
        self.gate.wait()
        return out

    def barrier(self):
        self.gate.wait()


def _on_ranks(step, world=2):
    """Run ``step(comm)`` on ``world`` threads; each rank's result or exception."""
    board, gate = {}, threading.Barrier(world, timeout=10)
    out = [None] * world

    def run(r):
        try:
            out[r] = ("ok", step(_ThreadComm(r, world, board, gate)))
        except Exception as e:
            out[r] = ("raised", e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_on_rank0_runs_once_and_every_rank_gets_the_result():
    calls = []
    out = _on_ranks(lambda comm: comm.on_rank0(lambda: calls.append(comm.rank) or "plan", "planning"))
    assert out == [("ok", "plan"), ("ok", "plan")] and calls == [0]


def test_on_rank0_failure_is_the_same_error_on_every_rank():
    def fail():
        raise LayoutError("ckpt: rank files of two saves")

    out = _on_ranks(lambda comm: comm.on_rank0(fail, "planning", "nothing was written"))
    assert [kind for kind, _ in out] == ["raised", "raised"]
    errors = [e for _, e in out]
    assert all(isinstance(e, WriteError) and e.failures == {0: "ckpt: rank files of two saves"} for e in errors)
    assert str(errors[0]) == str(errors[1])


def test_all_ok_names_every_failed_rank_on_every_rank():
    out = _on_ranks(lambda comm: comm.all_ok(OSError(28, "No space left") if comm.rank == 1 else None, "writing"))
    errors = [e for _, e in out]
    assert all(isinstance(e, WriteError) and set(e.failures) == {1} and "No space left" in e.failures[1]
               for e in errors)


def test_all_ok_passes_when_no_rank_failed():
    assert _on_ranks(lambda comm: comm.all_ok(None, "writing")) == [("ok", None), ("ok", None)]


def test_one_process_raises_the_original_error():
    """No other rank to tell: the error says precisely what is wrong (the CLI prints it)."""
    with pytest.raises(LayoutError, match="two saves"):
        Comm().on_rank0(lambda: (_ for _ in ()).throw(LayoutError("two saves")), "planning")
    with pytest.raises(OSError):
        Comm().all_ok(OSError(28, "full"), "writing")
    with pytest.raises(WriteError) as e:
        Comm().all_ok("a message", "writing")
    assert e.value.failures == {0: "a message"}


def test_the_device_a_backend_moves_is_read_from_the_backend():
    """gloo (and any "cpu:..." pair) moves CPU tensors; NCCL only CUDA ones (collective_device's rule)."""
    from hf_ckpt_integrations.comm import _device_types

    assert "cpu" in _device_types("gloo")
    assert _device_types("nccl") == ["cuda"]
    assert _device_types("cpu:gloo,cuda:nccl") == ["cpu", "cuda"]
