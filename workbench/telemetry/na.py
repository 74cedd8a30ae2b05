"""``NA``: the value of a field this machine cannot report.

``NA`` is a float NaN that prints as ``"N/A"``: arithmetic on it gives NaN, comparisons are false,
``bytes2human(NA)`` and ``format(NA, ".1f")`` give ``"N/A"``, so display code never branches on None.
"""

from __future__ import annotations

import math
import re
from typing import Any

_SPEC = re.compile(r"^(?:(.)?([<>=^]))?[-+ ]?z?#?0?(\d*)")


class NaType(float):
    """The type of :data:`NA` (a NaN float with a readable ``str``)."""

    _instance: NaType | None = None

    def __new__(cls) -> NaType:
        if cls._instance is None:
            cls._instance = super().__new__(cls, math.nan)
        return cls._instance

    def __repr__(self) -> str:
        return "NA"

    def __str__(self) -> str:
        return "N/A"

    def __format__(self, spec: str) -> str:
        # Keep fill, alignment and width of a numeric spec ("8.1f" -> "     N/A"); drop the rest.
        m = _SPEC.match(spec)
        fill, align, width = m.group(1) or "", m.group(2) or ">", m.group(3)
        return format("N/A", f"{fill}{'>' if align == '=' else align}{width}")

    def __reduce__(self):
        return (NaType, ())


NA = NaType()


def is_na(value: Any) -> bool:
    """True for ``NA``, ``None`` and NaN floats."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def jsonable(value: Any) -> Any:
    """Return ``value`` with every NA/NaN replaced by ``None`` (strict JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
