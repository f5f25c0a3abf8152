"""The local development stack: one Apache Kafka (KRaft, combined broker+controller) and one
Redis, on loopback, owned by this module from download to shutdown.

Kafka's jars come from Maven Central (deploy/kafka/pom.xml, `mvn dependency:copy-dependencies`),
the broker runs as `java -cp libs/* kafka.Kafka server.properties` with a bounded heap, and
readiness is decided by asking the broker for cluster metadata (and Redis for PING), never
by sleeping. `down` stops only the processes `up` started (tracked by pid files).
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


def _log(msg: str) -> None:
    print(f"[stack] {msg}", file=sys.stderr, flush=True)


@dataclass
class LocalStack:
    scfg: StackConfig
    kafka_bootstrap: str
    redis_url: str

    @classmethod
    def from_config(cls, cfg: Config) -> "LocalStack":
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
            ["mvn", "-q", "-B", "-f", str(POM), f"-Dkafka.version={self.scfg.kafka_version}",
             "dependency:copy-dependencies", f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"],
            capture_output=True, text=True,
        )
        if r.returncode != 0:
            raise StackError(f"mvn could not fetch Kafka {self.scfg.kafka_version}: {r.stdout[-2000:]}{r.stderr[-2000:]}")
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
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=rose-local-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem")],
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
             "-keyout", str(d / "server.key"), "-out", str(d / "server.csr")],
            ["openssl", "x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.pem"), "-CAkey",
             str(d / "ca.key"), "-CAcreateserial", "-days", "3650", "-extfile", str(ext), "-out", str(d / "server.crt")],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise StackError(f"openssl failed making the local TLS certificate: {r.stderr[-500:]}")
        # Kafka's PEM keystore: the PKCS#8 private key followed by the certificate chain
        (d / "server.pem").write_text((d / "server.key").read_text() + (d / "server.crt").read_text()
                                      + (d / "ca.pem").read_text())
        return True

    def server_properties(self) -> dict[str, str]:
        s = self.scfg
        tls = self.ensure_tls()
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{s.controller_port}",
            "listeners": (f"PLAINTEXT://127.0.0.1:{s.kafka_port},CONTROLLER://127.0.0.1:{s.controller_port},"
                          f"SASL_PLAINTEXT://127.0.0.1:{s.sasl_port}"),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{s.kafka_port},SASL_PLAINTEXT://127.0.0.1:{s.sasl_port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
            # a SCRAM listener, so secured client configs (sasl.*) are tested against a real broker;
            # users are created with AdminClient.alter_user_scram_credentials
            "sasl.enabled.mechanisms": "SCRAM-SHA-256,SCRAM-SHA-512",
            "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
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
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            r = subprocess.run(
                [java, "-cp", cp, "kafka.tools.StorageTool", "format", "--standalone",
                 "-t", cluster_id, "-c", str(props)],
                capture_output=True, text=True,
            )
            if r.returncode != 0:
                raise StackError(f"kafka storage format failed: {r.stdout[-1500:]}{r.stderr[-1500:]}")
        out = open(self.root / "kafka.out", "ab")
        proc = subprocess.Popen(
            [java, f"-Xmx{self.scfg.kafka_heap}", f"-Xms{self.scfg.kafka_heap}", "-XX:+UseG1GC",
             "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true",
             f"-Dlog4j2.configurationFile={self.root}/log4j2.properties",
             f"-Dkafka.logs.dir={self.root}", "-cp", cp, "kafka.Kafka", str(props)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
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
        raise StackError(f"Kafka did not answer on {self.kafka_bootstrap} within {timeout_s}s; see {self.root}/kafka-server.log")

    def kafka_alive(self, timeout_s: float = 2.0) -> bool:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        try:
            md = AdminClient({"bootstrap.servers": self.kafka_bootstrap, "socket.timeout.ms": 1000,
                              "log_level": 0}).list_topics(timeout=timeout_s)
            return bool(md.brokers)
        except KafkaException:
            return False

    def _partitions_led(self) -> bool:
        """After a restart the broker answers before it leads its partitions again; clients
        see NOT_LEADER until then. Ready means every partition has a leader."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

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
            subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=False,
                           stdout=subprocess.DEVNULL, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
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
        out = open(self.root / "redis.out", "ab")
        proc = subprocess.Popen(
            [exe, "--port", str(self.scfg.redis_port), "--bind", "127.0.0.1", "--dir", str(rdir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
             "--protected-mode", "yes"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
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

    # ---- both --------------------------------------------------------------------------
    def up(self) -> None:
        self.redis_up()
        self.kafka_up()

    def down(self) -> list[str]:
        return [n for n in ("kafka", "redis") if self._stop(n, 30.0)]

    def status(self) -> dict[str, bool]:
        return {"kafka": self.kafka_alive(), "redis": self.redis_alive()}

    def _adopt(self, name: str) -> int | None:
        """The pid of this stack's `name` when its pid file is gone or stale (two `up`s raced
        and the loser's pid was written last; a stop removed it): the process listening on
        the stack's port, if it runs from this stack's directory (Kafka: its server.properties
        is under the root; Redis: its working directory is root/redis)."""
        import psutil

        port = self.scfg.kafka_port if name == "kafka" else self.scfg.redis_port
        try:
            conns = psutil.net_connections(kind="tcp")
        except psutil.AccessDenied:
            return None
        for c in conns:
            if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port or not c.pid:
                continue
            try:
                p = psutil.Process(c.pid)
                ours = (any(str(self.root) in a for a in p.cmdline()) if name == "kafka"
                        else Path(p.cwd()) == self.root / "redis")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if ours:
                return c.pid
        return None

    def _stop(self, name: str, timeout_s: float) -> bool:
        """Stop a process this stack started; False if there was none."""
        pf = self._pidfile(name)
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
            _reap(pid)
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
