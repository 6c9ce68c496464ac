"""``python -m torchtitan_ext.train --job.config_file X.toml [overrides]`` (under torchrun).

Runs torchtitan's own ``Trainer`` unchanged. Where no GPU is present it first points torchtitan at
the CPU and gloo (:mod:`torchtitan_ext.cpu`). It also builds the offline dataset and tokenizer
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
:mod:`dtensor_muon.process_exit`). A run that raises leaves through the normal path, with its traceback.
"""

import torch

from dtensor_muon import exit_without_finalization
from torchtitan_ext import cpu, data, job_config, metrics


def main() -> None:
    """Prepare the device and the data, hand over to ``torchtitan.train.main``, then exit without finalization."""
    if not torch.cuda.is_available():
        cpu.use_cpu_gloo()
    data.build(data.DEFAULT_OUT)
    job_config.use_in_config_manager()
    import torchtitan.train
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    torchtitan.train.ensure_pp_loss_visible = metrics.ensure_pp_loss_visible
    torchtitan_main(Trainer)
    exit_without_finalization()


if __name__ == "__main__":
    main()
