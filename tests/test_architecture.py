"""The rooms of ``docs/architecture.md`` are the packages there are, in ``.importlinter``'s order, and
the import contract refuses an import that goes up a room."""

from __future__ import annotations

import configparser
import pathlib
import re
import shutil
import subprocess
import sys

import setuptools

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIAGRAM = re.compile(r"<!-- rooms:.*?-->\n```\n(.*?)```", re.DOTALL)
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"


def contract() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    return config


def contract_layers() -> list[list[str]]:
    """The layers contract's layers, top first, each a list of its rooms (``a | b``: two)."""
    text = contract()["importlinter:contract:layers"]["layers"]
    return [[room.strip() for room in line.split("|")] for line in text.split("\n") if line.strip()]


def diagram_layers() -> list[list[str]]:
    """The rooms of the architecture page's diagram, top first: a line's words before its description."""
    block = DIAGRAM.search((ROOT / "docs" / "architecture.md").read_text()).group(1)
    layers = []
    for line in block.splitlines():
        names = re.match(r"\s*([a-z_]+(?:\s*\|\s*[a-z_]+)*)\s{2,}", line)
        if names:
            layers.append([room.strip() for room in names.group(1).split("|")])
    return layers


def test_the_diagram_is_the_contract_and_names_every_package():
    packages = {name for name in setuptools.find_packages(str(ROOT), exclude=["tests", "tests.*", "benchmarks"])
                if "." not in name}
    assert diagram_layers() == contract_layers()
    rooms = {room for layer in contract_layers() for room in layer}
    assert rooms == packages
    assert set(contract()["importlinter"]["root_packages"].split()) == packages
    assert all((ROOT / room / "__init__.py").exists() for room in rooms)


def test_an_import_that_goes_up_a_room_breaks_the_contract(tmp_path):
    """The model importing the host: ``lint-imports`` on a copy of the tree fails, naming the import."""
    for room in (room for layer in contract_layers() for room in layer):
        shutil.copytree(ROOT / room, tmp_path / room, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    kept = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, capture_output=True, text=True)
    assert kept.returncode == 0, kept.stdout
    with open(tmp_path / "model" / "sites.py", "a") as f:
        f.write("\nimport host.run  # noqa: E402\n")
    broken = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, capture_output=True, text=True)
    assert broken.returncode == 1
    assert "Each room imports only the rooms below it BROKEN" in broken.stdout
    assert "model.sites -> host.run" in broken.stdout
