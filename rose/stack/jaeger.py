"""The stack's Jaeger v2 (optional: `rose stack up --jaeger`), for looking at the OpenTelemetry
traces: built once from the Go module proxy into root/bin/jaeger, configured with in-memory
storage and every listener on loopback at the [stack] ports, ready when its query API answers
and its OTLP receivers listen."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from rose.stack.errors import StackError
from rose.stack.ports import listening
from rose.stack.processes import StackProcesses, log


class JaegerServer(StackProcesses):
    """Builds, configures, starts, checks and stops the stack's Jaeger."""

    @property
    def jaeger_bin(self) -> Path:
        return self.root / "bin" / "jaeger"

    @property
    def jaeger_query_url(self) -> str:
        return f"http://127.0.0.1:{self.scfg.jaeger_query_port}"

    @property
    def jaeger_otlp_endpoint(self) -> str:
        """Where OTLP/HTTP exporters send to (the traces path is /v1/traces under it)."""
        return f"http://127.0.0.1:{self.scfg.jaeger_otlp_http_port}"

    @property
    def jaeger_otlp_grpc_endpoint(self) -> str:
        return f"127.0.0.1:{self.scfg.jaeger_otlp_grpc_port}"

    def _go(self) -> str:
        go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
        if not go:
            raise StackError("Go 1.24+ is needed to build Jaeger (https://go.dev/dl/, or apt-get install golang)")
        return go

    def build_jaeger(self) -> Path:
        """Build Jaeger v2 (`cmd/jaeger`, the OpenTelemetry-collector-based all-in-one) once from
        the Go module proxy into root/bin/jaeger; later calls reuse the binary while its version
        stamp matches [stack] jaeger_version."""
        binary, stamp = self.jaeger_bin, self.jaeger_bin.with_name("jaeger.version")
        version = self.scfg.jaeger_version
        if binary.exists() and stamp.exists() and stamp.read_text().strip() == version:
            return binary
        go = self._go()
        bdir = self.root / "jaeger-build"
        bdir.mkdir(parents=True, exist_ok=True)
        binary.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": os.environ.get("GOFLAGS", "-buildvcs=false")}
        pkg = "github.com/jaegertracing/jaeger/cmd/jaeger"
        t0 = time.monotonic()
        log(f"building Jaeger {version} from the Go module proxy into {binary} (once; minutes) ...")
        if not (bdir / "go.mod").exists():
            self._go_step([go, "mod", "init", "rosejaeger"], bdir, env, "go mod init", t0)
        self._go_step([go, "get", "-tool", f"{pkg}@{version}"], bdir, env, "downloading modules", t0)
        tmp = binary.with_name("jaeger.partial")
        self._go_step([go, "build", "-v", "-o", str(tmp), pkg], bdir, env, "compiling", t0)
        tmp.rename(binary)
        stamp.write_text(version + "\n")
        log(f"built {binary} in {time.monotonic() - t0:.0f}s")
        return binary

    def _go_step(self, cmd: list[str], cwd: Path, env: dict, what: str, t0: float) -> None:
        """Run one go command, its output to jaeger-build/build.log, a progress line every 15 s."""
        build_log = cwd / "build.log"
        with open(build_log, "a") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
            start = build_log.stat().st_size
            while True:
                try:
                    rc = proc.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    with open(build_log, "rb") as r:
                        r.seek(start)
                        lines = r.read().count(b"\n")
                    log(f"jaeger: {what}, {lines} packages so far, {time.monotonic() - t0:.0f}s elapsed")
        if rc != 0:
            tail = build_log.read_text(errors="replace")[-2000:]
            raise StackError(f"`go {cmd[1]}` failed ({rc}) building Jaeger; see {build_log}\n{tail}")

    def jaeger_config(self) -> str:
        """Jaeger v2's all-in-one pipeline (OTLP in, in-memory storage, query UI/API), every
        listener on loopback at the [stack] ports, and no other listener (the built-in default
        config also opens Zipkin, Jaeger-thrift, sampling, health and metrics ports), and no
        self-tracing (jaeger_query would export its own spans to localhost:4317)."""
        s = self.scfg
        # the Go module has no built UI: without a jaeger-ui build the query port serves the API
        # (/api/services, /api/traces/ID) and a placeholder page
        ui = f"\n    ui:\n      assets_path: {Path(s.jaeger_ui_dir).resolve()}" if s.jaeger_ui_dir else ""
        return f"""\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    resource:
      service.name: jaeger
    metrics:
      level: none
    logs:
      level: info

extensions:
  jaeger_query:
    storage:
      traces: memstore
    enable_tracing: false{ui}
    http:
      endpoint: 127.0.0.1:{s.jaeger_query_port}
    grpc:
      endpoint: 127.0.0.1:0

  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000

receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{s.jaeger_otlp_grpc_port}
      http:
        endpoint: 127.0.0.1:{s.jaeger_otlp_http_port}

processors:
  batch:

exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""

    def jaeger_up(self, timeout_s: float = 60.0) -> None:
        if self.jaeger_alive():
            return
        binary = self.build_jaeger()
        conf = self.root / "jaeger.yaml"
        conf.write_text(self.jaeger_config())
        self._mark()
        with open(self.root / "jaeger.log", "ab") as out:
            proc = subprocess.Popen(
                [str(binary), "--config", str(conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.root,
            )
        self._pidfile("jaeger").write_text(str(proc.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.root / "jaeger.log").read_text(errors="replace")[-2000:]
                raise StackError(f"Jaeger exited with code {proc.returncode}; see {self.root}/jaeger.log\n{tail}")
            # the query extension answers a moment before the OTLP receivers listen
            if self.jaeger_alive() and all(listening(p) for p in self._ports("jaeger")[1:]):
                return
            time.sleep(0.1)
        raise StackError(
            f"Jaeger's query API did not answer on {self.jaeger_query_url} within {timeout_s}s; "
            f"see {self.root}/jaeger.log"
        )

    def jaeger_alive(self, timeout_s: float = 1.0) -> bool:
        """The query API answers /api/services with its JSON envelope."""
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.jaeger_query_url}/api/services", timeout=timeout_s) as r:
                return r.status == 200 and "data" in json.loads(r.read() or b"{}")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def jaeger_started(self) -> bool:
        """`up --jaeger` started Jaeger and `down` has not stopped it (its pid file is there)."""
        return self._pidfile("jaeger").exists()
