"""torchtitan glue for dtensor_muon, for torchtitan 0.2.x and 0.3.x; the adapter follows the installed version
(:data:`torchtitan_ext.version.LINE`).

Shared by both lines (no torchtitan 0.2 or 0.3 API in them):

- :mod:`torchtitan_ext.registry`: the matrix optimizers, one entry each (name, option section, class, keyword
  mapping);
- :mod:`torchtitan_ext.sections`: the option dataclasses (``Muon``, ``MOP``, ``NorMuon``, ``SOAP``, ``KLSOAP``,
  ``REKLS``) and their checks;
- :mod:`torchtitan_ext.metrics`: the reduction of the optimizer's diagnostics over ranks and the optimizer and
  FLOPs log lines;
- :mod:`torchtitan_ext.data`: offline dataset and tokenizer (``python -m torchtitan_ext.data``);
- :mod:`torchtitan_ext.summary`: one line and a plot of a run from its TensorBoard events.

torchtitan 0.2.x (``[optimizer] name = "Muon"`` in TOML, ``--optimizer.name``): importing this package
(``[experimental] custom_import = "torchtitan_ext"``) registers train specs for llama3, deepseek_v3, qwen3 and
llama4 whose optimizer builder understands the registry's names (:mod:`torchtitan_ext.spec`), with the
sections of :mod:`torchtitan_ext.job_config`, the builders of :mod:`torchtitan_ext.optimizer`, the CPU/gloo
shim of :mod:`torchtitan_ext.cpu` and the launcher ``python -m torchtitan_ext.train``. It also adds cut-down
flavors of real models (``llama3`` ``8B_2layers``, ``qwen3`` ``30B-A3B_2layers``, ``deepseek_v3``
``16B_2layers``: :mod:`torchtitan_ext.flavors`) to torchtitan's flavor tables.

torchtitan 0.3.x (``--module``/``--config``, ``--override.imports``): :mod:`torchtitan_ext.titan03`; importing
this package registers nothing there (0.3 finds configs and overrides by module path).
"""

from torchtitan_ext.version import LINE

REGISTERED_MODELS: list[str] = []
"""The torchtitan 0.2 models whose train specs were replaced (empty on other lines)."""

REGISTERED_FLAVORS: list[str] = []
"""The cut-down flavors added to torchtitan 0.2's flavor tables, as ``model/flavor`` (empty on other lines)."""

if LINE == "0.2":
    from torchtitan_ext import flavors
    from torchtitan_ext.spec import register_all

    REGISTERED_FLAVORS = flavors.register_all()
    REGISTERED_MODELS = register_all()
