"""Which torchtitan line is installed, read from the package metadata without importing torchtitan.

torchtitan 0.2.x (TOML configs, ``--optimizer.name``, train specs) and 0.3.x (Python config registries chosen
with ``--module``/``--config``, ``@override`` factories) need different adapters: :mod:`torchtitan_ext.spec`
and its neighbours for 0.2, :mod:`torchtitan_ext.titan03` for 0.3. :data:`LINE` says which one applies.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_LINES = ("0.2", "0.3")
"""The torchtitan lines this package has an adapter for."""


def installed_version() -> str | None:
    """torchtitan's installed version string, or ``None`` where torchtitan is not installed."""
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


VERSION = installed_version()
"""The installed torchtitan version (``None`` without torchtitan)."""

LINE = line_of(VERSION)
"""The installed torchtitan line with an adapter here, or ``None``."""
