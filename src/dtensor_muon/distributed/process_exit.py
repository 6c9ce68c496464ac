"""Ending a multi-process gloo run without CPython's interpreter finalization.

Why a run can abort after its work is done (traced in torch 2.13 / CPython 3.11, reproduced without this
library by ``tests/gloo_exit_abort.py``):

1. gloo's worker threads outlive ``dist.destroy_process_group()`` while anything still references the
   process group; with FSDP2, DTensor's caches (sharding propagation, redistribution plans, mesh topology)
   keep the ``DeviceMesh`` and its groups alive even after the model is deleted.
2. A worker thread that retires a collective frees the Work's tensors there. A tensor whose Python object
   died while the Work held it now owns that Python object, so freeing it takes the GIL on the worker thread.
3. Once CPython has started finalizing, a non-main thread that takes the GIL is ended with ``pthread_exit``.
   The forced unwind runs into the Work's destructor, which is ``noexcept``, and the C++ runtime calls
   ``std::terminate``: "terminate called without an active exception", SIGABRT, exit code -6.

So any collective that a worker retires while the interpreter finalizes can abort a run that did all its
work: seen with one left in flight that the peer completes late; inferred for one retired in the moment the
process exits.
:func:`exit_without_finalization` ends the process after the exit handlers but before finalization, where
no thread can be ended that way.
"""

import atexit
import os
import sys
from typing import NoReturn


def exit_without_finalization(exit_code: int = 0) -> NoReturn:
    """End the process like a normal exit, minus interpreter finalization.

    Call it after ``dist.destroy_process_group()`` (and ``opt.flush()`` with overlap), where a script would return
    from its main function after a successful run. In order: the ``atexit`` handlers (``logging.shutdown`` is
    one: log handlers are flushed and closed), a flush of ``sys.stdout`` and ``sys.stderr``, then
    ``os._exit(exit_code)``. What finalization would do after that, deleting the remaining objects (their
    ``__del__`` included), is skipped: that is the step where a gloo worker thread can abort the process.
    Let a failing run raise as usual, so that its traceback and non-zero exit code stay.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and not stream.closed:
            stream.flush()
    os._exit(exit_code)
