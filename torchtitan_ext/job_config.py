"""The matrix optimizers' sections of torchtitan's JobConfig (``[job] custom_config_module = "torchtitan_ext.job_config"``).

:data:`JobConfig` has one section per entry of :data:`torchtitan_ext.registry.REGISTRY`: ``[muon]``,
``[mop]`` and ``[normuon]`` (the dataclasses of :mod:`torchtitan_ext.sections`, re-exported here).
Every field maps to one argument of its optimizer (:class:`dtensor_muon.Muon`, :class:`dtensor_muon.MOP`,
:class:`dtensor_muon.NorMuon`); learning rate, AdamW betas, eps and weight decay come from
torchtitan's own ``[optimizer]`` section, whose ``name`` selects the optimizer. Values are checked when
the config is built (TOML or command line), so a bad value stops the job before any process group
exists, with a message that names ``[section] key = value`` and lists the valid choices.

:func:`use_in_config_manager` (called by the launcher, ``python -m torchtitan_ext.train``) makes the
sections present without ``custom_config_module`` and turns torchtitan's error for an unknown TOML
key (which points to a ``./run_train.sh`` this project lacks) into one that names the section, the
closest valid key and the keys there are; ``python -m torchtitan_ext.train --help`` lists every option.
"""

import difflib
from dataclasses import field, fields, is_dataclass, make_dataclass
from typing import Any

from torchtitan_ext.registry import OPTIMIZER_NAMES, REGISTRY, check_optimizer_name
from torchtitan_ext.sections import MOP, BatchScaling, Muon, NorMuon

JobConfig = make_dataclass(
    "JobConfig",
    [(entry.section, entry.section_cls, field(default_factory=entry.section_cls)) for entry in REGISTRY.values()]
    + [(BatchScaling.SECTION, BatchScaling, field(default_factory=BatchScaling))],
)
JobConfig.__module__ = __name__
JobConfig.__doc__ = (
    "Extension merged into torchtitan's JobConfig: one section per matrix optimizer of the registry "
    f"({', '.join(f'[{entry.section}]' for entry in REGISTRY.values())}) and [batch_scaling]."
)


HELP_COMMAND = "python -m torchtitan_ext.train --help"
"""Prints every option of the job, the matrix optimizers' sections last (``--job.config_file X`` shows X's values as defaults)."""


def describe(config: Any) -> str:
    """One line naming what a job runs: model and flavor, optimizer and lr, steps, dump folder."""
    model, optimizer, training = config.model, config.optimizer, config.training
    return (
        f"{model.name} {model.flavor} + {optimizer.name} (lr {optimizer.lr:g}), {training.steps} steps, "
        f"dump folder {config.job.dump_folder}"
    )


def check_toml_keys(config_cls: type, values: dict[str, Any], path: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` at the first TOML section or key that ``config_cls`` lacks, naming its section,
    the closest valid name and the valid names."""
    if not (is_dataclass(config_cls) and isinstance(values, dict)):
        return
    known = {f.name: f for f in fields(config_cls)}
    for key in values:
        if key in known:
            continue
        close = difflib.get_close_matches(key, list(known), n=1)
        if path:
            where, what = f"[{'.'.join(path)}] has no key {key!r}", f"its keys: {', '.join(known)}"
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        else:
            where, what = f"there is no section [{key}]", f"sections: {', '.join(known)}"
            hint = f" (did you mean [{close[0]}]?)" if close else ""
        raise ValueError(f"{where}{hint}; {what}. `{HELP_COMMAND}` lists every option.")
    for key, value in values.items():
        check_toml_keys(known[key].type, value, (*path, key))


def use_in_config_manager() -> None:
    """Make torchtitan's ``ConfigManager`` (in this process) add the registry's sections when no
    ``custom_config_module`` is named, and report unknown TOML keys with :func:`check_toml_keys`. Idempotent."""
    from torchtitan.config.manager import ConfigManager

    if getattr(ConfigManager, "_torchtitan_ext", False):
        return
    add_custom_config, dict_to_dataclass = ConfigManager._maybe_add_custom_config, ConfigManager._dict_to_dataclass

    def _maybe_add_custom_config(self, args, toml_values):
        config_cls = add_custom_config(self, args, toml_values)
        return self._merge_configs(config_cls, JobConfig) if config_cls is self.config_cls else config_cls

    def _dict_to_dataclass(self, cls, data):
        check_toml_keys(cls, data)
        return dict_to_dataclass(self, cls, data)

    ConfigManager._maybe_add_custom_config = _maybe_add_custom_config
    ConfigManager._dict_to_dataclass = _dict_to_dataclass
    ConfigManager._torchtitan_ext = True


__all__ = [
    "HELP_COMMAND",
    "MOP",
    "OPTIMIZER_NAMES",
    "BatchScaling",
    "JobConfig",
    "Muon",
    "NorMuon",
    "check_optimizer_name",
    "check_toml_keys",
    "describe",
    "use_in_config_manager",
]
