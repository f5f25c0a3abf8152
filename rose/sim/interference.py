"""The interference profile (`rose.interference_profile.v1`): what rollout beside serving does
to each, measured per share of the GPU rollout is allowed to take.

A profile holds, for the mechanism in use (how rollout shares the GPU: priority streams in
serving's process, a separate process, one with bounded kernel launches, one under MPS), a
list of points ``{share, serving_p99_ratio, serving_mean_ratio, rollout_fraction}``: serving's
p99 and mean step time beside rollout at that share over alone, and rollout's progress at that
share over rollout alone on the whole GPU. Other mechanisms measured on the same device may
travel with it (`others`). Lookup (`serving_p99_ratio`, `serving_mean_ratio`,
`rollout_fraction`): piecewise linear between measured shares (monotone on every segment, no
overshoot), the nearest point outside the measured range, and share 0 (nothing runs): ratio 1,
fraction 0.

`read_profile` validates a file (ProfileError, a ValueError, naming the field and what to do)
and converts the older `rose bench interference --json` result (`from_bench`). The default
profile (`default_profile`) is docs/measured/h200/interference-profile.json, which
`measured_h200_profile` derives from docs/measured/h200/interference.json. `linear_profile`
is the former ``1 + alpha × share`` model as a profile, a labelled sweep option.

`StepMultiplier` is the distribution of serving's per-step slowdown at one point: a two-point
mixture fitted to the point's mean and p99 ratio (docs/simulator.md "Interference").

Pure: numpy only; no I/O apart from `read_profile` and `default_profile`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

SCHEMA = "rose.interference_profile.v1"
MECHANISMS = (
    "same_process_priority",
    "separate_process",
    "separate_process_bounded_launch",
    "separate_process_mps",
)
POINT_FIELDS = ("share", "serving_p99_ratio", "serving_mean_ratio", "rollout_fraction")
REPO = Path(__file__).resolve().parents[2]
H200_BENCH = REPO / "docs" / "measured" / "h200" / "interference.json"
DEFAULT_PROFILE_PATH = REPO / "docs" / "measured" / "h200" / "interference-profile.json"
# The simulator's default: serving's ratios and rollout's fractions from the same runs of the
# executor's mechanism (real decode steps, 8B shape, rollout in its own process, every share):
# docs/measured/h200/README.md "Real decode steps"
SIM_PROFILE_PATH = REPO / "docs" / "measured" / "h200" / "interference-profile-8b-separate_process.json"
LINEAR_SHARES = tuple(round(0.01 * i, 2) for i in range(1, 101))  # the grid a linear profile is drawn on


class ProfileError(ValueError):
    """An interference profile (or bench result) that cannot be used: the message names the field."""


@dataclass(frozen=True)
class ProfilePoint:
    share: float
    serving_p99_ratio: float
    serving_mean_ratio: float
    rollout_fraction: float

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in POINT_FIELDS}


@dataclass(frozen=True)
class InterferenceProfile:
    """The points of the mechanism in use (sorted by share), where they come from, and the
    other mechanisms measured beside it (name -> points)."""

    mechanism: str
    source: str
    points: tuple[ProfilePoint, ...]
    device: str = ""
    others: tuple[tuple[str, tuple[ProfilePoint, ...]], ...] = ()
    _grid: tuple[np.ndarray, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_points(self.points, "points")
        cols = [np.array([getattr(p, k) for p in self.points], dtype=np.float64) for k in POINT_FIELDS]
        object.__setattr__(self, "_grid", tuple(cols))

    def _at(self, share, col: int, at_zero: float) -> np.ndarray:
        x = np.asarray(share, dtype=np.float64)
        y = np.interp(x, self._grid[0], self._grid[col])  # holds the end points outside the range
        return np.where(x > 0.0, y, at_zero)

    def serving_p99_ratio(self, share) -> np.ndarray:
        return self._at(share, 1, 1.0)

    def serving_mean_ratio(self, share) -> np.ndarray:
        return self._at(share, 2, 1.0)

    def rollout_fraction(self, share) -> np.ndarray:
        return self._at(share, 3, 0.0)

    def label(self) -> dict:
        return {"source": self.source, "mechanism": self.mechanism}

    def policy_points(self) -> tuple[tuple[float, float], ...]:
        """(share, serving p99 ratio) pairs: what the lease policy's prior reads (PolicyConfig)."""
        return tuple((p.share, p.serving_p99_ratio) for p in self.points)

    def to_json(self) -> dict:
        out: dict = {
            "schema": SCHEMA,
            "mechanism": self.mechanism,
            "device": self.device,
            "source": self.source,
            "points": [p.to_json() for p in self.points],
        }
        if self.others:
            out["mechanisms"] = {m: [p.to_json() for p in pts] for m, pts in self.others}
        return out


@dataclass(frozen=True)
class StepMultiplier:
    """Serving's step time beside rollout over alone, per step: a two-point mixture with the
    given mean and p99. A step either meets a running rollout kernel and waits (the upper atom)
    or does not (the lower one), which is what the H200 measurement shows (a p99 nearly flat in
    the share, a mean growing with it). Unlike a lognormal it fits any pair, also a mean above
    the p99 (a rare long wait, the H200's same-process share 1): then fewer than 1 % of the
    steps take the long one.

    mean <= p99: the upper atom is the p99 with weight ``pi = (mean - 1) / (p99 - 1)`` and the
    lower is 1 (steps as alone), when that puts at least PI_MIN of the steps on the upper atom;
    otherwise ``pi = PI_MIN`` and the lower atom carries the rest of the mean.
    mean > p99: the lower atom is the p99 with weight ``1 - PI_RARE`` and the upper carries the
    rest of the mean."""

    mean: float
    p99: float

    PI_MIN = 0.02  # the upper atom holds at least this: the 99th percentile falls on it
    PI_RARE = 0.005  # below 1 %: the 99th percentile falls on the lower atom

    def atoms(self) -> tuple[float, float, float]:
        """(lower, upper, weight of the upper)."""
        m, q = self.mean, self.p99
        if m <= q:
            if q > 1.0 and (m - 1.0) / (q - 1.0) >= self.PI_MIN:
                return 1.0, q, (m - 1.0) / (q - 1.0)
            if q == m:
                return q, q, 1.0
            pi = self.PI_MIN
            return (m - pi * q) / (1.0 - pi), q, pi
        return q, q + (m - q) / self.PI_RARE, self.PI_RARE

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        lo, hi, pi = self.atoms()
        return np.where(rng.random(n) < pi, hi, lo)


def _check_points(points, where: str) -> None:
    if not points:
        raise ProfileError(f"{where}: no point; give at least one {{share, serving_p99_ratio, ...}}")
    shares = [p.share for p in points]
    if shares != sorted(shares) or len(set(shares)) != len(shares):
        raise ProfileError(f"{where}: shares must be distinct and increasing, got {shares}")


def _number(d: dict, key: str, where: str, lo: float, hi: float, lo_open: bool = False) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProfileError(f"{where}.{key}: expected a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        bound = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise ProfileError(f"{where}.{key}: {v} is outside {bound}")
    return float(v)


def _points(raw, where: str) -> tuple[ProfilePoint, ...]:
    if not isinstance(raw, list) or not raw:
        raise ProfileError(f"{where}: expected a non-empty list of points {{{', '.join(POINT_FIELDS)}}}")
    out = []
    for i, d in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(d, dict):
            raise ProfileError(f"{w}: expected an object with {', '.join(POINT_FIELDS)}")
        out.append(
            ProfilePoint(
                _number(d, "share", w, 0.0, 1.0, lo_open=True),
                _number(d, "serving_p99_ratio", w, 0.0, 1e6, lo_open=True),
                _number(d, "serving_mean_ratio", w, 0.0, 1e6, lo_open=True),
                _number(d, "rollout_fraction", w, 0.0, 1.0),
            )
        )
    pts = tuple(sorted(out, key=lambda p: p.share))
    _check_points(pts, where)
    return pts


def profile_from_json(d: dict) -> InterferenceProfile:
    """A `rose.interference_profile.v1` object, validated (ProfileError naming the field)."""
    if not isinstance(d, dict):
        raise ProfileError("expected one JSON object (rose.interference_profile.v1)")
    if d.get("schema") != SCHEMA:
        raise ProfileError(f"schema: expected {SCHEMA!r}, got {d.get('schema')!r}")
    mech = d.get("mechanism")
    if not isinstance(mech, str) or not mech:
        raise ProfileError(f"mechanism: expected a name ({', '.join(MECHANISMS)} or another), got {mech!r}")
    source = d.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ProfileError("source: expected a non-empty string saying where the points come from")
    device = d.get("device", "")
    if not isinstance(device, str):
        raise ProfileError(f"device: expected a string, got {device!r}")
    mechs = d.get("mechanisms", {})
    if not isinstance(mechs, dict):
        raise ProfileError("mechanisms: expected an object, mechanism name -> list of points")
    others = tuple((str(m), _points(v, f"mechanisms.{m}")) for m, v in sorted(mechs.items()))
    if "points" in d:
        points = _points(d["points"], "points")
    elif mech in mechs:
        points = dict(others)[mech]
    else:
        raise ProfileError(f"points: missing, and mechanisms has no {mech!r}; give the points of the mechanism in use")
    return InterferenceProfile(mech, source, points, device, tuple((m, p) for m, p in others if m != mech))


def from_bench(b: dict, source: str) -> InterferenceProfile:
    """A `rose bench interference --json` result as a profile (its phases per mechanism).

    From a GPU (phases `low_priority_share_*`, `separate_process_share_*`): one point per
    phase, p99 and mean over the `alone` phase. The separate-process phases do not time
    rollout, so their rollout fraction is the same-process phase's at that share (labelled in
    `source`). The mechanism in use is the executor's, `separate_process`, when measured.
    From the CPU bench (no phases): one point at share 1, the unprotected p99 ratio for both."""
    if not isinstance(b, dict):
        raise ProfileError("--interference-bench: expected one JSON object (`rose bench interference --json`)")
    phases = b.get("phases")
    device = str(b.get("gpu_name") or b.get("device") or "")
    if not isinstance(phases, dict) or "alone" not in phases:
        r = b.get("unprotected_p99_over_alone")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ProfileError(
                "--interference-bench: expected phases (a GPU result) or a positive unprotected_p99_over_alone "
                "(the output of `rose bench interference --json`)"
            )
        pt = ProfilePoint(1.0, float(r), float(r), 1.0 / float(r))
        return InterferenceProfile(
            "same_process_priority", f"{source}: unprotected p99 / alone = {r} at share 1 (CPU bench)", (pt,), device
        )
    alone = phases["alone"]
    try:
        p99_0, mean_0 = float(alone["p99_ms"]), float(alone["mean_ms"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"--interference-bench: phases.alone needs p99_ms and mean_ms ({e})") from None
    same: dict[float, tuple[float, float, float]] = {}
    sep: dict[float, tuple[float, float]] = {}
    for name, ph in phases.items():
        if not isinstance(ph, dict):
            continue
        try:
            share, p99, mean = float(ph["share"]), float(ph["p99_ms"]), float(ph["mean_ms"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"--interference-bench: phases.{name} needs share, p99_ms and mean_ms ({e})") from None
        if name.startswith("low_priority_share_"):
            same[share] = (p99 / p99_0, mean / mean_0, float(ph.get("rollout_over_alone") or 0.0))
        elif name.startswith("separate_process_share_"):
            sep[share] = (p99 / p99_0, mean / mean_0)
    if not same:
        raise ProfileError("--interference-bench: no low_priority_share_* phase to read")

    def frac(s: float) -> float:
        xs = sorted(same)
        return float(np.interp(s, xs, [same[x][2] for x in xs]))

    def pts(rows) -> tuple[ProfilePoint, ...]:
        return tuple(ProfilePoint(s, round(a, 4), round(m, 4), round(f, 4)) for s, (a, m, f) in sorted(rows.items()))

    same_pts = pts(same)
    where = f"{source} ({device})" if device else source
    if sep:
        sep_pts = pts({s: (a, m, frac(s)) for s, (a, m) in sep.items()})
        return InterferenceProfile(
            "separate_process",
            f"{where}: separate-process phases' p99 and mean ratios (shares {', '.join(f'{s:g}' for s in sorted(sep))}), "
            "with the rollout fractions of the same-process low-priority phases at those shares (labelled: "
            "the separate-process phases do not time rollout)",
            sep_pts,
            device,
            (("same_process_priority", same_pts),),
        )
    return InterferenceProfile("same_process_priority", f"{where}: low-priority phases", same_pts, device)


def read_profile(path: Path) -> InterferenceProfile:
    """A profile file, or a `rose bench interference --json` result (converted by `from_bench`)."""
    import orjson

    try:
        d = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise ProfileError(f"cannot read {path}: {e}") from None
    if isinstance(d, dict) and "schema" not in d and ("phases" in d or "unprotected_p99_over_alone" in d):
        return from_bench(d, str(path))
    try:
        return profile_from_json(d)
    except ProfileError as e:
        raise ProfileError(f"{path}: {e}") from None


def measured_h200_profile() -> InterferenceProfile:
    """The default profile, derived from docs/measured/h200/interference.json (`from_bench`)."""
    import orjson

    return from_bench(orjson.loads(H200_BENCH.read_bytes()), "docs/measured/h200/interference.json")


@cache
def default_profile() -> InterferenceProfile:
    """docs/measured/h200/interference-profile.json: the executor's mechanism (separate_process) on an H200."""
    return read_profile(DEFAULT_PROFILE_PATH)


@cache
def simulation_profile() -> InterferenceProfile:
    """`rose simulate`'s default: docs/measured/h200/interference-profile-8b-separate_process.json,
    whose serving ratios and rollout fractions come from the same runs of one mechanism."""
    return read_profile(SIM_PROFILE_PATH)


@cache
def linear_profile(alpha: float) -> InterferenceProfile:
    """The former model as a profile (a sweep option, labelled): serving's ratio ``1 + alpha ×
    share`` (p99 and mean alike) capped at the time-slicing bound ``1 / (1 - share)``, and
    rollout's fraction equal to its share; drawn on shares 0.01 .. 1."""
    if isinstance(alpha, bool) or not math.isfinite(alpha) or alpha < 0:
        raise ProfileError(f"alpha: expected a number >= 0, got {alpha!r}")
    pts = []
    for s in LINEAR_SHARES:
        r = min(1.0 + alpha * s, 1.0 / (1.0 - s)) if s < 1.0 else 1.0 + alpha
        pts.append(ProfilePoint(s, r, r, s))
    return InterferenceProfile("linear", f"linear alpha={alpha:g} (sweep)", tuple(pts))


def write_default_profile(path: Path = DEFAULT_PROFILE_PATH) -> None:
    """Write the default profile file from the H200 bench result."""
    import orjson

    Path(path).write_bytes(orjson.dumps(measured_h200_profile().to_json(), option=orjson.OPT_INDENT_2) + b"\n")


if __name__ == "__main__":  # python -m rose.sim.interference: regenerate the default profile file
    write_default_profile()
