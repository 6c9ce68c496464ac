"""``python -m torchtitan_ext.train --job.config_file X.toml [overrides]`` (under torchrun).

Runs torchtitan's own ``Trainer`` unchanged. It first checks the configuration (TOML sections and keys,
section values, ``[optimizer] name``, ``[model] name`` and ``flavor``, the cut-down flavors of
:mod:`torchtitan_ext.flavors` included) and stops with one line from rank 0 and exit status 2 when it cannot
run, before any model or process group exists (``--check-config``: only that). Where no GPU is present it
points torchtitan at the CPU and gloo (:mod:`torchtitan_ext.cpu`). It also builds the offline dataset and tokenizer
(:mod:`torchtitan_ext.data`) when they are missing. The job config always has the matrix
optimizers' sections (``[muon]``, ``[mop]``, ``[normuon]``), an unknown TOML key is reported with
its section's valid keys (:func:`torchtitan_ext.job_config.use_in_config_manager`; ``--help`` lists
every option), and
torchtitan's warning that rank 0 shows no pipeline-parallel loss is dropped where the metrics
processor of :mod:`torchtitan_ext.metrics` shows the last stage's loss on every rank.

After a successful run the process leaves through :func:`dtensor_muon.exit_without_finalization`:
torchtitan has closed its checkpointer and metrics writers and destroyed the process groups, the exit
handlers run, the output is flushed, and interpreter finalization is skipped. Left to finalize, a run
sometimes aborted after "Process group destroyed" ("terminate called without an active exception",
SIGABRT; seen on rank 1 in CI and in 1 of 74 local runs of the tiny Llama3 job). That is the signature
of a gloo worker thread freeing a tensor during finalization, a torch/CPython interaction that
``tests/gloo_exit_abort.py`` reproduces without this library (the mechanism is in
:mod:`dtensor_muon.distributed.process_exit`). A run that raises leaves through the normal path, with its traceback.
"""

import contextlib
import importlib
import io
import os
import sys

import torch

from dtensor_muon import exit_without_finalization
from torchtitan_ext import cpu, data, flavors, job_config, spec
from torchtitan_ext.registry import check_optimizer_name

CHECK_ONLY = "--check-config"
"""``python -m torchtitan_ext.train --check-config [the job's arguments]``: check the configuration, print what
the job will run (:func:`torchtitan_ext.job_config.describe`) and exit (0 when it is valid); ``make train`` runs it before starting the
processes."""


def is_first_rank() -> bool:
    """Rank 0 of the job (or no launcher at all), from torchrun's environment: decides which process speaks."""
    return os.environ.get("RANK", "0") == "0"


def parse(argv: list[str]) -> object:
    """The job config torchtitan will build from ``argv`` (with the matrix optimizers' sections)."""
    from torchtitan.config import ConfigManager

    job_config.use_in_config_manager()
    return ConfigManager().parse_args(argv)


def config_problem(argv: list[str]) -> str | None:
    """Why the job's configuration cannot run, in one line, or None: an unknown TOML section or key, a bad
    section value (:mod:`torchtitan_ext.sections`), an unknown ``[optimizer] name`` (names are case-sensitive),
    an unknown model or flavor (:func:`model_problem`).
    Parses the arguments as torchtitan will, before any model, process group or data exists. A command-line
    error is tyro's: it prints its own message (rank 0 only here) and exits the process."""
    quiet = contextlib.nullcontext() if is_first_rank() else contextlib.redirect_stderr(io.StringIO())
    try:
        with quiet:
            config = parse(argv)
        check_optimizer_name(config.optimizer.name)
    except ValueError as exc:
        return str(exc)
    return model_problem(config)


def model_problem(config) -> str | None:
    """Why torchtitan cannot build the job's model, in one line, or None: ``[experimental] custom_import`` that
    does not import (imported here as the trainer will), an unknown ``[model] name``, or a ``flavor`` its train
    spec lacks (:func:`torchtitan_ext.flavors.flavor_problem`)."""
    custom = config.experimental.custom_import
    if custom:
        try:
            importlib.import_module(custom)
        except ImportError as exc:
            return f"[experimental] custom_import = {custom!r} cannot be imported: {exc}"
    return flavors.flavor_problem(config.model.name, config.model.flavor)


def main() -> None:
    """Check the configuration, prepare the device and the data, hand over to ``torchtitan.train.main``, then
    exit without finalization. A configuration that cannot run ends every process here with exit status 2 and
    one line from rank 0, before anything is built."""
    argv = sys.argv[1:]
    check_only = CHECK_ONLY in argv
    argv = [a for a in argv if a != CHECK_ONLY]
    problem = config_problem(argv)
    if problem is not None:
        if is_first_rank():
            print(f"torchtitan_ext.train: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    if check_only:
        print(job_config.describe(parse(argv)), flush=True)
        return
    if is_first_rank():
        print(f"torchtitan_ext.train: {job_config.describe(parse(argv))}", flush=True)
    sys.argv = [sys.argv[0], *argv]
    if not torch.cuda.is_available():
        cpu.use_cpu_gloo()
    data.build(data.DEFAULT_OUT)
    import torchtitan.train
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    torchtitan.train.ensure_pp_loss_visible = spec.ensure_pp_loss_visible
    torchtitan_main(Trainer)
    exit_without_finalization()


if __name__ == "__main__":
    main()
