"""Shared CLI plumbing: one-line errors with exit code 2, JSON as the last stdout line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

Number = TypeVar("Number", int, float)

EXIT_USAGE = 2


# Renders as nothing, and stops the Formatter appending "(default: None)" to the help line.
NO_DEFAULT = "%(default).0s"


class CliError(Exception):
    """A user-facing error: printed as one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single line on stderr."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults and keep the hand-written layout of descriptions.

    A flag (store_true / store_false) or an option whose default is None shows no
    "(default: ...)": "--no-chat (default: True)" would describe the destination, not the
    flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        flag = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
        if flag or action.default is None:
            return action.help
        return super()._get_help_string(action)


def emit_json(payload: dict[str, Any]) -> None:
    """Print one JSON object as the last line of stdout."""
    sys.stdout.write(json.dumps(payload, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "__dict__"):
        return vars(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object as the last line of stdout (for scripts)",
    )


def _parsed(text: str, parse: Callable[[str], Number], kind: str) -> Number:
    """``parse(text)``, or argparse's error naming what was expected."""
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if value != value or value <= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if value != value or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def port_number(text: str) -> int:
    value = _parsed(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value


def every_core() -> int:
    """CPUs this process may run on (all the machine's where the OS does not say)."""
    import os

    from speculative.hardware import affinity_cpus

    return affinity_cpus() or os.cpu_count() or 1
