"""The core's reading of unit sets: feasible core or GPU counts written ``"4"``, ``"1-32"``
or ``"1,2,4,8"``, as a :class:`~tangram.model.Demand`.

The text is checked and its counts named by :func:`tangram_sdk.units.parse_counts`, the
one parser of the wire format, shared with the SDK (an integration checks its config with
it, so a config the server would refuse fails when it is loaded): its bounds are re-exported
here.
"""

from __future__ import annotations

from tangram.model import Demand
from tangram_sdk.units import MAX_ALTERNATIVES, MAX_TEXT, MAX_UNITS, parse_counts

__all__ = ["MAX_ALTERNATIVES", "MAX_TEXT", "MAX_UNITS", "parse_units"]


def parse_units(text: str | int, field: str = "units", most: int = MAX_UNITS) -> Demand:
    """``"4"``, ``"1-32"`` or ``"1,2,4,8"`` (an int for one count) -> Demand of whole counts
    in ``1..most``; ValueError names ``field`` and the value, without expanding anything
    (:func:`tangram_sdk.units.parse_counts`)."""
    return Demand(parse_counts(text, field, most))
