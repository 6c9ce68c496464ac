"""Reproduces the gloo abort at interpreter exit with torch alone, and shows the way around it.

    python tests/gloo_exit_abort.py                  # torch only: rank 0 ends with SIGABRT (exit code -6)
    python tests/gloo_exit_abort.py --end-with-helper   # rank 0 ends with dtensor_muon.exit_without_finalization

It starts two fresh processes of itself (gloo on CPU) and prints each one's exit code and output.

Rank 0 launches an all_reduce and drops its own references to the tensor and the Work, so only the queued gloo
Work holds the tensor (which thereby takes ownership of its Python object). Then rank 0 returns. Its last exit
handler, ``sum`` over a long range called from C, holds the GIL for about a second without running bytecode; a
handler before it writes a file, on which rank 1 launches its side of the all_reduce. Rank 0's gloo worker thread
completes the collective, frees the tensor, and waits for the GIL to free its Python object. After the exit
handlers CPython sets its finalizing flag and tears the modules down; a ``__del__`` that sleeps releases the GIL,
the worker thread takes it and is ended by CPython with ``pthread_exit`` inside the Work's destructor, which is
``noexcept``: "terminate called without an active exception". The exit handler and the ``__del__`` only make the
timing certain; in a real run the collective is one that finishes while the interpreter finalizes.

With ``--end-with-helper`` rank 0 instead ends with :func:`dtensor_muon.exit_without_finalization`: the exit
handlers run (rank 1 sees the file), output is flushed, and the process ends before finalization, with code 0.
Rank 1 always leaves before finalization (``os._exit`` after destroying its process group): it could otherwise
hit the same abort when rank 0's exit closes the connection while rank 1 finalizes.
"""

import atexit
import sys

if "--rank" in sys.argv:  # a rank, not the launcher or an importer
    atexit.register(sum, range(60_000_000))  # registered first, so it runs last: 1-2 s in C, holding the GIL

import os
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

END_WITH_HELPER = "--end-with-helper"
RANK1_WAIT_S = 120.0  # how long rank 1 waits for rank 0's exit handlers before it gives up
RUN_TIMEOUT_S = 240.0


class SleepsInTeardown:
    """Released with the ``__main__`` module during finalization; sleeping there releases the GIL."""

    def __del__(self, sleep=time.sleep) -> None:
        sleep(0.5)


def rank_main(rank: int, work_dir: Path, end_with_helper: bool) -> None:
    """One rank's side; see the module docstring."""
    dist.init_process_group(
        "gloo", init_method=f"file://{work_dir / 'init'}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    signal = work_dir / "rank0-exit-handlers-ran"
    if rank == 1:
        deadline = time.monotonic() + RANK1_WAIT_S
        while not signal.exists():
            if time.monotonic() > deadline:
                print("rank 1: rank 0's exit handlers never ran", flush=True)
                sys.exit(3)
            time.sleep(0.01)
        dist.all_reduce(torch.ones(1024))
        print("rank 1: all_reduce done", flush=True)
        # rank 1 is not the subject: it leaves before finalization, so rank 0's exit cannot abort it either
        dist.destroy_process_group()
        os._exit(0)
    tensor = torch.ones(1024)
    work = dist.all_reduce(tensor, async_op=True)
    del tensor, work  # the queued Work now holds the tensor's last reference
    atexit.register(signal.touch)  # runs just before the GIL-holding handler
    globals()["teardown"] = SleepsInTeardown()
    print("rank 0: returning with the all_reduce in flight")  # not flushed: the exit must flush it
    if end_with_helper:
        from dtensor_muon import exit_without_finalization

        exit_without_finalization()


def run_both(end_with_helper: bool) -> list[tuple[int, str]]:
    """Run ranks 0 and 1 as fresh processes; return each one's (exit code, output)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in (0, 1):
            cmd = [sys.executable, __file__, "--rank", str(rank), "--dir", tmp]
            cmd += [END_WITH_HELPER] if end_with_helper else []
            env = dict(os.environ, OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
        results = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                out, _ = proc.communicate()
                out += f"\n(killed after {RUN_TIMEOUT_S:.0f} s)"
            results.append((proc.returncode, out))
        return results


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main(
            int(sys.argv[sys.argv.index("--rank") + 1]),
            Path(sys.argv[sys.argv.index("--dir") + 1]),
            END_WITH_HELPER in sys.argv,
        )
    else:
        for rank, (code, output) in enumerate(run_both(END_WITH_HELPER in sys.argv)):
            print(f"--- rank {rank}: exit code {code}\n{output.rstrip()}")
