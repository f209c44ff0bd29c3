"""A body stopped at a limit is reported by the limit's name (PIDs, memory, /tmp), not by the kernel's raw error."""

from __future__ import annotations

import errno

import cloudpickle

from dask_gpu.body.limit_names import LimitReached, limit_reached, name_the_limit


def test_a_fork_refused_eagain_is_the_pid_limit():
    exc = BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
    out = {"error_message": str(exc), "error_type": "builtins.BlockingIOError"}
    named = name_the_limit(out, exc)
    assert isinstance(named, LimitReached)
    assert out["error_message"].startswith("the body reached its process limit, PIDs")
    assert "body-pids" in out["error_message"] and "Fix: " in out["error_message"]
    assert out["error_type"] == "dask_gpu.body.limit_names.LimitReached"
    assert isinstance(cloudpickle.loads(cloudpickle.dumps(named)), LimitReached)  # travels to the flow as itself


def test_a_thread_refused_memory_and_a_full_tmp_are_named_and_other_errors_are_left_alone():
    assert "PIDs" in limit_reached(RuntimeError("can't start new thread"))
    assert "memory limit" in limit_reached(MemoryError())
    full = OSError(errno.ENOSPC, "No space left on device", "/tmp/big.bin")
    assert "/tmp is full" in limit_reached(full)
    assert limit_reached(OSError(errno.ENOSPC, "No space left on device", "/data/x")) is None
    assert limit_reached(ValueError("bad input")) is None
    other = ValueError("bad input")
    out = {"error_message": "bad input"}
    assert name_the_limit(out, other) is other and out == {"error_message": "bad input"}

