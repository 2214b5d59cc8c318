"""Command-line plumbing: configuration dataclasses mirrored as argparse flags, and one-line errors.

Every entry point declares its configuration as a frozen dataclass whose fields carry their help
text (``flag(...)``); ``add_config_flags`` and ``config_from_namespace`` turn ``argv`` into that
dataclass. A ``tuple[...]`` field is a list flag: its values may be separated by spaces, commas
or both. User mistakes raise
``UserError`` and ``run_main`` prints them as one line (``prog: error: ...``) with no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import sys
import types
import typing
from typing import Any, Callable, Sequence, TypeVar

C = TypeVar("C")


class UserError(Exception):
    """A mistake in the user's input or environment; reported as one line, never a traceback."""


def flag(default: Any = dataclasses.MISSING, help: str = "", *, aliases: Sequence[str] = (),
         choices: Sequence[Any] | None = None, parse: Callable[[str], Any] | None = None) -> Any:
    """A dataclass field that is also a command-line flag ``--<name>`` (plus ``aliases``)."""
    metadata = {"help": help, "aliases": tuple(aliases), "choices": choices, "parse": parse}
    if isinstance(default, (list, dict, set)):
        frozen = default
        return dataclasses.field(default_factory=lambda: type(frozen)(frozen), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


AUTO = "auto"  # the value of every flag that can be worked out at run time


def int_or_auto(what: str) -> Callable[[str], int | str]:
    """A flag's parser for a number or ``auto``; ``what`` names the number in its error."""
    def parse(text: str) -> int | str:
        if text == AUTO:
            return AUTO
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} or {AUTO!r}, got {text!r}") from None
    return parse


def int_list(text: str) -> tuple[int, ...]:
    """Parses one word of a list flag, ``"6,12,18"`` or ``"6"``, into ``(6, 12, 18)`` / ``(6,)``."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas or spaces, "
                                         f"got {text!r}") from None


def name_list(text: str) -> tuple[str, ...]:
    """One word of a list flag of names: ``"label,topic"`` -> ``("label", "topic")``."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected names separated by commas, got {text!r}")
    return names


class _Concatenate(argparse.Action):
    """A list flag takes one or more words, each parsed to a tuple: ``6 12 18``, ``6,12,18`` and
    ``6,12 18`` all give ``(6, 12, 18)``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, tuple(itertools.chain.from_iterable(values)))


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is tuple


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors become ``UserError`` (one line) instead of usage + exit."""

    def error(self, message: str) -> typing.NoReturn:
        raise UserError(message)


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> ``int``; other annotations unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Adds one flag per field of ``config_cls`` with the field's help, default and choices."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        names = [f"--{f.name}", *meta.get("aliases", ())]
        kind = _base_type(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING
                                         else f.default_factory())
        help_text = meta.get("help", "") + ("" if required else f" (default: {default})")
        if kind is bool:  # --name / --no_name, in the project's underscore style; the last one wins
            # (a settings file's value comes first, as a flag, and the command line may turn it over)
            parser.add_argument(*names, dest=f.name, action="store_true", default=default, help=help_text)
            parser.add_argument(f"--no_{f.name}", dest=f.name, action="store_false",
                                help=f"turn off --{f.name}")
            continue
        list_flag = {"nargs": "+", "action": _Concatenate} if _is_list(kind) else {}
        parser.add_argument(*names, dest=f.name, type=meta.get("parse") or kind,
                            default=default, required=required,
                            choices=meta.get("choices"), help=help_text, **list_flag)


def config_from_namespace(config_cls: type[C], namespace: argparse.Namespace) -> C:
    """Builds ``config_cls`` from the parsed flags of ``add_config_flags``."""
    return config_cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(config_cls)})


def make_parser(prog: str, description: str) -> OneLineArgumentParser:
    # No abbreviations: a mistyped flag must not silently become another one.
    return OneLineArgumentParser(prog=prog, description=description, allow_abbrev=False)


def run_main(prog: str, main: Callable[[list[str]], int | None],
             argv: Sequence[str] | None = None, skip_native_teardown: bool = False) -> typing.NoReturn:
    """Runs ``main(argv)``; a ``UserError`` is printed as one line and exits with status 2.

    ``skip_native_teardown``: the process ends through ``exit_now`` once its work is done, for
    the commands whose work ends in Arrow (merging Parquet index files): Arrow's native thread
    pools can abort the interpreter's teardown after everything was written ("terminate called
    without an active exception", exit -6; apache/arrow#34314), seen on ``pipeline.index`` and
    ``runners.fleet supervise`` after their output was complete.
    Only for a process of its own: ``main`` run inside another (a test's) must use the default."""
    leave = exit_now if skip_native_teardown else sys.exit
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Beam logs every postponed (string) annotation it meets at INFO: noise, not information.
    logging.getLogger("apache_beam.typehints").setLevel(logging.WARNING)
    # JAX logs at INFO each accelerator platform it probes and does not find.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    # datasets logs at INFO which array libraries it found.
    logging.getLogger("datasets").setLevel(logging.WARNING)
    try:
        code = main(list(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        leave(2)
    leave(code or 0)


def exit_now(code: int) -> typing.NoReturn:
    """Ends the process with ``code`` without the interpreter's teardown (no atexit handlers, no
    native static destructors): standard streams flushed and logging shut down first."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(code)
