"""docs/architecture.md's tree against the files: the package's top level holds only ``__init__.py`` and its
wings, every wing is in the tree, and each wing's line names exactly the modules the wing holds."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "dtensor_muon"


def tree_lines() -> dict[str, str]:
    """The text of each wing's entry in the tree (its first line and the indented lines under it)."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    wings: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        match = re.match(r"^  (\w+)/\s", line)
        if match:
            current = match.group(1)
            wings[current] = line
        elif current and line.startswith(" " * 21):
            wings[current] += " " + line.strip()
        else:
            current = None
    return wings


def test_the_top_level_holds_only_init_and_wings():
    files = {p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".py"}
    assert files == {"__init__.py"}


def test_each_wing_line_names_the_wings_modules():
    wings = tree_lines()
    on_disk = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert set(wings) == on_disk
    for wing, text in wings.items():
        named = set(re.findall(r"\b(\w+\.py)\b", text)) - {"__init__.py", "__main__.py"}
        modules = {p.name for p in (PACKAGE / wing).rglob("*.py")} - {"__init__.py", "__main__.py"}
        assert named == modules, (
            f"{wing}/: the tree names {sorted(named - modules)} that are not there and misses {sorted(modules - named)}"
        )
