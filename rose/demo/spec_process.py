"""The shape shared by the demo's own processes (co-served device, trainer): a frozen spec
dataclass passed as `--spec JSON`, config from ROSE_* env, a Redis client, SIGTERM/SIGINT
setting `stop`, then `run()`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any, ClassVar

from rose.shutdown import Shutdown


class JsonSpec:
    """JSON round trip for a frozen dataclass; unknown fields are refused by name."""

    if TYPE_CHECKING:  # subclasses are dataclasses
        __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str):
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("--spec: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = [k for k in d if k not in known]
        if bad:
            raise ValueError(f"{bad[0]}: unknown {cls.__name__} field")
        return cls(**d)


def spec_main(prog: str, spec_cls, make, argv: list[str] | None = None) -> int:
    """Parse `--spec`, build `make(spec, cfg, redis)` and run it until SIGTERM/SIGINT."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--spec", required=True, help=f"{spec_cls.__name__} as JSON")
    a = ap.parse_args(argv)
    try:
        spec = spec_cls.from_json(a.spec)
    except (ValueError, TypeError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    import redis

    from rose.config import load_config
    from rose.obs.logs import setup_logging

    setup_logging("WARNING")
    cfg = load_config()
    r = redis.Redis.from_url(cfg.redis.url)
    obj = make(spec, cfg, r)
    Shutdown.install(name=prog, hooks=(lambda: setattr(obj, "stop", True),))
    try:
        obj.run()
    finally:
        r.close()
    return 0
