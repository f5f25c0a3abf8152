"""The compute share of a new lease and the interference estimate it is sized by: apart from
`decide()` because the interference profile's tests and benchmarks size shares with it on their
own."""

from __future__ import annotations

from rose.config import PolicyConfig


def compute_share_for(load: float, slowdown_per_share: float, cfg: PolicyConfig) -> float:
    """The compute share that lands serving's headroom mid-hysteresis, `target = (grant_headroom
    + revoke_headroom) / 2`, given its load now (worst p99 / SLO, rollout not running) and its
    slowdown `1 + a * share` (`a`: the GPU's estimate, the prior before it has one). No credit
    is taken for a time-slicing bound: the estimate is what this GPU showed."""
    a = slowdown_per_share if slowdown_per_share > 0.0 else cfg.interference_prior
    target = (cfg.grant_headroom + cfg.revoke_headroom) / 2.0
    room = (1.0 - target) / load if load > 0.0 else float("inf")  # slowdown serving can take
    if room <= 1.0:
        return 0.0
    share = min((room - 1.0) / a, cfg.max_compute_share)
    share = 0.0 if share < 0.0 else 1.0 if share > 1.0 else round(share, 4)
    return profile_share(share, load, slowdown_per_share, cfg) if cfg.interference_profile else share


def profile_ratio(points: tuple[tuple[float, float], ...], share: float) -> float:
    """Serving's p99 ratio at `share` from the profile's (share, ratio) points: piecewise linear
    between them, the nearest point outside them, 1 at share 0."""
    if share <= 0.0 or not points:
        return 1.0
    if share <= points[0][0]:
        return points[0][1]
    for (s0, r0), (s1, r1) in zip(points, points[1:]):
        if share <= s1:
            return r0 + (r1 - r0) * (share - s0) / (s1 - s0)
    return points[-1][1]


def profile_share(share: float, load: float, per_share: float, cfg: PolicyConfig) -> float:
    """The largest of `share` and the profile's measured shares below it whose predicted p99
    keeps grant_headroom; 0: none does (no grant). Predicted: `load` (worst p99 / SLO now) × the
    larger of the profile's ratio at that share and what this GPU has shown, ``1 + per_share ×
    share`` (`per_share` > 0: its online estimate): the profile is the prior, the GPU's own
    slowdown overrides it where it is worse."""
    limit = 1.0 - cfg.grant_headroom
    pts = cfg.interference_profile
    for s in (share, *sorted((p for p, _ in pts if p < share), reverse=True)):
        if s > 0.0 and load * predicted_ratio(s, per_share, cfg) <= limit:
            return s
    return 0.0


def predicted_ratio(share: float, per_share: float, cfg: PolicyConfig) -> float:
    """Serving's p99 ratio the policy predicts beside a lease at `share`: the profile's ratio
    there (1 without a profile) or, where worse, the GPU's own ``1 + per_share × share``
    (`interference_prior` in its place before the GPU has shown one, when there is no profile)."""
    pts = cfg.interference_profile
    ratio = profile_ratio(pts, share)
    a = per_share if per_share > 0.0 else 0.0 if pts else cfg.interference_prior
    return 1.0 + a * share if 1.0 + a * share > ratio else ratio


SLOWDOWN_BOUNDS = (0.01, 50.0)  # keeps one freak window from zeroing or exploding the estimate


def ewma(old: float, x: float, w: float) -> float:
    return x if old < 0.0 else old + w * (x - old)


def interference_estimate(
    base_load: float, per_share: float, load: float, before: float, share: float, cfg: PolicyConfig
) -> tuple[float, float]:
    """The GPU's interference estimate after an event (docs/policy.md "Interference estimate"):
    serving's load alone (`base_load`) on calm events with no lease running (`share` 0; never on
    an event deferral may hold back: those are not calm), and its slowdown per unit of share on
    the event where a lease's worker started (`before` ≥ 0: serving's load on the event before
    it, which showed no rollout memory), `(load / before - 1) / share`: paired half a second
    apart, so that serving's own load swings under a long lease are not read as interference."""
    w = cfg.interference_weight
    if share > 0.0:
        if before > 0.0:
            lo, hi = SLOWDOWN_BOUNDS
            obs = (load / before - 1.0) / share
            per_share = ewma(per_share, lo if obs < lo else hi if obs > hi else obs, w)
    elif 1.0 - load >= cfg.grant_headroom:
        base_load = ewma(base_load, load, w)
    return base_load, per_share
