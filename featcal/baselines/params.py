"""One parameter of a registered method (:class:`Param`): its default, range, choices and help,
and the one check every value passes (a number, a switch, a string, a choice; in range; finite)
before any work, whether it comes from the command line (:func:`parse_value`), the app or the
library. :mod:`featcal.baselines.registry` builds each method's parameters from these."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from featcal.util.options import Range


class ParamError(TypeError, ValueError):
    """A parameter a method does not take, or a value of the wrong type (a TypeError and a ValueError)."""


@dataclass(frozen=True)
class Param:
    """One parameter: its ``default``, its :class:`~featcal.util.options.Range` where it has one
    (the app's slider; what a run accepts), the ``choices`` of a string parameter, one line of
    ``help``; ``after``: the default per upstream merger where it depends on it
    (``{merger: default}``, SVC's ``alpha``; ``default`` after any other)."""

    name: str
    default: Any
    range: Range | None = None
    choices: tuple | None = None
    help: str = ""
    after: Mapping[str, Any] | None = None

    def default_after(self, merger: str | None) -> Any:
        """The default after ``merger`` (a registry name; None: not known)."""
        return (self.after or {}).get(merger, self.default)

    def check(self, method: str, value: Any) -> Any:
        """``value`` as this parameter takes it (an int given for a float becomes a float), or a
        ``ValueError`` naming the method, the parameter and what it takes. A number may also come
        per task, as ``{task: number}`` (mergekit's per-model densities): each is checked."""
        d = self.default
        if isinstance(value, Mapping) and isinstance(d, (int, float)) and not isinstance(d, bool):
            return {k: self.check(method, v) for k, v in value.items()}
        want = None
        if isinstance(d, bool):
            want, ok = "true or false", isinstance(value, bool)
        elif isinstance(d, int):
            want, ok = "a whole number", isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(d, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            want, value = "a number", float(value) if ok else value
            if ok and not math.isfinite(value):  # NaN in, error out
                want, ok = "a finite number", False
        elif isinstance(d, str):
            want, ok = "a string", isinstance(value, str)
        else:
            ok = True
        if self.choices is not None and value not in self.choices:
            want, ok = f"one of {', '.join(map(str, self.choices))}", False
        if ok and self.range is not None and not self.range.admits(value):
            low, high = self.range.accept
            want, ok = f"a number in [{low:g}, {high:g}] ({self.range.what})", False
        if not ok:
            raise ParamError(f"{method}: parameter {self.name!r} takes {want}, got {value!r}.")
        return value


def parse_value(text: str) -> Any:
    """A command-line value: ``true``/``false``, a whole number, a number, or the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text
