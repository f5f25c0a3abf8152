"""The local development stack: one Apache Kafka (KRaft, combined broker+controller) and one
Redis, on loopback, owned by this module from download to shutdown.

Kafka's jars come from Maven Central (deploy/kafka/pom.xml, `mvn dependency:copy-dependencies`),
the broker runs as `java -cp libs/* kafka.Kafka server.properties` with a bounded heap, and
readiness is decided by asking the broker for cluster metadata (and Redis for PING), never
by sleeping. `down` stops only the processes `up` started (tracked by pid files).

`up --jaeger` adds Jaeger v2 (built once from the Go module proxy into root/bin/jaeger, run
with in-memory storage, every listener on loopback) for looking at the OpenTelemetry traces.
Each stack writes root/stack.json (where its `up` ran): a stack finding another one on its
ports says whose it is, and `up --own` (used by `make test`) refuses to run on it.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rose.config import Config, StackConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
POM = REPO_ROOT / "deploy" / "kafka" / "pom.xml"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class StackError(RuntimeError):
    """The stack cannot be started; the message says what to install or fix."""


class NotOwnedError(StackError):
    """This stack's ports are held by another stack (another checkout) or another program."""


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


# the environment variables that set each service's ports (`ROSE_STACK__<NAME>`)
_PORT_ENV = {
    "kafka": ["KAFKA_PORT", "CONTROLLER_PORT", "SASL_PORT", "TLS_PORT"],
    "redis": ["REDIS_PORT"],
    "jaeger": ["JAEGER_QUERY_PORT", "JAEGER_OTLP_GRPC_PORT", "JAEGER_OTLP_HTTP_PORT"],
}


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _log(msg: str) -> None:
    print(f"[stack] {msg}", file=sys.stderr, flush=True)


def kafka_cluster_id() -> str:
    """A random KRaft cluster id as Kafka makes one (`Uuid.randomUuid`): url-safe base64 of 16
    bytes, never starting with `-`, which the storage tool's argument parser would read as a flag
    (one id in 64 would make `rose stack up` fail on a fresh machine)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


@dataclass
class LocalStack:
    scfg: StackConfig
    kafka_bootstrap: str
    redis_url: str

    @classmethod
    def from_config(cls, cfg: Config) -> LocalStack:
        return cls(
            cfg.stack,
            kafka_bootstrap=f"127.0.0.1:{cfg.stack.kafka_port}",
            redis_url=f"redis://127.0.0.1:{cfg.stack.redis_port}/0",
        )

    # ---- paths -------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return Path(self.scfg.data_dir).resolve()

    @property
    def libs(self) -> Path:
        return self.root / f"kafka-{self.scfg.kafka_version}-libs"

    def _pidfile(self, name: str) -> Path:
        return self.root / f"{name}.pid"

    # ---- Kafka -------------------------------------------------------------------------
    def fetch_kafka(self) -> None:
        """Download the broker's jars once (Maven Central) into the data dir."""
        if self.libs.is_dir() and any(self.libs.glob("kafka_2.13-*.jar")):
            return
        if not shutil.which("mvn"):
            raise StackError("Maven (mvn) is needed to fetch Apache Kafka's jars: apt-get install maven")
        _log(f"fetching Apache Kafka {self.scfg.kafka_version} jars from Maven Central ...")
        tmp = self.libs.with_suffix(".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        r = subprocess.run(
            [
                "mvn",
                "-q",
                "-B",
                "-f",
                str(POM),
                f"-Dkafka.version={self.scfg.kafka_version}",
                "dependency:copy-dependencies",
                f"-DoutputDirectory={tmp}",
                "-DincludeScope=runtime",
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise StackError(
                f"mvn could not fetch Kafka {self.scfg.kafka_version}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
            )
        tmp.rename(self.libs)

    @property
    def tls_dir(self) -> Path:
        return self.root / "tls"

    def ensure_tls(self) -> bool:
        """A throw-away CA and a server certificate for 127.0.0.1/localhost (openssl), for the
        TLS listener that tests secured client configs; False (no TLS listener) without openssl."""
        d = self.tls_dir
        if (d / "server.pem").exists() and (d / "ca.pem").exists():
            return True
        if not shutil.which("openssl"):
            return False
        d.mkdir(parents=True, exist_ok=True)
        ext = d / "san.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        steps = [
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "3650",
                "-subj",
                "/CN=rose-local-ca",
                "-keyout",
                str(d / "ca.key"),
                "-out",
                str(d / "ca.pem"),
            ],
            [
                "openssl",
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=localhost",
                "-keyout",
                str(d / "server.key"),
                "-out",
                str(d / "server.csr"),
            ],
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                str(d / "server.csr"),
                "-CA",
                str(d / "ca.pem"),
                "-CAkey",
                str(d / "ca.key"),
                "-CAcreateserial",
                "-days",
                "3650",
                "-extfile",
                str(ext),
                "-out",
                str(d / "server.crt"),
            ],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise StackError(f"openssl failed making the local TLS certificate: {r.stderr[-500:]}")
        # Kafka's PEM keystore: the PKCS#8 private key followed by the certificate chain
        (d / "server.pem").write_text(
            (d / "server.key").read_text() + (d / "server.crt").read_text() + (d / "ca.pem").read_text()
        )
        return True

    def server_properties(self) -> dict[str, str]:
        s = self.scfg
        tls = self.ensure_tls()
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{s.controller_port}",
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{s.kafka_port},CONTROLLER://127.0.0.1:{s.controller_port},"
                f"SASL_PLAINTEXT://127.0.0.1:{s.sasl_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{s.kafka_port},SASL_PLAINTEXT://127.0.0.1:{s.sasl_port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
            # a SCRAM listener, so secured client configs (sasl.*) are tested against a real broker;
            # users are created with AdminClient.alter_user_scram_credentials
            "sasl.enabled.mechanisms": "SCRAM-SHA-256,SCRAM-SHA-512",
            "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "log.dirs": str(self.root / "kafka-data"),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "8",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            # hostile-input tests produce 10 MB values; they must reach the broker to reach the dlq
            "message.max.bytes": str(16 << 20),
            "replica.fetch.max.bytes": str(16 << 20),
            "log.segment.bytes": str(64 << 20),
            "log.cleaner.dedupe.buffer.size": str(16 << 20),
            "log.retention.hours": "24",
        }
        if tls:
            props["listeners"] += f",SSL://127.0.0.1:{s.tls_port}"
            props["advertised.listeners"] += f",SSL://127.0.0.1:{s.tls_port}"
            props["listener.security.protocol.map"] += ",SSL:SSL"
            props["listener.name.ssl.ssl.keystore.type"] = "PEM"
            props["listener.name.ssl.ssl.keystore.location"] = str(self.tls_dir / "server.pem")
            props["listener.name.ssl.ssl.client.auth"] = "none"
        return props

    def _write_config(self) -> Path:
        props = self.root / "server.properties"
        props.write_text("".join(f"{k}={v}\n" for k, v in self.server_properties().items()))
        (self.root / "log4j2.properties").write_text(
            "rootLogger.level=INFO\nrootLogger.appenderRef.file.ref=file\n"
            "appender.file.type=RollingFile\nappender.file.name=file\n"
            f"appender.file.fileName={self.root}/kafka-server.log\n"
            f"appender.file.filePattern={self.root}/kafka-server.log.%i\n"
            "appender.file.layout.type=PatternLayout\n"
            "appender.file.layout.pattern=[%d] %p %m (%c)%n\n"
            "appender.file.policies.type=Policies\n"
            "appender.file.policies.size.type=SizeBasedTriggeringPolicy\n"
            "appender.file.policies.size.size=20MB\n"
            "appender.file.strategy.type=DefaultRolloverStrategy\nappender.file.strategy.max=2\n"
        )
        return props

    def _java(self) -> str:
        java = shutil.which("java")
        if not java:
            raise StackError("Java 17+ is needed for the local Kafka broker: apt-get install openjdk-17-jre-headless")
        return java

    def kafka_up(self, timeout_s: float = 90.0) -> None:
        if self.kafka_alive():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self.fetch_kafka()
        java = self._java()
        props = self._write_config()
        cp = f"{self.libs}/*"
        data = self.root / "kafka-data"
        if not (data / "meta.properties").exists():
            cluster_id = kafka_cluster_id()
            r = subprocess.run(
                [
                    java,
                    "-cp",
                    cp,
                    "kafka.tools.StorageTool",
                    "format",
                    "--standalone",
                    "-t",
                    cluster_id,
                    "-c",
                    str(props),
                ],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                raise StackError(f"kafka storage format failed: {r.stdout[-1500:]}{r.stderr[-1500:]}")
        self._mark()
        out = open(self.root / "kafka.out", "ab")
        proc = subprocess.Popen(
            [
                java,
                f"-Xmx{self.scfg.kafka_heap}",
                f"-Xms{self.scfg.kafka_heap}",
                "-XX:+UseG1GC",
                "-XX:TieredStopAtLevel=1",
                "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.root}/log4j2.properties",
                f"-Dkafka.logs.dir={self.root}",
                "-cp",
                cp,
                "kafka.Kafka",
                str(props),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._pidfile("kafka").write_text(str(proc.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.root / "kafka.out").read_text(errors="replace")[-2000:]
                raise StackError(f"Kafka exited with code {proc.returncode}; see {self.root}/kafka-server.log\n{tail}")
            if self.kafka_alive() and self._partitions_led():
                return
            time.sleep(0.3)
        raise StackError(
            f"Kafka did not answer on {self.kafka_bootstrap} within {timeout_s}s; see {self.root}/kafka-server.log"
        )

    def kafka_alive(self, timeout_s: float = 2.0) -> bool:
        from rose.kafka.admin import AdminClient, KafkaException

        try:
            md = AdminClient(
                {"bootstrap.servers": self.kafka_bootstrap, "socket.timeout.ms": 1000, "log_level": 0}
            ).list_topics(timeout=timeout_s)
            return bool(md.brokers)
        except KafkaException:
            return False

    def _partitions_led(self) -> bool:
        """After a restart the broker answers before it leads its partitions again; clients
        see NOT_LEADER until then. Ready means every partition has a leader."""
        from rose.kafka.admin import AdminClient, KafkaException

        try:
            md = AdminClient({"bootstrap.servers": self.kafka_bootstrap, "log_level": 0}).list_topics(timeout=5)
        except KafkaException:
            return False
        return all(p.leader >= 0 and p.error is None for t in md.topics.values() for p in t.partitions.values())

    def kafka_down(self, timeout_s: float = 30.0) -> bool:
        return self._stop("kafka", timeout_s)

    # ---- Redis -------------------------------------------------------------------------
    def _redis_server(self) -> str:
        exe = shutil.which("redis-server")
        if exe:
            return exe
        if os.geteuid() == 0 and shutil.which("apt-get"):
            _log("installing redis-server from Debian's packages ...")
            subprocess.run(
                ["apt-get", "install", "-y", "-qq", "redis-server"],
                check=False,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
            exe = shutil.which("redis-server")
            if exe:
                return exe
        raise StackError("redis-server not found: install Redis 7 (apt-get install redis-server)")

    def redis_up(self, timeout_s: float = 20.0) -> None:
        if self.redis_alive():
            return
        exe = self._redis_server()
        rdir = self.root / "redis"
        rdir.mkdir(parents=True, exist_ok=True)
        self._mark()
        out = open(self.root / "redis.out", "ab")
        proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.scfg.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(rdir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._pidfile("redis").write_text(str(proc.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"redis-server exited with code {proc.returncode}; see {self.root}/redis.out")
            if self.redis_alive():
                return
            time.sleep(0.1)
        raise StackError(f"Redis did not answer PING on {self.redis_url} within {timeout_s}s")

    def redis_alive(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1).ping())
        except (redis.RedisError, OSError):
            return False

    def redis_down(self, timeout_s: float = 10.0) -> bool:
        return self._stop("redis", timeout_s)

    # ---- Jaeger (optional: `up --jaeger`) ------------------------------------------------
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
        _log(f"building Jaeger {version} from the Go module proxy into {binary} (once; minutes) ...")
        if not (bdir / "go.mod").exists():
            self._go_step([go, "mod", "init", "rosejaeger"], bdir, env, "go mod init", t0)
        self._go_step([go, "get", "-tool", f"{pkg}@{version}"], bdir, env, "downloading modules", t0)
        tmp = binary.with_name("jaeger.partial")
        self._go_step([go, "build", "-v", "-o", str(tmp), pkg], bdir, env, "compiling", t0)
        tmp.rename(binary)
        stamp.write_text(version + "\n")
        _log(f"built {binary} in {time.monotonic() - t0:.0f}s")
        return binary

    def _go_step(self, cmd: list[str], cwd: Path, env: dict, what: str, t0: float) -> None:
        """Run one go command, its output to jaeger-build/build.log, a progress line every 15 s."""
        log = cwd / "build.log"
        with open(log, "a") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
            start = log.stat().st_size
            while True:
                try:
                    rc = proc.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    with open(log, "rb") as r:
                        r.seek(start)
                        lines = r.read().count(b"\n")
                    _log(f"jaeger: {what}, {lines} packages so far, {time.monotonic() - t0:.0f}s elapsed")
        if rc != 0:
            tail = log.read_text(errors="replace")[-2000:]
            raise StackError(f"`go {cmd[1]}` failed ({rc}) building Jaeger; see {log}\n{tail}")

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
            if self.jaeger_alive() and all(_listening(p) for p in self._ports("jaeger")[1:]):
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

    def jaeger_down(self, timeout_s: float = 10.0) -> bool:
        return self._stop("jaeger", timeout_s)

    # ---- all ---------------------------------------------------------------------------
    def up(self, jaeger: bool = False, own: bool = False) -> list[Holder]:
        """Start what is not running yet and wait until it answers (Jaeger too with `jaeger`).
        Another stack's services already answering on these ports are used, with a warning
        naming them, or with `own` refused before anything starts (see `claim`)."""
        names = ["redis", "kafka"] + (["jaeger"] if jaeger else [])
        used = self.claim(names, own=own)
        self.redis_up()
        self.kafka_up()
        if jaeger:
            self.jaeger_up()
        return used

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
            _log(
                f"using {name} of {'another stack' if main.root else 'another program'}: {main.describe()}; "
                f"this stack ({self.root}) does not own it, and `rose stack down` here will not stop it"
            )
            used.append(main)
        return used

    def down(self) -> list[str]:
        return [n for n in ("jaeger", "kafka", "redis") if self._stop(n, 30.0)]

    def status(self, jaeger: bool = False) -> dict[str, bool]:
        st = {"kafka": self.kafka_alive(), "redis": self.redis_alive()}
        if jaeger:
            st["jaeger"] = self.jaeger_alive()
        return st

    def jaeger_started(self) -> bool:
        """`up --jaeger` started Jaeger and `down` has not stopped it (its pid file is there)."""
        return self._pidfile("jaeger").exists()

    # ---- whose stack -------------------------------------------------------------------
    def _ports(self, name: str) -> list[int]:
        """The TCP ports a service of this stack listens on, its client port first."""
        s = self.scfg
        return {
            "kafka": [s.kafka_port, s.controller_port, s.sasl_port, s.tls_port],
            "redis": [s.redis_port],
            "jaeger": [s.jaeger_query_port, s.jaeger_otlp_grpc_port, s.jaeger_otlp_http_port],
        }[name]

    def _mark(self) -> None:
        """stack.json in the state dir: where `rose stack up` ran, so another checkout finding
        this stack on its ports can say whose it is."""
        import json

        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "stack.json").write_text(
            json.dumps({"checkout": os.getcwd(), "state_dir": str(self.root), "rose": str(REPO_ROOT)}) + "\n"
        )

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
            if port not in found and _listening(port):
                found[port] = None
        grouped: dict[tuple[str, int | None], list[int]] = {}
        for port in wanted:  # in the order of _ports: a service's client port first
            if port in found:
                grouped.setdefault((wanted[port], found[port]), []).append(port)
        return [self._holder(name, ports, pid) for (name, pid), ports in grouped.items()]

    def _holder(self, service: str, ports: list[int], pid: int | None) -> Holder:
        import json

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
            candidates += [cwd.parent] if cwd.name == "redis" else [cwd]
        for root in candidates:
            if (root / "stack.json").exists() or any(
                (root / f).exists() for f in ("kafka.pid", "redis.pid", "jaeger.pid", "server.properties")
            ):
                h.root = root.resolve()
                try:
                    h.checkout = json.loads((root / "stack.json").read_text())["checkout"]
                except (OSError, ValueError, KeyError):
                    h.checkout = str(cwd if cwd is not None and cwd.name != "redis" and cwd != root else h.root.parent)
                break
        return h

    def foreign(self, names: list[str] | tuple[str, ...] = ("kafka", "redis")) -> list[Holder]:
        """Listeners on this stack's ports that are not this stack's processes."""
        return [h for h in self.holders(names) if h.root != self.root]

    def _not_owned_message(self, foreign: list[Holder], using: bool = True) -> str:
        whose = "; ".join(h.describe() for h in foreign)
        fixes = sorted({h.checkout for h in foreign if h.checkout})
        env = " ".join(f"ROSE_STACK__{v}=…" for n in dict.fromkeys(h.service for h in foreign) for v in _PORT_ENV[n])
        stop = f"run `rose stack down` in {' and '.join(fixes)}" if fixes else "stop that process"
        return f"{whose} — not this stack ({self.root}); {stop}, or give this stack other ports ({env})"

    def _adopt(self, name: str) -> int | None:
        """The pid of this stack's `name` when its pid file is gone or stale (two `up`s raced
        and the loser's pid was written last; a stop removed it): the process listening on
        the stack's port, if it runs from this stack's directory (Kafka, Jaeger: their config
        file is under the root; Redis: its working directory is root/redis)."""
        import psutil

        port = self._ports(name)[0]
        try:
            conns = psutil.net_connections(kind="tcp")
        except psutil.AccessDenied:
            return None
        for c in conns:
            if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port or not c.pid:
                continue
            try:
                p = psutil.Process(c.pid)
                ours = (
                    Path(p.cwd()) == self.root / "redis"
                    if name == "redis"
                    else any(str(self.root) in a for a in p.cmdline())
                )
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if ours:
                return c.pid
        return None

    def _stop(self, name: str, timeout_s: float) -> bool:
        """Stop a process this stack started; False if there was none."""
        pf = self._pidfile(name)
        pid: int | None
        try:
            pid = int(pf.read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            pid = self._adopt(name)
            if pid is None:
                pf.unlink(missing_ok=True)
                return False
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pf.unlink(missing_ok=True)
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            _reap(pid)
            if _exited(pid):  # an adopted process: its parent reaps it, or nobody does
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        _reap(pid)  # our child that exited between the checks above: no zombie left behind
        pf.unlink(missing_ok=True)
        return True


def _exited(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
