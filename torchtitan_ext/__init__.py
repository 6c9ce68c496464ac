"""torchtitan 0.2.x glue for dtensor_muon.

Importing this package (``[experimental] custom_import = "torchtitan_ext"``) registers train specs
for llama3, deepseek_v3, qwen3 and llama4 whose optimizer builder understands
``[optimizer] name = "Muon"`` (see :mod:`torchtitan_ext.spec`). Modules:

- :mod:`torchtitan_ext.job_config`: the ``[muon]`` config section;
- :mod:`torchtitan_ext.optimizer`: the optimizer builders and container;
- :mod:`torchtitan_ext.metrics`: the optimizer's diagnostics, reduced over ranks, in torchtitan's logs;
- :mod:`torchtitan_ext.summary`: one line and a plot of a run (``python -m torchtitan_ext.summary DUMP --plot``);
- :mod:`torchtitan_ext.cpu`: running torchtitan on CPU with gloo;
- :mod:`torchtitan_ext.train`: the launcher (``python -m torchtitan_ext.train``);
- :mod:`torchtitan_ext.data`: offline dataset and tokenizer (``python -m torchtitan_ext.data``).
"""

from torchtitan_ext.spec import register_all

REGISTERED_MODELS = register_all()
