"""Which torchtitan line is installed, found without importing torchtitan.

torchtitan 0.2.x (TOML configs, ``--optimizer.name``, train specs) and 0.3.x (Python config registries chosen
with ``--module``/``--config``, ``@override`` factories) need different adapters: :mod:`torchtitan_ext.spec`
and its neighbours for 0.2, :mod:`torchtitan_ext.titan03` for 0.3. :data:`LINE` says which one applies.

The version comes from the package metadata. A torchtitan put on ``PYTHONPATH`` without its ``.dist-info``
folder (unpacked from a wheel by hand, or a source checkout) has none: then the line is read from the files
of the package found on the path (:func:`line_from_layout`), still without importing it.
"""

from __future__ import annotations

from importlib import metadata, util
from pathlib import Path

SUPPORTED_LINES = ("0.2", "0.3")
"""The torchtitan lines this package has an adapter for."""


def installed_version() -> str | None:
    """torchtitan's version string from its package metadata, or ``None`` where there is none."""
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def line_of(version: str | None) -> str | None:
    """The line (``"0.2"``, ``"0.3"``) of a version string such as ``"0.3.0"`` or ``"0.2.2.dev0"``; ``None`` for
    ``None`` or a line without an adapter."""
    if version is None:
        return None
    major_minor = ".".join(version.split(".")[:2])
    return major_minor if major_minor in SUPPORTED_LINES else None


def package_dir() -> Path | None:
    """The folder of the ``torchtitan`` package that ``import torchtitan`` would load (not imported), or None."""
    try:
        spec = util.find_spec("torchtitan")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def line_from_layout(root: Path | None) -> str | None:
    """The line of the torchtitan package in folder ``root``, from its files: 0.2 defines ``register_train_spec``
    in ``protocols/train_spec.py`` (0.3 has no train specs) and 0.3 has ``config/override.py`` (0.2 has no
    overrides); ``None`` for neither, or no folder."""
    if root is None:
        return None
    train_spec = root / "protocols" / "train_spec.py"
    if train_spec.is_file() and "def register_train_spec" in train_spec.read_text(encoding="utf-8", errors="replace"):
        return "0.2"
    if (root / "config" / "override.py").is_file():
        return "0.3"
    return None


VERSION = installed_version()
"""The installed torchtitan version: from its metadata, else ``"0.2 (no package metadata)"`` (or 0.3) where only
the package's files tell the line, ``None`` without torchtitan."""

LINE = line_of(VERSION)
"""The installed torchtitan line with an adapter here, or ``None``."""

if VERSION is None:
    LINE = line_from_layout(package_dir())
    if LINE is not None:
        VERSION = f"{LINE} (no package metadata)"
