"""Human-readable numbers: binary byte units, parameter counts, rates."""

from __future__ import annotations

import math
import re

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def bytes2human(n: float, precision: int = 1) -> str:
    """``1536 -> '1.5 KiB'``; NaN (an unknown value) prints as ``'N/A'``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "N/A"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in _UNITS:
        if n < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.{precision}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse a size given by a user: ``'24G'``, ``'24 GiB'``, ``'12.5GB'``, ``'512M'``, ``'1000'`` (bytes).

    ``G``/``GiB`` are binary (2**30): GPU memory is sold and reported in binary units.
    ``GB`` with an explicit ``B`` and no ``i`` is decimal (10**9).
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (try 24G, 24GiB, 12.5GB or 512M)")
    value, prefix, binary, b = m.groups()
    power = "kmgtp".find(prefix.lower()) + 1 if prefix else 0
    decimal = bool(b) and not binary and bool(prefix)
    base = 1000 if decimal else 1024
    return int(float(value) * base**power)


def params2human(n: float) -> str:
    """``30_532_122_624 -> '30.53 B'``."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f} {suffix}"
    return str(int(n))
