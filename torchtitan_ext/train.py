"""``python -m torchtitan_ext.train --job.config_file X.toml [overrides]`` (under torchrun).

Runs torchtitan's own ``Trainer`` unchanged. Where no GPU is present it first points torchtitan at
the CPU and gloo (:mod:`torchtitan_ext.cpu`). It also builds the offline dataset and tokenizer
(:mod:`torchtitan_ext.data`) when they are missing. The job config always has the matrix
optimizers' sections (``[muon]``, ``[mop]``, ``[normuon]``), an unknown TOML key is reported with
its section's valid keys (:func:`torchtitan_ext.job_config.use_in_config_manager`; ``--help`` lists
every option), and
torchtitan's warning that rank 0 shows no pipeline-parallel loss is dropped where the metrics
processor of :mod:`torchtitan_ext.metrics` shows the last stage's loss on every rank.

After a successful run the process leaves through :func:`exit_without_finalization`: torchtitan has
closed its checkpointer and metrics writers and destroyed the process groups. Left to finalize, the
process sometimes aborts ("terminate called without an active exception", SIGABRT, after "Process
group destroyed" was logged). Seen on rank 1 in CI and in 1 of 74 local runs of the tiny Llama3 job;
torchrun then reports the whole job failed. The likely cause (inferred, not traced): torch keeps the
gloo process groups alive past ``destroy_process_group()`` (measured in torch 2.13 with Muon and with
torch.optim.AdamW, even after deleting the model and the optimizer and collecting garbage), so gloo's
worker threads are torn down during interpreter finalization; one that then takes the GIL (to drop a
Python-owned tensor) is ended by CPython with a forced unwind, and the C++ runtime aborts. Not traced
to dtensor_muon: it keeps no collective in flight after ``step()`` (or ``flush()`` with overlap), and
without this exit none of 15 runs of the 12-step job with Muon and 15 with AdamW aborted, nor 128 and 68
smaller FSDP2 scripts with Muon and with AdamW. A run that raises leaves through the normal path, with
its traceback.
"""

import logging
import os
import sys

import torch

from torchtitan_ext import cpu, data, job_config, metrics


def exit_without_finalization() -> None:
    """Flush Python's logging and standard streams, then end the process with ``os._exit(0)``."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    """Prepare the device and the data, hand over to ``torchtitan.train.main``, then exit at once."""
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
