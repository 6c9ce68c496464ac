"""The gloo abort at interpreter exit: torch alone reproduces it; exit_without_finalization avoids it.

The first two tests run ``tests/gloo_exit_abort.py`` (two fresh gloo processes; its docstring explains the
timing): rank 0 returns while gloo's worker thread still has to free a tensor that owns its Python object.
The third shows who keeps gloo's worker threads alive past the model and the optimizer: torch's DTensor
caches, not this library.
"""

import gc
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_exit_abort import run_both
from scenarios import OPTIONS, Blocks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from dtensor_muon import Muon

pytestmark = pytest.mark.slow
ABORT_MESSAGE = "terminate called without an active exception"
ABORT_ATTEMPTS = 3
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
torch_2_13_or_newer = pytest.mark.skipif(
    TORCH_VERSION < (2, 13),
    reason=f"describes torch >= 2.13 (the CPU build this project pins); torch {torch.__version__} differs: "
    "it does not abort at this exit, and its DeviceMesh registry keeps meshes the caches below do not hold",
)


@torch_2_13_or_newer
def test_torch_alone_aborts_when_a_gloo_worker_frees_a_tensor_during_finalization():
    """The abort needs rank 1's side of the all_reduce to arrive while rank 0's last exit handler holds the GIL
    (``gloo_exit_abort``'s docstring). On a loaded machine rank 1 can start too late, and rank 0 then exits
    cleanly: the reproduction is run up to ``ABORT_ATTEMPTS`` times, and one abort shows that torch still aborts."""
    codes = []
    for _ in range(ABORT_ATTEMPTS):
        (code0, out0), (code1, out1) = run_both(end_with_helper=False)
        assert code1 == 0, out1
        if code0 == -signal.SIGABRT and ABORT_MESSAGE in out0:
            return
        codes.append(code0)
    pytest.fail(
        f"rank 0 exited with {codes} in {ABORT_ATTEMPTS} runs: if torch no longer aborts here, the "
        f"exit_without_finalization workaround (docs/limits.md, torchtitan_ext.train) may go\n{out0}"
    )


def test_exit_without_finalization_runs_exit_handlers_flushes_and_exits_zero():
    (code0, out0), (code1, out1) = run_both(end_with_helper=True)
    assert code0 == 0 and ABORT_MESSAGE not in out0, out0
    assert code1 == 0 and "all_reduce done" in out1, out1  # rank 1 waits for a file rank 0's exit handler writes
    assert "rank 0: returning with the all_reduce in flight" in out0, out0  # printed unflushed to a pipe


def gloo_worker_threads() -> int:
    """How many of this process's threads are gloo process-group workers (two per group by default)."""
    names = (Path(f"/proc/self/task/{tid}/comm").read_text() for tid in os.listdir("/proc/self/task"))
    return sum(name.startswith("pt_gloo_runloop") for name in names)


def clear_dtensor_caches() -> None:
    """Empty the torch 2.13 DTensor caches that hold a DeviceMesh strongly."""
    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def hsdp_muon_thread_counts(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """gloo worker threads while Muon trains on an HSDP mesh, after destroy_process_group and deleting
    everything, and after emptying torch's DTensor caches; written to ``out_dir/rank{rank}.json``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Blocks()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model.named_parameters(), overlap=True, **OPTIONS)
    opt.attach(model)
    for step in range(2):
        tokens = torch.randint(0, 29, (3, 5), generator=torch.Generator().manual_seed(100 * step + rank))
        torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 29), tokens.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    counts = {"training": gloo_worker_threads()}
    dist.barrier()
    dist.destroy_process_group()
    del model, opt, mesh, block  # the loop variable holds the last block
    gc.collect()
    counts["deleted"] = gloo_worker_threads()
    clear_dtensor_caches()
    gc.collect()
    counts["caches_cleared"] = gloo_worker_threads()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(counts))


@torch_2_13_or_newer
def test_only_torchs_dtensor_caches_keep_gloo_threads_alive_after_muon_and_its_model_are_deleted(tmp_path):
    mp.spawn(hsdp_muon_thread_counts, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counts["training"] >= 4, counts  # the default group and the mesh's new one, two workers each
        assert counts["deleted"] > 0, counts  # torch's caches keep the mesh: docs/limits.md
        assert counts["caches_cleared"] == 0, counts  # nothing in dtensor_muon holds a group
