"""The gloo abort at interpreter exit: torch alone reproduces it; exit_without_finalization avoids it.

Both tests run ``tests/gloo_exit_abort.py`` (two fresh gloo processes; its docstring explains the timing):
rank 0 returns while gloo's worker thread still has to free a tensor that owns its Python object.
"""

import signal

import pytest
from gloo_exit_abort import run_both

pytestmark = pytest.mark.slow
ABORT_MESSAGE = "terminate called without an active exception"


def test_torch_alone_aborts_when_a_gloo_worker_frees_a_tensor_during_finalization():
    (code0, out0), (code1, out1) = run_both(end_with_helper=False)
    assert code1 == 0, out1
    assert code0 == -signal.SIGABRT and ABORT_MESSAGE in out0, (
        f"rank 0 exited with {code0}: if torch no longer aborts here, the exit_without_finalization workaround "
        f"(README, torchtitan_ext.train) may go\n{out0}"
    )


def test_exit_without_finalization_runs_exit_handlers_flushes_and_exits_zero():
    (code0, out0), (code1, out1) = run_both(end_with_helper=True)
    assert code0 == 0 and ABORT_MESSAGE not in out0, out0
    assert code1 == 0 and "all_reduce done" in out1, out1  # rank 1 waits for a file rank 0's exit handler writes
    assert "rank 0: returning with the all_reduce in flight" in out0, out0  # printed unflushed to a pipe
