"""torchtitan 0.3 adapter: the matrix optimizers of :data:`torchtitan_ext.registry.REGISTRY` in torchtitan 0.3's
Python configs.

- :mod:`~torchtitan_ext.titan03.container`: ``MatrixOptimizersContainer`` and its ``Config`` (``--optimizer.name``,
  ``--optimizer.lr``, ``--optimizer.muon.ns-steps``, …);
- :mod:`~torchtitan_ext.titan03.config_registry`: ready configs, ``--module torchtitan_ext.titan03 --config
  llama3_muon`` (also ``qwen3_muon``, ``deepseek_v3_muon``, ``qwen3_moe_muon``);
- :mod:`~torchtitan_ext.titan03.overrides`: ``--override.imports torchtitan_ext.titan03.overrides.muon='{…}'``
  (and ``mop``, ``normuon``, ``soap``, ``klsoap``, ``rekls``) on any config;
- :mod:`~torchtitan_ext.titan03.metrics`: the optimizer line, the FLOPs line and the optimizer's scalars;
- :mod:`~torchtitan_ext.titan03.cpu`: the CPU path (device globals, gloo SUM reductions, dense attention);
- :mod:`~torchtitan_ext.titan03.train`: the launcher, ``python -m torchtitan_ext.titan03.train`` under torchrun.

Importing it under another torchtitan line raises ``ImportError`` naming the installed version.
"""

from torchtitan_ext.version import LINE, VERSION

if LINE != "0.3":
    raise ImportError(
        f"torchtitan_ext.titan03 is the adapter for torchtitan 0.3.x; the installed torchtitan is {VERSION}"
    )
