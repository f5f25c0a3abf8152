"""Benchmarks run by `rose bench NAME --json`.

Each module here defines `run(cfg, quick: bool) -> dict` and a one-line docstring.
Figures carry their unit in their name (`events_per_s`, `p99_ms`) and each goal is
printed beside its measurement as a ratio, measured in the same run: nothing here is
asserted, it is reported.
"""

from __future__ import annotations

import importlib
import pkgutil


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str):
    if name not in names():
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")
