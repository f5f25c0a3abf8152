"""PNG figures with matplotlib's Agg backend (no display needed): the simulator's report, the
demo's report and the benches' plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (ImportError where matplotlib is not installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, **layout: Any) -> Path:
    """Lay `fig` out (`layout`: tight_layout's arguments), write it to `path` at 110 dpi, its
    folder made, and close it."""
    fig.tight_layout(**layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
