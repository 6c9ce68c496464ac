"""How the project installs: a distribution name of its own, and torch's CPU build where no GPU is present."""

import os
import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_distribution_is_not_named_like_the_other_projects_package():
    """ "dtensor-muon" on the package index is another project (its wheel installs a top-level dtensor_muon):
    this one is named otherwise, and the README never tells anyone to install that name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert normalized(project["name"]) != "dtensor-muon"
    readme = (ROOT / "README.md").read_text()
    warning = "Never `pip install dtensor-muon`"
    assert warning in readme
    assert not re.search(r"pip install\s+(-\S+\s+)*dtensor[-_]muon\b", readme.replace(warning, ""))


def make_install(tmp_path: Path, with_gpu: bool) -> str:
    """``make install`` with a stand-in python that records its calls (and has no torch); with a GPU: an
    ``nvidia-smi`` first on the PATH (what the Makefile looks for); without: ``HAS_GPU=`` (a PATH without any
    ``nvidia-smi`` would drop the folder of ``make`` itself on machines that have one). Returns the calls."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "python $*" >> {tmp_path}/calls\n[ "$1" = "-c" ] && exit 1\nexit 0\n')
    fake.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "HAS_GPU")}
    cmd = ["make", "-B", "install", f"PY={fake}", f"STAMP={tmp_path}/stamp"]
    if with_gpu:
        env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    else:
        cmd.append("HAS_GPU=")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (tmp_path / "calls").read_text()


def test_make_installs_the_cpu_build_of_torch_where_no_gpu_is_present(tmp_path):
    calls = make_install(tmp_path, with_gpu=False)
    assert "pip install -q --retries 1 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in calls


def test_make_installs_the_package_indexs_build_with_a_gpu(tmp_path):
    calls = make_install(tmp_path, with_gpu=True)
    assert "pip install -q torch==2.13.0\n" in calls and "whl/cpu" not in calls
