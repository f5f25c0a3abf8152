"""The stack's Apache Kafka: one broker in KRaft mode (combined broker+controller) on loopback.

Its jars come from Maven Central (deploy/kafka/pom.xml, `mvn dependency:copy-dependencies`),
it runs as `java -cp libs/* kafka.Kafka server.properties` with a bounded heap, and it is
ready when it answers with cluster metadata in which every partition has a leader, never after
a sleep. Besides PLAINTEXT it has a SCRAM listener and, where openssl is there, a TLS one.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from rose.stack.errors import StackError
from rose.stack.layout import REPO_ROOT
from rose.stack.processes import StackProcesses, log
from rose.stack.tls import ensure_local_tls

POM = REPO_ROOT / "deploy" / "kafka" / "pom.xml"

# server.properties every node of the stack has (the single broker and the cluster's nodes)
NODE_DEFAULTS = {
    "num.partitions": "1",
    "offsets.topic.num.partitions": "8",
    "transaction.state.log.num.partitions": "8",
    "group.initial.rebalance.delay.ms": "0",
    "auto.create.topics.enable": "false",
    # hostile-input tests produce 10 MB values; they must reach the broker to reach the dlq
    "message.max.bytes": str(16 << 20),
    "replica.fetch.max.bytes": str(16 << 20),
    "log.segment.bytes": str(64 << 20),
    "log.cleaner.dedupe.buffer.size": str(16 << 20),
    "log.retention.hours": "24",
}


def kafka_cluster_id() -> str:
    """A random KRaft cluster id as Kafka makes one (`Uuid.randomUuid`): url-safe base64 of 16
    bytes, never starting with `-`, which the storage tool's argument parser would read as a flag
    (one id in 64 would make `rose stack up` fail on a fresh machine)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


class KafkaBroker(StackProcesses):
    """Fetches, configures, starts, checks and stops the stack's Kafka broker."""

    @property
    def libs(self) -> Path:
        return self.root / f"kafka-{self.scfg.kafka_version}-libs"

    def fetch_kafka(self) -> None:
        """Download the broker's jars once (Maven Central) into the data dir."""
        if self.libs.is_dir() and any(self.libs.glob("kafka_2.13-*.jar")):
            return
        if not shutil.which("mvn"):
            raise StackError("Maven (mvn) is needed to fetch Apache Kafka's jars: apt-get install maven")
        log(f"fetching Apache Kafka {self.scfg.kafka_version} jars from Maven Central ...")
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
        """The TLS listener's certificate under tls_dir (see `ensure_local_tls`); False (no TLS
        listener) without openssl."""
        return ensure_local_tls(self.tls_dir)

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
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            **NODE_DEFAULTS,
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
        write_properties(props, self.server_properties())
        write_log4j(self.root)
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
        props = self._write_config()
        fresh = not (self.root / "kafka-data" / "meta.properties").exists()
        if fresh:
            self._format_storage(props, kafka_cluster_id(), "--standalone")
        self._mark()
        proc = self._start_kafka(props, self.root, self.scfg.kafka_heap)
        self._pidfile("kafka").write_text(str(proc.pid))
        t0 = time.monotonic()
        self._wait_kafka(proc, self.kafka_bootstrap, self.root, timeout_s)
        if fresh:
            warm_coordinators(self.kafka_bootstrap, max(10.0, timeout_s - (time.monotonic() - t0)))

    def _format_storage(self, props: Path, cluster_id: str, *flags: str) -> None:
        """`kafka-storage format` of the log dirs `props` names, as cluster `cluster_id`."""
        cmd = [self._java(), "-cp", f"{self.libs}/*", "kafka.tools.StorageTool", "format", *flags]
        r = subprocess.run([*cmd, "-t", cluster_id, "-c", str(props)], capture_output=True, text=True)
        if r.returncode != 0:
            raise StackError(f"kafka storage format failed: {r.stdout[-1500:]}{r.stderr[-1500:]}")

    def _start_kafka(self, props: Path, logs: Path, heap: str) -> subprocess.Popen:
        """A Kafka node on `props` (its log4j2.properties, kafka.out and server log in `logs`),
        in a session of its own, with a bounded heap."""
        with open(logs / "kafka.out", "ab") as out:
            return subprocess.Popen(
                [
                    self._java(),
                    f"-Xmx{heap}",
                    f"-Xms{heap}",
                    # the pause goals of Kafka's own bin/kafka-run-class.sh (KAFKA_JVM_PERFORMANCE_OPTS):
                    # with G1's default 200 ms goal, young collections on a 2-core machine paused the
                    # broker 77 ms on average, and each pause lands in every decision it delays
                    "-XX:+UseG1GC",
                    "-XX:MaxGCPauseMillis=20",
                    "-XX:InitiatingHeapOccupancyPercent=35",
                    "-XX:+ExplicitGCInvokesConcurrent",
                    "-XX:TieredStopAtLevel=1",
                    "-Djava.awt.headless=true",
                    f"-Dlog4j2.configurationFile={logs}/log4j2.properties",
                    f"-Dkafka.logs.dir={logs}",
                    "-cp",
                    f"{self.libs}/*",
                    "kafka.Kafka",
                    str(props),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_kafka(
        self, proc: subprocess.Popen, bootstrap: str, logs: Path, timeout_s: float, brokers: int = 1
    ) -> None:
        """Until `bootstrap` answers with `brokers` brokers and every partition led; StackError
        when `proc` exits first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (logs / "kafka.out").read_text(errors="replace")[-2000:]
                raise StackError(f"Kafka exited with code {proc.returncode}; see {logs}/kafka-server.log\n{tail}")
            if kafka_ready(bootstrap, brokers):
                return
            time.sleep(0.3)
        raise StackError(f"Kafka did not answer on {bootstrap} within {timeout_s}s; see {logs}/kafka-server.log")

    def kafka_alive(self, timeout_s: float = 2.0) -> bool:
        return len(kafka_brokers(self.kafka_bootstrap, timeout_s)) > 0

    def kafka_down(self, timeout_s: float = 30.0) -> bool:
        return self._stop("kafka", timeout_s)


def kafka_brokers(bootstrap: str, timeout_s: float = 2.0) -> set[int]:
    """The node ids of the brokers in the metadata `bootstrap` answers with (empty when nothing answers)."""
    from rose.kafka.admin import AdminClient, KafkaException

    try:
        md = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 1000, "log_level": 0}).list_topics(
            timeout=timeout_s
        )
    except KafkaException:
        return set()
    return set(md.brokers)


def kafka_ready(bootstrap: str, brokers: int = 1, timeout_s: float = 5.0) -> bool:
    """At least `brokers` brokers in the metadata, and every partition led. After a restart a
    broker answers before it leads its partitions again (clients see NOT_LEADER until then)."""
    from rose.kafka.admin import AdminClient, KafkaException

    try:
        md = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=timeout_s)
    except KafkaException:
        return False
    led = all(p.leader >= 0 and p.error is None for t in md.topics.values() for p in t.partitions.values())
    return len(md.brokers) >= brokers and led


def warm_coordinators(bootstrap: str, timeout_s: float) -> None:
    """A new broker creates its internal topics (`__transaction_state`, `__consumer_offsets`)
    when a client first asks for a transaction or group coordinator; on a 2-core machine that
    took longer than a first scheduler's wait for its first commit. One empty transaction and one
    committed-offsets read make both before `up` returns. StackError when they do not answer."""
    from rose.kafka.consumer import Consumer, KafkaError, KafkaException, TopicPartition
    from rose.kafka.producer import Producer

    loading = {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
    deadline = time.monotonic() + timeout_s
    try:
        p = Producer({"bootstrap.servers": bootstrap, "transactional.id": "rose-stack-warm-up", "log_level": 0})
        p.init_transactions(timeout_s)
        p.begin_transaction()
        p.commit_transaction(timeout_s)
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "rose-stack-warm-up", "log_level": 0})
        try:
            while True:  # NOT_COORDINATOR while __consumer_offsets is created and loaded
                try:
                    c.committed(
                        [TopicPartition("rose-stack-warm-up", 0)], timeout=max(1.0, deadline - time.monotonic())
                    )
                    break
                except KafkaException as e:
                    err = e.args[0]
                    if time.monotonic() >= deadline or not (err.retriable() or err.code() in loading):
                        raise
                    time.sleep(0.3)
        finally:
            c.close()
    except KafkaException as e:
        raise StackError(f"Kafka on {bootstrap} answers but its coordinators do not: {e}") from e


def write_properties(path: Path, props: dict[str, str]) -> None:
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))


def write_log4j(logs: Path) -> None:
    """log4j2.properties in `logs`: the server log, logs/kafka-server.log, rolled at 20 MB."""
    (logs / "log4j2.properties").write_text(
        "rootLogger.level=INFO\nrootLogger.appenderRef.file.ref=file\n"
        "appender.file.type=RollingFile\nappender.file.name=file\n"
        f"appender.file.fileName={logs}/kafka-server.log\n"
        f"appender.file.filePattern={logs}/kafka-server.log.%i\n"
        "appender.file.layout.type=PatternLayout\n"
        "appender.file.layout.pattern=[%d] %p %m (%c)%n\n"
        "appender.file.policies.type=Policies\n"
        "appender.file.policies.size.type=SizeBasedTriggeringPolicy\n"
        "appender.file.policies.size.size=20MB\n"
        "appender.file.strategy.type=DefaultRolloverStrategy\nappender.file.strategy.max=2\n"
    )
