"""The documentation agrees with the code.

Every flag table in ``docs/*.md`` (a markdown table whose first column holds flags, `` `--machine_id N` ``)
has a marker on the line before it naming the commands it documents::

    <!-- flags: runners.fleet supervise, runners.fleet merge -->

Each command's flags are read from its ``--help``, in-process (``main([..., "--help"])``). Both ways
must hold: a documented flag is in the ``--help`` of every command its table names, and every flag
of a command's ``--help`` (``-h/--help`` aside) is in one of the tables naming that command. Also:
README.md links every docs page, every relative link resolves, README.md stays short.
"""

from __future__ import annotations

import importlib
import itertools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 250
FLEET = ("launch", "status", "supervise", "merge", "teardown")
COMMANDS = ("pipeline.prepare", "pipeline.extract", "pipeline.index", "pipeline.export", "runners.tpu_host",
            "runners.ablate", "runners.verify_model", "runners.train_sae", "runners.train_dictionary", "runners.probe",
            "fixtures.tiny_models",
            "fixtures.qwen_tokenizer", "fixtures.real_models",
            "fixtures.family_tokenizers", *(f"runners.fleet {name}" for name in FLEET))
MARKER = re.compile(r"<!--\s*flags:\s*(.*?)\s*-->")
FLAG = re.compile(r"--[a-z][a-z0-9_-]*")
CELL_SPLIT = re.compile(r"(?<!\\)\|")  # a cell may hold an escaped \|, as in `--mesh_type 1d\|2d`
HELP_OPTION = re.compile(r"^  (-\S.*?)(?:\s{2,}|$)", re.MULTILINE)  # argparse's "  --flag ARG, --alias ARG"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def flag_tables() -> list[tuple[str, tuple[str, ...], set[str]]]:
    """(where, commands named by the marker above it, flags of its first column) for each flag table in docs/."""
    tables = []
    for page in DOCS:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("|") or (i > 0 and lines[i - 1].startswith("|")):
                continue  # not the first row of a table
            rows = list(itertools.takewhile(lambda row: row.startswith("|"), lines[i:]))
            first_cells = [CELL_SPLIT.split(row)[1].strip() for row in rows[2:]]
            if not first_cells or not first_cells[0].startswith("`--"):
                continue  # a table, but not of flags
            above = next((text for text in reversed(lines[:i]) if text.strip()), "")
            marker = MARKER.fullmatch(above.strip())
            commands = tuple(name.strip() for name in marker.group(1).split(",")) if marker else ()
            flags = {flag for cell in first_cells for flag in FLAG.findall(cell)}
            tables.append((f"{page.relative_to(ROOT)}:{i + 1}", commands, flags))
    return tables


def help_flags(command: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The flags ``python -m COMMAND --help`` lists, except --help."""
    module, *subcommand = command.split()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        importlib.import_module(module).main([*subcommand, "--help"])
    text = capsys.readouterr().out
    options = HELP_OPTION.findall(text)
    assert options, f"no options found in the --help of {command}:\n{text}"
    return {flag for option in options for flag in FLAG.findall(option)} - {"--help"}


def test_every_flag_table_names_known_commands() -> None:
    for where, commands, _ in flag_tables():
        assert commands, f"{where}: a flag table needs <!-- flags: COMMAND[, COMMAND] --> on the line above it"
        unknown = [name for name in commands if name not in COMMANDS]
        assert not unknown, f"{where}: the marker names {unknown}, not commands of {COMMANDS}"


def test_every_marker_precedes_a_flag_table() -> None:
    for page in DOCS:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if MARKER.search(line):
                following = next((text for text in lines[i + 1:] if text.strip()), "")
                assert following.startswith("|"), f"{page.relative_to(ROOT)}:{i + 1}: a flags marker with no table"


@pytest.mark.parametrize("command", COMMANDS)
def test_flag_tables_match_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    tables = [(where, flags) for where, commands, flags in flag_tables() if command in commands]
    assert tables, f"no flag table in docs/ documents {command} (mark one <!-- flags: {command} -->)"
    in_help = help_flags(command, capsys)
    for where, flags in tables:
        unknown = sorted(flags - in_help)
        assert not unknown, f"{where} documents {unknown}, which `python -m {command} --help` does not list"
    documented = set().union(*(flags for _, flags in tables))
    missing = sorted(in_help - documented)
    assert not missing, (f"`python -m {command} --help` lists {missing}, which no flag table for {command} "
                         f"documents ({', '.join(where for where, _ in tables)})")


def test_readme_links_every_docs_page() -> None:
    links = set(LINK.findall(README.read_text()))
    unlinked = [page.name for page in DOCS if f"docs/{page.name}" not in links]
    assert DOCS and not unlinked, f"README.md does not link {unlinked}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda page: page.name)
def test_relative_links_resolve(page: pathlib.Path) -> None:
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor on the same page
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, over {README_MAX_LINES}: move some to docs/"
