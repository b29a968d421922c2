"""Memory budgets: bytes (``"2GiB"``, ``"512MB"``, an int) or a percentage of the plain PyTorch peak."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30,
          "T": 2**40}


@dataclass(frozen=True)
class Budget:
    """A peak-memory budget for one training step.

    Attributes:
        nbytes: absolute bound on the total peak (bytes), or ``None`` when given as a fraction.
        fraction: fraction of the plain PyTorch total peak (``0.4`` for ``"40%"``), or ``None``.
        minimum: ``"min"``: the smallest budget memfit can plan for (the least memory, whatever the time).
    """

    nbytes: int | None = None
    fraction: float | None = None
    minimum: bool = False

    @classmethod
    def parse(cls, spec) -> Budget:
        """Parse ``"2GiB"``, ``"512MB"``, ``"1.5G"``, ``123456789`` (bytes), ``"40%"`` or ``"min"``.

        Raises:
            ValueError: the text is not a size of at least one byte or a percentage in (0, 100], a
                number of bytes is not whole (``1.5``), or a bare number is 100 or less (``90``: a percentage
                without its ``%``; ``"90B"`` is taken as bytes).
        """
        if isinstance(spec, Budget):
            return spec
        typed = spec  # (what to echo: "1e400" was shown as inf)
        if isinstance(spec, str):  # a bare number written as text ("1234", "6e9") means what the number means
            for kind in (int, float):
                try:
                    spec = kind(spec.strip())
                    break
                except ValueError:
                    pass
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            if isinstance(spec, float) and not math.isfinite(spec):
                raise ValueError(f"budget {typed!r}: not a number of bytes; write e.g. '2GiB', '40%' or 'min'")
            if 0 < spec < 1:  # a fraction, most likely ("0.4" read as 0 bytes)
                raise ValueError(f"budget {spec!r}: a bare number is a count of bytes; for a fraction of plain "
                                 f"PyTorch's peak write a percentage, '{100 * spec:g}%'")
            if int(spec) <= 0:
                raise ValueError(f"budget {spec!r}: must be at least one byte (or a percentage such as '40%', "
                                 "or 'min' for the least memory memfit can reach)")
            if isinstance(spec, float) and not spec.is_integer():
                raise ValueError(f"budget {spec!r}: a number is a count of bytes and must be whole; write "
                                 f"'{spec:g}GiB' for gibibytes, or a percentage of plain PyTorch's peak such as "
                                 "'40%'")
            if int(spec) <= 100:  # a percentage without its sign, most likely ("90" was taken as 90 bytes)
                raise ValueError(f"budget {spec!r}: a bare number is a count of bytes, and {int(spec)} bytes hold no "
                                 f"training step; for a percentage of plain PyTorch's peak write '{int(spec)}%' (or "
                                 f"'{int(spec)}B' if you mean bytes)")
            return cls(nbytes=int(spec))
        text = str(spec).strip()
        if text.lower() == "min":
            return cls(minimum=True)
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                raise ValueError(f"budget {spec!r}: expected a percentage such as '40%'") from None
            if not 0 < pct <= 100:
                raise ValueError(f"budget {spec!r}: a percentage must be in (0, 100]")
            return cls(fraction=pct / 100)
        number = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"  # (an exponent too: "1e9B", as a bare "1e9")
        match = re.fullmatch(number + r"\s*([A-Za-z]*)", text)
        if re.fullmatch(r"-\s*" + number + r"\s*([A-Za-z]*)", text):
            raise ValueError(f"budget {spec!r}: must be positive; write e.g. '2GiB', a percentage of plain "
                             "PyTorch's peak such as '40%', or 'min' for the least memory memfit can reach")
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(f"budget {spec!r}: expected bytes such as '2GiB', '512MB', 1000000 or a "
                             "percentage such as '40%', or 'min'")
        value, unit = float(match.group(1)), _UNITS[match.group(2).upper()]
        if unit == 1 and value >= 1 and not value.is_integer():
            raise ValueError(f"budget {spec!r}: a count of bytes must be whole; write e.g. "
                             f"'{value:g}GiB' for gibibytes, or a percentage such as '40%'")
        nbytes = int(value * unit)
        if nbytes <= 0:
            raise ValueError(f"budget {spec!r}: must be at least one byte (or a percentage such as '40%', or "
                             "'min' for the least memory memfit can reach)")
        return cls(nbytes=nbytes)

    def resolve(self, plain_peak_bytes: int, smallest_feasible: int | None = None) -> int:
        """The budget in bytes, given the plain PyTorch total peak and, for ``"min"``, the smallest feasible
        budget (bytes)."""
        if self.minimum:
            if smallest_feasible is None:
                raise ValueError("budget 'min' needs the smallest feasible budget")
            return smallest_feasible
        if self.nbytes is not None:
            return self.nbytes
        return int(self.fraction * plain_peak_bytes)


#: the binary units :func:`fmt_bytes` writes, smallest first
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def byte_unit(n: float) -> str:
    """The unit :func:`fmt_bytes` writes ``n`` bytes in: ``1536 -> 'KiB'``."""
    for unit in BYTE_UNITS:
        if abs(n) < 1024 or unit == "TiB":
            return unit
        n /= 1024
    return "TiB"


def fmt_bytes(n: float | None, unit: str | None = None, decimals: int = 1) -> str:
    """``1536 -> '1.5 KiB'``; with ``unit`` in that unit (``fmt_bytes(1.5 * 2**30, "MiB") -> '1536.0 MiB'``), and
    ``decimals`` after the point (bytes have none), so that figures side by side show the same resolution."""
    if n is None:
        return "-"
    unit = unit or byte_unit(n)
    n = n / 1024 ** BYTE_UNITS.index(unit)
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{decimals}f} {unit}"
