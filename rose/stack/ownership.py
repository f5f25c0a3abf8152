"""Whose stack is this: who listens on a stack's ports (this stack, another checkout's stack, or
another program), and what `up` does about it: use another stack's service with a warning, or,
with `up --own`, refuse before starting anything."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rose.stack.errors import NotOwnedError, StackError
from rose.stack.layout import StackLayout
from rose.stack.ports import PORT_ENV, listening
from rose.stack.processes import log


@dataclass
class Holder:
    """A process listening on one of the stack's ports, and the stack it belongs to if any."""

    service: str
    ports: list[int]
    pid: int | None
    cmdline: str = ""
    root: Path | None = None  # state dir of the rose stack that started it
    checkout: str | None = None  # where that stack's `rose stack up` ran

    @property
    def port(self) -> int:
        return self.ports[0]

    def describe(self) -> str:
        where = (
            f"{self.service} port 127.0.0.1:{self.port}"
            if len(self.ports) == 1
            else f"{self.service} ports 127.0.0.1:{','.join(map(str, self.ports))}"
        )
        held = f"{where} {'is' if len(self.ports) == 1 else 'are'} held by"
        if self.pid is None:
            return f"{held} a process this user cannot see"
        if self.root is None:
            return f"{held} pid {self.pid} ({self.cmdline or '?'}), not a rose stack"
        return f"{held} the stack of {self.checkout} (state dir {self.root}, pid {self.pid})"


class StackOwnership(StackLayout):
    """Finds the holders of this stack's ports and claims them for `up`."""

    def claim(self, names: list[str], own: bool = False) -> list[Holder]:
        """Check whose processes listen on these services' ports. Listeners of another stack
        (another checkout's state dir) or of another program: with `own`, NotOwnedError saying
        whose they are and what to do; otherwise a service that answers there is used with a
        warning naming it (this stack will not stop it), and a port held by something that does
        not answer as that service is a StackError (this stack's process could not bind it).
        Returns the holders used."""
        foreign = self.foreign(names)
        if foreign and own:
            raise NotOwnedError(self._not_owned_message(foreign))
        used = []
        for name in names:
            theirs = [h for h in foreign if h.service == name]
            if not theirs:
                continue
            main = next((h for h in theirs if self._ports(name)[0] in h.ports), None)
            if main is None or not getattr(self, f"{name}_alive")():
                raise StackError(self._not_owned_message(theirs))
            log(
                f"using {name} of {'another stack' if main.root else 'another program'}: {main.describe()}; "
                f"this stack ({self.root}) does not own it, and `rose stack down` here will not stop it"
            )
            used.append(main)
        return used

    def holders(self, names: list[str] | tuple[str, ...] = ("kafka", "redis", "jaeger")) -> list[Holder]:
        """Who listens on each port of these services right now (ports nobody holds are left out)."""
        import psutil

        wanted = {port: name for name in names for port in self._ports(name)}
        found: dict[int, int | None] = {}
        try:
            for c in psutil.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in wanted:
                    if c.pid or c.laddr.port not in found:
                        found[c.laddr.port] = c.pid
        except psutil.AccessDenied:
            pass
        for port in wanted:  # a listener psutil could not see (another user's process)
            if port not in found and listening(port):
                found[port] = None
        grouped: dict[tuple[str, int | None], list[int]] = {}
        for port in wanted:  # in the order of _ports: a service's client port first
            if port in found:
                grouped.setdefault((wanted[port], found[port]), []).append(port)
        return [self._holder(name, ports, pid) for (name, pid), ports in grouped.items()]

    def _holder(self, service: str, ports: list[int], pid: int | None) -> Holder:
        import psutil

        h = Holder(service, ports, pid)
        if pid is None:
            return h
        try:
            proc = psutil.Process(pid)
            cmd = proc.cmdline()
            h.cmdline = " ".join(cmd).strip()[:200]
            try:
                cwd = Path(proc.cwd())
            except (psutil.AccessDenied, OSError):
                cwd = None
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return h
        candidates = [Path(a).parent for a in cmd if a.endswith(("server.properties", "jaeger.yaml"))]
        if cwd is not None:
            if cwd.parent.name == "redis-cluster":  # a cluster node: root/redis-cluster/<port>
                candidates += [cwd.parent.parent]
            else:
                candidates += [cwd.parent] if cwd.name == "redis" else [cwd]
        for root in candidates:
            if (root / "stack.json").exists() or any(
                (root / f).exists() for f in ("kafka.pid", "redis.pid", "jaeger.pid", "server.properties")
            ):
                h.root = root.resolve()
                try:
                    h.checkout = json.loads((root / "stack.json").read_text())["checkout"]
                except (OSError, ValueError, KeyError):
                    own_dir = cwd is None or cwd == root or cwd.name == "redis" or cwd.parent.name == "redis-cluster"
                    h.checkout = str(h.root.parent if own_dir else cwd)
                break
        return h

    def foreign(self, names: list[str] | tuple[str, ...] = ("kafka", "redis")) -> list[Holder]:
        """Listeners on this stack's ports that are not this stack's processes."""
        return [h for h in self.holders(names) if h.root != self.root]

    def _not_owned_message(self, foreign: list[Holder], using: bool = True) -> str:
        whose = "; ".join(h.describe() for h in foreign)
        fixes = sorted({h.checkout for h in foreign if h.checkout})
        env = " ".join(f"ROSE_STACK__{v}=…" for n in dict.fromkeys(h.service for h in foreign) for v in PORT_ENV[n])
        stop = f"run `rose stack down` in {' and '.join(fixes)}" if fixes else "stop that process"
        return f"{whose} — not this stack ({self.root}); {stop}, or give this stack other ports ({env})"
