"""Settings files (``--config FILE``): a YAML or JSON mapping of flag names to values, turned into
flags placed before the command line's, so the parser checks them (types, choices) and the
command line wins.

    model_path: Qwen/Qwen2.5-0.5B
    batch_size: 8
    interventions: ["head:0-3.*", "mlp:*"]    # a list flag takes a list
    compress: false                           # a boolean flag: --compress / --no_compress
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from common.cli import OneLineArgumentParser, UserError
from common.files import read_optional


def read_required(path: str, what: str, missing: str) -> bytes:
    """The bytes of a file the command needs: one-line errors if it is missing or unreadable."""
    try:
        data = read_optional(path)
    except Exception as e:  # a directory, no permission, an unreachable bucket
        raise UserError(f"{what} cannot be read: {str(e).splitlines()[0]}") from None
    if data is None:
        raise UserError(missing)
    return data


def read_settings(path: str, config_cls: type | tuple[type, ...], sections: Sequence[str] = ()) -> dict[str, Any]:
    """The settings a YAML or JSON file holds, by flag name, of one configuration class or of
    several (a command's flags from each); the ``sections`` (mappings) are merged into the top
    level. An unknown name is an error."""
    data = read_required(path, f"--config {path!r}", f"--config {path!r} does not exist")
    try:
        import yaml
        raw = yaml.safe_load(data) if not path.endswith(".json") else json.loads(data)
    except Exception as e:
        raise UserError(f"--config {path!r} is not valid YAML/JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--config {path!r} must be a mapping of settings")
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in sections and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    fields = {f.name for c in (config_cls if isinstance(config_cls, tuple) else (config_cls,))
              for f in dataclasses.fields(c)}
    unknown = sorted(set(flat) - fields)
    if unknown:
        raise UserError(f"--config {path!r}: unknown setting(s) {', '.join(unknown)}")
    return flat


def setting_words(settings: dict[str, Any], config_cls: type, path: str) -> list[str]:
    """Settings as flags: ``{max_parallel: 2}`` -> ``--max_parallel 2``; a boolean ->
    ``--name`` / ``--no_name``; a list, for a list flag, -> ``--name v1 v2``."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(config_cls)}
    words: list[str] = []
    for key, value in settings.items():
        if kinds[key] == "bool":
            if not isinstance(value, bool):
                raise UserError(f"--config {path!r}: {key} must be true or false, got {value!r}")
            words.append(f"--{key}" if value else f"--no_{key}")
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)) and kinds[key].startswith("tuple"):
            if value:
                words += [f"--{key}", *(str(v) for v in value)]
        elif isinstance(value, (list, dict)):
            raise UserError(f"--config {path!r}: {key} must be a single value, got {value!r}")
        else:
            words += [f"--{key}", str(value)]
    return words


def config_path(parser: OneLineArgumentParser, argv: list[str]) -> str | None:
    """The ``--config`` of ``argv``, if any (read before the other flags)."""
    pre = OneLineArgumentParser(prog=parser.prog, add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    return known.config
