"""The one parser of unit sets: feasible core or GPU counts written ``"4"``, ``"1-32"`` or
``"1,2,4,8"``.

A unit set is part of the HTTP API's wire format, so its parser lives with the SDK (which
imports nothing of the core): an integration's config is checked here when it is loaded,
and the server reads the same text through :func:`tangram.units.parse_units`, which builds
the core's :class:`~tangram.model.Demand` from the counts :func:`parse_counts` returns. Both
sides refuse exactly the same strings.

Every place that reads such a string (the HTTP API's ``cpu`` and ``gpus``, a trace's
``cpu_cores`` and ``gpus`` columns, an integration's config) goes through
:func:`parse_counts`: a set holds every feasible count, and ``"1-2000000"`` expanded
unchecked is two million ints (a second of a server's event loop and ~76 MiB),
``"1-999999999"`` exhausts the machine. So the text's length, the number of alternatives and
every bound are checked on the text itself, before anything is expanded, and the result holds
at most :data:`MAX_UNITS` counts. Nothing is cached here: a cache keyed by client-chosen
strings grows with them (a trace reader memoises its own few distinct texts).
"""

from __future__ import annotations

import re

#: the largest count a set may name (and so the most counts a set holds): no machine has more
#: cores than this, and the server drops counts above its own machine's anyway
MAX_UNITS = 4096
#: the most alternatives in a ``"1,2,4"`` list
MAX_ALTERNATIVES = 64
#: the longest text looked at (64 alternatives of 4 digits with spaces fit)
MAX_TEXT = 400

_FORMS = "'4', '1-32' or '1,2,4,8'"
# ASCII digits only (``\d`` takes any script's digits, ``str.isdigit`` superscripts that int()
# refuses); whitespace around a count is allowed. A number is at most MAX_TEXT digits, so its
# int() is cheap, and it is compared with the bounds before anything is built from it.
_ONE = re.compile(r"\s*([0-9]+)\s*", re.ASCII)
_RANGE = re.compile(r"\s*([0-9]+)\s*-\s*([0-9]+)\s*", re.ASCII)


def parse_counts(text: str | int, field: str = "units",
                 most: int = MAX_UNITS) -> tuple[int, ...]:
    """``"4"``, ``"1-32"`` or ``"1,2,4,8"`` (an int for one count) -> the whole counts in
    ``1..most`` it names, ascending and distinct (at most ``most`` of them); ValueError names
    ``field`` and the value, without expanding anything."""
    most = min(most, MAX_UNITS)
    raw = text
    if isinstance(text, bool) or not isinstance(text, str | int):
        raise ValueError(f"{field}: expected {_FORMS}, got {_show(raw)}")
    if isinstance(text, int):
        if not 1 <= text <= most:
            raise ValueError(f"{field}: counts must be in 1..{most}, got {_show(raw)}")
        return (text,)
    if len(text) > MAX_TEXT:
        raise ValueError(f"{field}: longer than {MAX_TEXT} characters, got {_show(raw)}")
    if text.count(",") >= MAX_ALTERNATIVES:
        raise ValueError(f"{field}: at most {MAX_ALTERNATIVES} alternatives, got {_show(raw)}")
    if "," not in text:
        if m := _RANGE.fullmatch(text):
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise ValueError(f"{field}: min {lo} > max {hi} in {_show(raw)}")
            _bounds(field, raw, lo, hi, most)
            return tuple(range(lo, hi + 1))
        if m := _ONE.fullmatch(text):
            n = int(m.group(1))
            _bounds(field, raw, n, n, most)
            return (n,)
        raise ValueError(f"{field}: expected {_FORMS}, got {_show(raw)}")
    vals = []
    for part in text.split(","):
        m = _ONE.fullmatch(part)
        if not m:
            raise ValueError(f"{field}: expected {_FORMS} (a list holds single counts), "
                             f"got {_show(raw)}")
        vals.append(int(m.group(1)))
    _bounds(field, raw, min(vals), max(vals), most)
    return tuple(sorted(set(vals)))


def _bounds(field: str, text: str, lo: int, hi: int, most: int) -> None:
    if lo < 1 or hi > most:
        raise ValueError(f"{field}: counts must be in 1..{most}, got {_show(text)}")


def _show(value: object) -> str:
    """The value as the client wrote it, cut short (a refusal must not echo 400 characters)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "...'"
