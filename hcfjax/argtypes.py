"""argparse types for the `hcfjax` commands' numeric options. Each parses its number and checks it as the place the
value goes does (an EngineConfig or PrefillConfig field, a sampling parameter, a seed) or against a stated range,
so that a value out of range gets argparse's message and exit code 2 while the command line is parsed, before any
model loads or server listens:

    hcfjax serve: error: argument --max-slots: max_slots must be an integer >= 1, got 0
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable


class Parser(argparse.ArgumentParser):
    """argparse's parser, refusing `--option=--`: Python 3.12's argparse takes that "--" for the end of the
    options and gives the option an empty list, without calling its type. An argument that no option takes is the
    error of the command it was given to, with that command's usage (argparse's is the top level's)."""

    _commands = None  # add_subparsers' action, when this parser has commands

    def add_subparsers(self, **kwargs):
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser = self
            if self._commands is not None:
                parser = self._commands.choices.get(getattr(parsed, self._commands.dest, None), self)
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed

    def parse_known_args(self, args=None, namespace=None):
        for arg in sys.argv[1:] if args is None else args:
            if isinstance(arg, str) and arg.startswith("--") and arg.endswith("=--"):
                self.error(f"argument {arg[:-3]}: expected a value, got '--'")
        return super().parse_known_args(args, namespace)


def _number(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not a finite number")
    return value


def checked(kind: type, check: Callable[[int | float], object]) -> Callable[[str], int | float]:
    """A type: the option's text as `kind` (int, or a finite float), given to `check`, whose ValueError is the
    option's error."""

    def parse(text: str):
        value = _number(text, kind)
        try:
            check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return parse


def within(kind: type, lo: float | None = None, hi: float | None = None, above: float | None = None):
    """A type: `kind` in [lo, hi] (a bound not given is open) and, with `above`, greater than it."""
    bounds = [f">= {lo}"] * (lo is not None) + [f"<= {hi}"] * (hi is not None) + [f"> {above}"] * (above is not None)

    def check(value):
        if (lo is not None and value < lo) or (hi is not None and value > hi) or (above is not None and value <= above):
            raise ValueError(f"must be {' and '.join(bounds)}, got {value}")

    return checked(kind, check)


PORT = within(int, 0, 65535)  # 0: a free one (a server's port)


def engine_field(name: str, kind: type = int):
    """A type for an EngineConfig field, checked by EngineConfig."""

    def check(value):
        from hcfjax.engine import EngineConfig

        EngineConfig(**{name: value})

    return checked(kind, check)


def prefill_field(name: str, kind: type = int):
    """A type for a PrefillConfig field, checked by PrefillConfig."""

    def check(value):
        from hcfjax.pd.prefill import PrefillConfig

        PrefillConfig(**{name: value})

    return checked(kind, check)


def sampling_field(name: str, kind: type):
    """A type for a SamplingParams field (temperature, top_k, top_p, min_p), checked by SamplingParams."""

    def check(value):
        from hcfjax.sampling import SamplingParams

        SamplingParams(**{name: value})

    return checked(kind, check)


def seed(text: str) -> int:
    from hcfjax.frontdoor import check_seed

    return checked(int, check_seed)(text)


def max_new_tokens(text: str) -> int:
    """An integer >= 1 (the front door's check) that a request message's int32 field holds."""
    from hcfjax.frontdoor import check_max_new_tokens

    def check(n: int) -> None:
        check_max_new_tokens(n)
        if n >= 2**31:
            raise ValueError(f"max_new_tokens must be below 2^31, got {n}")

    return checked(int, check)(text)


def draft_tokens(text: str) -> int:
    """--speculative K: 0 (off) or a SpeculativeConfig's draft count."""
    from hcfjax.speculative import SpeculativeConfig

    return checked(int, lambda k: k == 0 or SpeculativeConfig(num_draft_tokens=k))(text)
