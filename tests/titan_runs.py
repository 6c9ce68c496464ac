"""torchtitan 0.2 trainings launched as the README's commands launch them, for the end-to-end tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOSS_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+\w.]+)")
ERROR_LINE = re.compile(
    r"^(?:\[rank\d+\]:)?[ \t]*(?:(?:[a-z_]\w*\.)+[A-Z]\w*|\w*(?:Error|Exception|Failed))\b:.*$", re.MULTILINE
)
"""A line that names an exception: ``Name: message`` where the name ends in Error, Exception or Failed, or any
class name behind its module path (``torch._dynamo.exc.Unsupported: ...``), indented or behind a rank's prefix."""
CPU_ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
"""One OpenMP thread per process (the processes of a CPU run share the machine's cores), and no GPU: on a machine
with one, the launcher would otherwise train on CUDA with NCCL, which refuses two ranks on one GPU."""


def torchrun(
    config: str,
    dump: Path,
    *overrides: str,
    nproc: int = 2,
    timeout: int = 170,
    env: dict[str, str] = CPU_ENV,
    tail: int = 1500,
) -> tuple[int, str, dict[int, float]]:
    """Run ``python -m torchtitan_ext.train`` on ``train_configs/CONFIG`` under torchrun with ``nproc``
    processes, this checkout's ``src`` and root first on PYTHONPATH (the library need not be installed) and
    ``env`` added to the environment; return (returncode, output, {step: loss} from rank 0). Every rank's output
    is also kept under ``dump``/ranks; when the run fails, the last ``tail`` characters of each rank's stderr are
    appended to the output (the console shows rank 0 only)."""
    logs = dump / "ranks"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "--local-ranks-filter", "0",
        "--log-dir", str(logs), "--tee", "3",
        "-m", "torchtitan_ext.train", "--job.config_file", f"train_configs/{config}",
        "--job.dump_folder", str(dump), "--metrics.disable_color_printing", *overrides,
    ]  # fmt: skip
    pythonpath = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": pythonpath, **env}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    losses = {int(s): float(v) for s, v in LOSS_LINE.findall(output)}
    if proc.returncode != 0:
        for log in sorted(logs.rglob("stderr.log")):
            output += f"\n--- {log.relative_to(logs)} (tail) ---\n" + log.read_text(errors="replace")[-tail:]
    return proc.returncode, output, losses


def failure(output: str, tail: int = 3000) -> str:
    """A failed run's output for an assertion message: the first 5 distinct lines that name an exception (a
    compiler's dump can push them far above the tail), then the last ``tail`` characters."""
    named = list(dict.fromkeys(m.group(0).strip() for m in ERROR_LINE.finditer(output)))[:5]
    return "\n".join(["exceptions named:", *named, "--- output tail ---", output[-tail:]]) if named else output[-tail:]
