"""examples/fsdp_quickstart.py run as a user runs it: 2 processes, a DCP checkpoint, a resume.

Three runs of STEPS steps: A uninterrupted; B the same with a checkpoint after SAVE_AT steps (A and B run
at the same time); C resumed from B's checkpoint. C's losses must equal A's from SAVE_AT on bit for bit
(the data is a function of the step and rank, and everything a step reads, parameters, momentum, AdamW
moments and step, the learning rate, is in the checkpoint); B's must equal A's (saving changes nothing).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_quickstart.py"
STEPS, SAVE_AT = 20, 10
TIMEOUT_S = 240  # per run; each takes 12-30 s of CPU, mostly importing torch


def start(launcher: list[str], losses: Path, *args: str) -> subprocess.Popen:
    cmd = [*launcher, str(EXAMPLE), "--steps", str(STEPS), "--print-losses-json", str(losses), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # own process group: on a timeout the launcher and its 2 workers are killed together
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, process_group=0)


def finish(proc: subprocess.Popen, losses: Path) -> dict:
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{proc.args} ran past {TIMEOUT_S} s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{proc.args} exited with {proc.returncode}:\n{log[-4000:]}"
    return json.loads(losses.read_text())


def test_quickstart_resumes_bit_for_bit_and_learns(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    plain = [sys.executable]  # `python examples/fsdp_quickstart.py`: the example starts torchrun itself
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    a = start(plain, tmp_path / "a.json")
    b = start(plain, tmp_path / "b.json", "--save-at", str(SAVE_AT), "--checkpoint-dir", ckpt)
    uninterrupted, saved = finish(a, tmp_path / "a.json"), finish(b, tmp_path / "b.json")
    resumed = finish(start(torchrun, tmp_path / "c.json", "--resume", "--checkpoint-dir", ckpt), tmp_path / "c.json")

    losses = uninterrupted["losses"]
    assert uninterrupted["first_step"] == 0 and len(losses) == STEPS
    assert saved["losses"] == losses
    assert resumed["first_step"] == SAVE_AT
    assert resumed["losses"] == losses[SAVE_AT:]  # floats through JSON round-trip exactly
    assert losses[-1] < 0.5 * losses[0], losses
