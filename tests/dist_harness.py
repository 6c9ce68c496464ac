"""Runs a function on N real gloo processes and collects what each returns.

Two devices: ``device="cpu"`` (the default), and ``device="cuda"``, where every rank of the call shares
``cuda:0`` (gloo takes CUDA tensors for the collectives the library uses; NCCL refuses two ranks on one GPU).
A function asks :func:`worker_device` which one it runs on; :data:`DEVICES` parametrizes a test over both,
the CUDA case skipped where no GPU is present. Workers run torch on one CPU thread, so CPU results are
comparable bit for bit with a one-process reference computed on one thread (:func:`one_thread`).

Starting a process and initializing gloo takes seconds on a small machine, so the processes are kept: per
world size, a pool of workers with gloo initialized is started at first use and reused by every later call
of the pytest run. Between calls each worker puts back what a function may have changed (default dtype,
thread count, grad mode, environment, working directory, warning filters, DTensor caches; torch's global RNG
gets a new non-deterministic seed, as in a fresh process) and destroys the process groups the function
created, so a call sees what a freshly spawned process would. Pooled workers are forked from a server
process that imported torch once, and see the environment of the test process as it was when that server
started.

A call is bounded by ``timeout``: past it the workers are killed and the call raises. If ``fn`` raises on
any rank, the call raises with that rank's traceback and the pool is discarded (the other ranks may be
stuck in a collective); the next call starts a new one. ``fresh=True`` runs on processes of their own,
ended after the call and spawned (not forked) with the test process's current environment: for functions
that leave a process in a state no later call should see, or that need what a new interpreter starts with.
A function that destroys the default process group ends its workers (and so its pool) after returning.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import os
import pickle
import random
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300.0
"""Bound of one call (and, separately, of starting a pool): pooled calls here take up to half a minute."""
PROCESS_GROUP_TIMEOUT_S = 120.0
"""gloo's own timeout: a collective that waits longer raises on its rank."""
ERROR_GRACE_S = 3.0
"""After one rank raised, how long the others may take to report their own errors before the pool is killed."""
MAX_POOLED_WORKERS = 20
"""Idle workers kept over all world sizes; the least recently used pools are closed beyond this."""

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the ranks share cuda:0 over gloo)"
)
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
"""``@pytest.mark.parametrize("device", DEVICES)``: a distributed test on CPU workers and on CUDA workers."""

_worker_device = torch.device("cpu")


def worker_device() -> torch.device:
    """The device of this worker's tensors and meshes: ``cuda:0`` in a CUDA pool, else the CPU."""
    return _worker_device


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a DTensor (a plain tensor as it is), on the CPU. On CUDA workers the local pieces are
    gathered as CPU tensors over a CPU mesh of the same ranks: DTensor's own all-gather of CUDA tensors over
    gloo (``full_tensor()``) crashes the process in torch 2.11."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu()
    if tensor.device_mesh.device_type == "cpu":
        return tensor.full_tensor()
    return gathered_over_a_cpu_mesh(tensor)


def gathered_over_a_cpu_mesh(tensor: Any) -> torch.Tensor:
    """A DTensor's whole value, gathered from its local pieces copied to the CPU, over a CPU mesh of the
    same ranks (made once per mesh and call). The CPU mesh reuses the mesh's own gloo groups
    (``DeviceMesh.from_group``): building it anew would call ``new_group``, which every rank of the world must
    enter with the same ranks, and the ranks of a sub-mesh (experts on {0, 1} and on {2, 3}) do not."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    mesh = tensor.device_mesh
    cached = _CPU_MESHES.get(id(mesh))
    if cached is None or cached[0] is not mesh:
        groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
        on_cpu_mesh = DeviceMesh.from_group(
            groups[0] if mesh.ndim == 1 else groups, "cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names
        )
        cached = _CPU_MESHES[id(mesh)] = (mesh, on_cpu_mesh)
    local = tensor.to_local().detach().cpu()
    on_cpu = DTensor.from_local(local, cached[1], tensor.placements, shape=tensor.shape, stride=tensor.stride())
    return on_cpu.full_tensor()


_CPU_MESHES: dict[int, tuple[Any, Any]] = {}
"""CUDA mesh id → (that mesh, a CPU mesh of the same ranks), for :func:`full_tensor`; emptied after each call."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread, as the workers do: CPU matrix products can round differently with
    another thread count, so a one-process reference is computed under this to compare bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class DistributedRunError(RuntimeError):
    """A distributed call failed: a rank raised or died, or the call ran past its deadline."""


# ---------------------------------------------------------------- worker side
@dataclass
class _ProcessState:
    """What a called function may change in a worker and the next call must not see."""

    dtype: torch.dtype
    threads: int
    grad_enabled: bool
    deterministic: bool
    environ: dict[str, str]
    cwd: str
    warning_filters: list = field(default_factory=list)

    @classmethod
    def capture(cls) -> _ProcessState:
        return cls(
            dtype=torch.get_default_dtype(),
            threads=torch.get_num_threads(),
            grad_enabled=torch.is_grad_enabled(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            environ=dict(os.environ),
            cwd=os.getcwd(),
            warning_filters=list(warnings.filters),
        )

    def restore(self) -> None:
        _reseed()
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(self.grad_enabled)
        torch.use_deterministic_algorithms(self.deterministic)
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.chdir(self.cwd)
        warnings.filters[:] = self.warning_filters
        # forget which warnings were already shown, as a new process would
        mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
        if mutated is not None:
            mutated()


def _reseed() -> None:
    """New non-deterministic seeds for torch's and Python's global RNGs, as a freshly spawned process has
    (forked workers would otherwise share the server's)."""
    torch.seed()
    random.seed()


def _clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches, which hold device meshes (and so their process groups) strongly."""
    from torch.distributed.tensor import _random, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    _random._rng_tracker = None


def _process_groups() -> list[dist.ProcessGroup]:
    """Every process group this rank belongs to, the default one included."""
    return list(dist.distributed_c10d._world.pg_map)


def _destroy_groups_since(known: set[dist.ProcessGroup]) -> None:
    """Destroy the groups created after ``known`` was taken (meshes' and ``new_group``'s): each holds
    gloo threads and sockets, and one pytest run creates hundreds."""
    for group in _process_groups():
        if group not in known:
            dist.destroy_process_group(group)


def _warm_up() -> None:
    """Import what the tests' functions use, then exempt everything alive from garbage collection: a full
    collection after each call then scans only what calls created (milliseconds instead of a fifth of a
    second per process)."""
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401

    with contextlib.suppress(Exception):  # a library that fails to import fails in the call, with its traceback
        import dtensor_muon  # noqa: F401
    gc.collect()
    gc.freeze()


def _call(rank: int, world_size: int, request: bytes, state: _ProcessState, groups: set) -> bool:
    """One request: run the function, save its result, then put the process back as it was. False when the
    function destroyed the default process group: this process cannot serve another call."""
    fn, args, out_path, timeout = pickle.loads(request)
    faulthandler.dump_traceback_later(max(1.0, 0.95 * timeout))  # a hang prints this rank's stacks
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, out_path)
        del result
        if not dist.is_initialized():
            return False
        dist.barrier()  # every rank has left its collectives before any group is torn down
        _CPU_MESHES.clear()
        _clear_dtensor_caches()
        gc.collect()  # optimizers, meshes and the Works they hold go before their groups
        if torch.cuda.is_initialized():  # an idle worker keeps its CUDA context, not the call's cached blocks
            torch.cuda.empty_cache()
        _destroy_groups_since(groups)
        state.restore()
        dist.barrier()
        return True
    finally:
        faulthandler.cancel_dump_traceback_later()


def _serve(rank: int, world_size: int, init_file: str, conn: Connection, pg_timeout_s: float, device: str) -> None:
    """Worker loop: initialize gloo, then run requests until told to stop or the test process is gone."""
    global _worker_device
    faulthandler.enable()  # a crash inside torch/gloo prints every thread's Python stack
    _reseed()
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)  # before any mesh: DeviceMesh takes the current device of its type
        _worker_device = torch.device("cuda", 0)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )  # fmt: skip
    state = _ProcessState.capture()
    groups = set(_process_groups())
    _warm_up()
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:  # the test process ended without closing the pool
            _exit()
        if not request:
            break
        try:
            reusable = _call(rank, world_size, request, state, groups)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            continue  # the test process kills this pool
        conn.send(("ok" if reusable else "spent", None))
        if not reusable:
            _exit()
    dist.barrier()  # every rank is here before any closes its connections
    dist.destroy_process_group()
    _exit()


def _exit() -> None:
    """Flush and leave without interpreter finalization (gloo threads may still hold Python objects)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- test-process side
def _describe_exit(process: BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _context(fresh: bool) -> Any:
    """Pooled workers are forked from a server process that has imported torch once (importing it in each
    worker costs more than a second of CPU); the server starts at first use. Fresh ones are spawned."""
    if fresh:
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint"]
    )
    return context


@dataclass
class _Pool:
    """``world_size`` spawned workers with gloo initialized, each with a pipe to the test process."""

    world_size: int
    device: str
    processes: list[BaseProcess]
    connections: list[Connection]
    workdir: tempfile.TemporaryDirectory
    calls: int = 0
    spent: bool = False  # a worker left after a call: the pool cannot serve another

    @classmethod
    def start(
        cls,
        world_size: int,
        timeout: float,
        pg_timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
        fresh: bool = False,
        device: str = "cpu",
    ) -> _Pool:
        """Start the workers and wait (at most ``timeout`` seconds) until each has initialized gloo."""
        workdir = tempfile.TemporaryDirectory(prefix=f"gloo{world_size}-")
        init_file = os.path.join(workdir.name, "init")
        context = _context(fresh)
        processes, connections = [], []
        for rank in range(world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_serve, args=(rank, world_size, init_file, child_end, pg_timeout_s, device), daemon=False
            )
            process.start()
            child_end.close()
            processes.append(process)
            connections.append(parent_end)
        pool = cls(world_size, device, processes, connections, workdir)
        try:
            pool._collect(time.monotonic() + timeout, "starting gloo")
        except BaseException:
            pool.kill()
            raise
        return pool

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every worker; the results by rank."""
        self.calls += 1
        paths = [os.path.join(self.workdir.name, f"call{self.calls}-rank{r}.pt") for r in range(self.world_size)]
        for conn, path in zip(self.connections, paths):
            conn.send_bytes(pickle.dumps((fn, args, path, timeout)))
        self._collect(time.monotonic() + timeout, getattr(fn, "__qualname__", repr(fn)))
        results = [torch.load(path, weights_only=False, map_location="cpu") for path in paths]
        for path in paths:
            os.remove(path)
        return results

    def _collect(self, deadline: float, what: str) -> None:
        """Wait for every rank's reply; raise :class:`DistributedRunError` on an error, a death or the deadline."""
        pending = set(range(self.world_size))
        failures: dict[int, str] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waiting = [self.connections[r] for r in pending] + [self.processes[r].sentinel for r in pending]
            for ready in wait(waiting, timeout=remaining):
                rank = self._rank_of(ready)
                if rank not in pending:
                    continue
                pending.discard(rank)
                failure = self._reply(rank)
                if failure is not None:
                    failures[rank] = failure
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if failures:
            details = "\n".join(f"--- rank {r}:\n{text}" for r, text in sorted(failures.items()))
            raise DistributedRunError(f"{what} failed on ranks {sorted(failures)} of {self.world_size}:\n{details}")
        if pending:
            raise DistributedRunError(
                f"{what}: ranks {sorted(pending)} of {self.world_size} still running past the deadline "
                "(a hang or a too slow call); the processes were killed"
            )

    def _rank_of(self, ready: Any) -> int:
        for rank, (conn, process) in enumerate(zip(self.connections, self.processes)):
            if ready is conn or ready == process.sentinel:
                return rank
        raise AssertionError(ready)

    def _reply(self, rank: int) -> str | None:
        """This rank's reply: None when it succeeded, else what went wrong."""
        conn = self.connections[rank]
        if conn.poll():
            try:
                kind, detail = conn.recv()
            except EOFError:
                kind, detail = "died", None
            if kind in ("ok", "ready", "spent"):
                self.spent = self.spent or kind == "spent"
                return None
            if kind == "error":
                return detail
        self.processes[rank].join(timeout=5)
        return f"the process {_describe_exit(self.processes[rank])}"

    def close(self) -> None:
        """Ask the workers to leave gloo and exit; kill any that do not within a few seconds."""
        for conn in self.connections:
            with contextlib.suppress(OSError):  # a worker that died has closed its end
                conn.send_bytes(b"")
        for process in self.processes:
            process.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        """End every worker now and release the pipes and the working directory."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join()
        for conn in self.connections:
            conn.close()
        self.workdir.cleanup()


_pools: dict[tuple[int, str], _Pool] = {}


def _pooled(world_size: int, timeout: float, device: str) -> _Pool:
    """The pool of ``world_size`` workers on ``device`` (started now if there is none), most recently used last."""
    key = (world_size, device)
    pool = _pools.pop(key, None)
    if pool is None:
        while _pools and sum(p.world_size for p in _pools.values()) + world_size > MAX_POOLED_WORKERS:
            _pools.pop(next(iter(_pools))).close()
        pool = _Pool.start(world_size, timeout, device=device)
    _pools[key] = pool
    return pool


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
    pg_timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
    device: str = "cpu",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return their results by rank
    (tensors moved to the CPU).

    ``fn`` must be a module-level function. The call raises :class:`DistributedRunError` if it runs past
    ``timeout`` seconds or any rank raises. ``fresh`` runs on newly spawned processes (gloo timeout
    ``pg_timeout_s``) that end with the call, instead of the shared ones of the pytest run. ``device="cuda"``
    runs on workers that share ``cuda:0`` (:func:`worker_device`).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DistributedRunError("device='cuda' needs a CUDA GPU; none is available")
    if fresh:
        pool = _Pool.start(world_size, timeout, pg_timeout_s, fresh=True, device=device)
        try:
            results = pool.run(fn, args, timeout)
        except BaseException:
            pool.kill()
            raise
        pool.close()
        return results
    pool = _pooled(world_size, timeout, device)
    try:
        results = pool.run(fn, args, timeout)
    except BaseException:
        del _pools[(world_size, device)]
        pool.kill()
        raise
    if pool.spent:
        del _pools[(world_size, device)]
        pool.close()
    return results


def shutdown_pools() -> None:
    """Close every pooled worker (at the end of the pytest run)."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(shutdown_pools)
