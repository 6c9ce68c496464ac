"""torchtitan 0.2.x glue for dtensor_muon.

Importing this package (``[experimental] custom_import = "torchtitan_ext"``) registers train specs
for llama3, deepseek_v3, qwen3 and llama4 whose optimizer builder understands the matrix optimizers
``[optimizer] name = "Muon"``, ``"MOP"`` and ``"NorMuon"`` besides torchtitan's Adam and AdamW (see
:mod:`torchtitan_ext.spec`), each configured by its own section (``[muon]``, ``[mop]``, ``[normuon]``).
Modules:

- :mod:`torchtitan_ext.registry`: the matrix optimizers, one entry each (name, section, class, keyword
  mapping); the ``[optimizer] name`` choices, the JobConfig sections and the builders' dispatch derive from it;
- :mod:`torchtitan_ext.sections`: the ``[muon]``, ``[mop]`` and ``[normuon]`` dataclasses and their checks;
- :mod:`torchtitan_ext.job_config`: the JobConfig extension holding those sections;
- :mod:`torchtitan_ext.optimizer`: the optimizer builders and container;
- :mod:`torchtitan_ext.metrics`: the optimizer's diagnostics, reduced over ranks, in torchtitan's logs;
- :mod:`torchtitan_ext.summary`: one line and a plot of a run (``python -m torchtitan_ext.summary DUMP --plot``);
- :mod:`torchtitan_ext.cpu`: running torchtitan on CPU with gloo;
- :mod:`torchtitan_ext.train`: the launcher (``python -m torchtitan_ext.train``);
- :mod:`torchtitan_ext.data`: offline dataset and tokenizer (``python -m torchtitan_ext.data``).
"""

from torchtitan_ext.spec import register_all

REGISTERED_MODELS = register_all()
