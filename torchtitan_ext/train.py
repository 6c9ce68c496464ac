"""``python -m torchtitan_ext.train --job.config_file X.toml [overrides]`` (under torchrun).

Runs torchtitan's own ``Trainer`` unchanged. Where no GPU is present it first points torchtitan at
the CPU and gloo (:mod:`torchtitan_ext.cpu`). It also builds the offline dataset and tokenizer
(:mod:`torchtitan_ext.data`) when they are missing.
"""

import torch

from torchtitan_ext import cpu, data


def main() -> None:
    """Prepare the device and the data, then hand over to ``torchtitan.train.main``."""
    if not torch.cuda.is_available():
        cpu.use_cpu_gloo()
    data.build(data.DEFAULT_OUT)
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()
