"""A real Kafka-protocol broker for tests: librdkafka's mock cluster in a child process.

No Apache Kafka can be installed where the tests run, but the librdkafka shared library
bundled in the ``confluent-kafka`` wheel contains a mock cluster: real TCP listeners on
127.0.0.1 (ports from the OS) speaking enough of the Kafka protocol for aiokafka's
producer (idempotent included), manually assigned consumers, offset commits and groups.
:class:`MockKafkaCluster` runs it in a child process (``python -m
stream_persia.testing.kafka_mock``) so that it has its own GIL, can be killed, and can
never leave state behind in the test process.

Locating the library (:func:`find_librdkafka`): ``$STREAM_PERSIA_LIBRDKAFKA`` if set, else
the file the ``confluent-kafka`` distribution's RECORD lists (``confluent_kafka.libs/`` on
Linux, ``.dylibs/`` on macOS), else a glob next to the ``confluent_kafka`` package. The
package itself is never imported. The mock C API is experimental, hence the exact
``confluent-kafka`` pin in ``pyproject.toml``.

Control protocol (child stdin/stdout, one line each way, ASCII): the child first prints
``bootstrap <host:port,...>``; then answers every command with ``ok ...`` or ``err ...``::

    create_topic NAME PARTITIONS   ok | ok exists | err <reason>
    set_rtt BROKER_ID MS           delay every response (-1 = all brokers)
    broker_down BROKER_ID          drop connections and refuse new ones
    broker_up BROKER_ID
    advertise BROKER_ID HOST PORT  name HOST:PORT as the broker's address in metadata
    set_leader TOPIC PARTITION BROKER_ID   move the partition's leader (metadata says so;
                                   the old leader answers its fetches NOT_LEADER)
    ping                           ok
    quit                           ok, then the child exits

The child exits on ``quit``, on EOF of stdin (the parent is gone) and, where the parent
is a main thread on Linux, when the parent dies (``PR_SET_PDEATHSIG``).

Quirks of the mock (librdkafka 2.16.0 from confluent-kafka 2.16.1, aiokafka 0.14),
measured here:

- Starting takes ~50-70 ms (a Python child plus dlopen); stopping ~15 ms.
- Topics must be created through :meth:`MockKafkaCluster.create_topic`. The admin
  CreateTopics request does not work (aiokafka's admin client fails with
  ``AttributeError`` because the mock's metadata names no controller), and a topic that
  is produced to or asked for by name without existing is auto-created with 4
  partitions. Listing all topics (what ``stream_persia.kafka.topic_partitions`` does)
  creates nothing.
- Each partition keeps only ~5 MiB (51 of 80 messages of 100 KB) and silently drops
  older data: the log start offset moves, and a consumer positioned below it gets
  OFFSET_OUT_OF_RANGE (a data loss, :mod:`stream_persia.kafka.loss`). Everything is in
  memory; keep test data small.
- Transactional producers work, but the commit markers' record batches fail aiokafka's
  CRC check: read such a topic with ``check_crcs=False``.
- ``fetch_max_wait_ms=50`` on consumers cuts produce-to-consume latency from ~365 ms to
  ~17 ms.
- Offset commits with a ``group_id`` work for manually assigned consumers (no group
  join), and a new consumer of the same group reads them back.
- ``set_rtt`` delays every response, metadata included. With a broker ``down``, aiokafka's
  producer retries without end (no delivery timeout): ``flush`` blocks, and the records
  are delivered, once, when the broker is up again.
- Group joins wait ``group.initial.rebalance.delay.ms`` unless it is 0 (set here); two or
  more aiokafka members in one group fail in SyncGroup. stream-persia's static partition
  assignment never joins a group, so neither matters for the project.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import glob
import importlib.metadata
import importlib.util
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from stream_persia.errors import ConfigError, InternalError, Misuse, PeerUnavailable, RemoteTimeout
from stream_persia.testing.broker_process import BrokerProcess

__all__ = ["MockKafkaCluster", "find_librdkafka"]

_LIB_ENV = "STREAM_PERSIA_LIBRDKAFKA"
_LIB_SUFFIXES = (".so", ".dylib", ".dll")
_TOPIC_ALREADY_EXISTS = 36  # RD_KAFKA_RESP_ERR_TOPIC_ALREADY_EXISTS


def _is_library(name: str) -> bool:
    base = os.path.basename(name)
    return base.startswith("librdkafka") and any(s in base for s in _LIB_SUFFIXES)


def find_librdkafka() -> Path:
    """Return the path of the librdkafka shared library bundled in ``confluent-kafka``.

    Raises:
        ConfigError: no library was found (``confluent-kafka`` is not installed).
    """
    override = os.environ.get(_LIB_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ConfigError(f"{_LIB_ENV}={override!r} is not a file", field=_LIB_ENV,
                              hint="point it at a librdkafka >= 2.16 shared library")
        return path
    try:
        dist = importlib.metadata.distribution("confluent-kafka")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or ():
            if _is_library(str(entry)):
                path = Path(str(dist.locate_file(entry))).resolve()
                if path.is_file():
                    return path
    spec = importlib.util.find_spec("confluent_kafka")
    for location in (spec.submodule_search_locations or []) if spec else []:
        pkg = Path(location)
        patterns = [pkg.parent / "confluent_kafka.libs" / "librdkafka*",
                    pkg / ".dylibs" / "librdkafka*", pkg / "librdkafka*"]
        for pattern in patterns:
            for candidate in sorted(glob.glob(str(pattern))):
                if _is_library(candidate):
                    return Path(candidate)
    raise ConfigError("librdkafka (bundled in the confluent-kafka wheel) was not found",
                      field="confluent-kafka",
                      hint="pip install -e '.[test]' installs the pinned confluent-kafka, "
                           f"or set {_LIB_ENV} to a librdkafka shared library")


# --------------------------------------------------------------------------- child side

def _bind(lib: ctypes.CDLL) -> None:
    vp, cp, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    signatures = {
        "rd_kafka_version_str": ([], cp),
        "rd_kafka_err2str": ([i], cp),
        "rd_kafka_conf_new": ([], vp),
        "rd_kafka_conf_set": ([vp, cp, cp, cp, ctypes.c_size_t], i),
        "rd_kafka_new": ([i, vp, cp, ctypes.c_size_t], vp),
        "rd_kafka_destroy": ([vp], None),
        "rd_kafka_mock_cluster_new": ([vp, i], vp),
        "rd_kafka_mock_cluster_destroy": ([vp], None),
        "rd_kafka_mock_cluster_bootstraps": ([vp], cp),
        "rd_kafka_mock_topic_create": ([vp, cp, i, i], i),
        "rd_kafka_mock_topic_delete": ([vp, cp], i),
        "rd_kafka_mock_group_initial_rebalance_delay_ms": ([vp, ctypes.c_int32], None),
        "rd_kafka_mock_broker_set_rtt": ([vp, ctypes.c_int32, i], i),
        "rd_kafka_mock_broker_set_down": ([vp, ctypes.c_int32], i),
        "rd_kafka_mock_broker_set_up": ([vp, ctypes.c_int32], i),
        "rd_kafka_mock_broker_set_host_port": ([vp, ctypes.c_int32, cp, ctypes.c_uint16], i),
        "rd_kafka_mock_partition_set_leader": ([vp, cp, ctypes.c_int32, ctypes.c_int32], i),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)  # AttributeError names a missing symbol: too old a library
        fn.argtypes, fn.restype = argtypes, restype


class _Cluster:
    """The mock cluster, owned by the child process."""

    WHAT = 'the mock Kafka cluster'

    def __init__(self, library: Path, brokers: int):
        self.lib = lib = ctypes.CDLL(str(library))
        _bind(lib)
        conf = lib.rd_kafka_conf_new()
        errstr = ctypes.create_string_buffer(512)
        # The handle is only the mock's bookkeeping owner; its own client log would just
        # warn that it has no bootstrap servers.
        lib.rd_kafka_conf_set(conf, b"log_level", b"3", errstr, len(errstr))
        self.rk = lib.rd_kafka_new(0, conf, errstr, len(errstr))  # 0 = RD_KAFKA_PRODUCER
        if not self.rk:
            raise RuntimeError(f"rd_kafka_new failed: {errstr.value.decode()}")
        self.mc = lib.rd_kafka_mock_cluster_new(self.rk, brokers)
        if not self.mc:
            raise RuntimeError("rd_kafka_mock_cluster_new failed (see librdkafka log above)")
        lib.rd_kafka_mock_group_initial_rebalance_delay_ms(self.mc, 0)
        self.bootstrap_servers = lib.rd_kafka_mock_cluster_bootstraps(self.mc).decode()

    def _result(self, err: int) -> str:
        if err == 0:
            return "ok"
        return f"err {err} {self.lib.rd_kafka_err2str(err).decode()}"

    def handle(self, line: str) -> str:
        parts = line.split()
        if not parts:
            return "err empty command"
        cmd, args = parts[0], parts[1:]
        try:
            if cmd == "ping":
                return "ok"
            if cmd == "create_topic" and len(args) == 2:
                err = self.lib.rd_kafka_mock_topic_create(self.mc, args[0].encode(),
                                                          int(args[1]), 1)
                return "ok exists" if err == _TOPIC_ALREADY_EXISTS else self._result(err)
            if cmd == "delete_topic" and len(args) == 1:
                return self._result(self.lib.rd_kafka_mock_topic_delete(self.mc, args[0].encode()))
            if cmd == "set_rtt" and len(args) == 2:
                return self._result(self.lib.rd_kafka_mock_broker_set_rtt(
                    self.mc, int(args[0]), int(args[1])))
            if cmd == "broker_down" and len(args) == 1:
                return self._result(self.lib.rd_kafka_mock_broker_set_down(self.mc, int(args[0])))
            if cmd == "broker_up" and len(args) == 1:
                return self._result(self.lib.rd_kafka_mock_broker_set_up(self.mc, int(args[0])))
            if cmd == "advertise" and len(args) == 3:
                return self._result(self.lib.rd_kafka_mock_broker_set_host_port(
                    self.mc, int(args[0]), args[1].encode(), int(args[2])))
            if cmd == "set_leader" and len(args) == 3:
                return self._result(self.lib.rd_kafka_mock_partition_set_leader(
                    self.mc, args[0].encode(), int(args[1]), int(args[2])))
        except ValueError as e:
            return f"err {e}"
        return f"err unknown command {line.strip()!r}"

    def destroy(self) -> None:
        self.lib.rd_kafka_mock_cluster_destroy(self.mc)
        self.lib.rd_kafka_destroy(self.rk)


def _die_with_parent(parent_pid: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stream_persia.testing.kafka_mock",
        description="Run librdkafka's mock Kafka cluster on 127.0.0.1 (a test broker).")
    parser.add_argument("--brokers", type=int, default=1, help="number of mock brokers")
    parser.add_argument("--topic", action="append", default=[], metavar="NAME:PARTITIONS",
                        help="create a topic at start (repeatable)")
    parser.add_argument("--forever", action="store_true",
                        help="ignore stdin; run until SIGTERM/SIGINT (for a shell)")
    parser.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    cluster = _Cluster(find_librdkafka(), args.brokers)
    for spec in args.topic:
        name, _, count = spec.rpartition(":")
        reply = cluster.handle(f"create_topic {name} {count}")
        if reply.startswith("err"):
            print(f"--topic {spec}: {reply}", file=sys.stderr)
            return 2
    print(f"bootstrap {cluster.bootstrap_servers}", flush=True)
    if args.forever:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            while True:
                signal.pause()
        except (KeyboardInterrupt, SystemExit):
            pass
    else:
        for line in sys.stdin:
            if line.strip() == "quit":
                print("ok", flush=True)
                break
            print(cluster.handle(line), flush=True)
    cluster.destroy()
    return 0


# -------------------------------------------------------------------------- parent side

class MockKafkaCluster(BrokerProcess):
    """librdkafka's mock Kafka cluster, run as a child process on loopback.

    Example::

        with MockKafkaCluster() as kafka:
            kafka.create_topic("job.samples", 4)
            producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers)

    Args:
        brokers: number of mock brokers (partition leaders are spread over them).
        command_timeout_s: how long one control command may take before
            :class:`RemoteTimeout`.
    """

    def __init__(self, brokers: int = 1, *, command_timeout_s: float = 10.0):
        if brokers < 1:
            raise ConfigError(f"brokers must be >= 1, got {brokers}", field="brokers")
        self.brokers = brokers
        self.command_timeout_s = command_timeout_s
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._buf = b""
        self._bootstrap: str | None = None
        self._lock = threading.Lock()

    # lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> MockKafkaCluster:
        """Start the child and wait until it listens; returns self."""
        if self._proc is not None:
            raise Misuse("MockKafkaCluster.start() called twice", hint="call stop() first")
        started = time.perf_counter()
        self._stderr = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "stream_persia.testing.kafka_mock",
               "--brokers", str(self.brokers)]
        if threading.current_thread() is threading.main_thread():
            # PR_SET_PDEATHSIG fires when the creating *thread* exits, so only a main
            # thread may ask for it; EOF on stdin covers every other case.
            cmd += ["--parent-pid", str(os.getpid())]
        # The child must import this package even when it is not installed (a checkout
        # on sys.path only), whatever its working directory.
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Unbuffered: nothing can linger in a buffer to fail later against a dead child.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, bufsize=0, env=env)
        atexit.register(self.stop)
        try:
            line = self._readline(timeout)
            if not line.startswith("bootstrap "):
                raise InternalError(f"mock Kafka cluster said {line!r} instead of its address")
            self._bootstrap = line.split(None, 1)[1]
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - started
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the child to quit, then terminate and finally kill it; always reaps it."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(b"quit\n")
                except (BrokenPipeError, OSError):
                    pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            for stream in (proc.stdin, proc.stdout, self._stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:  # a dead child's pipe
                        pass
            self._stderr = None
            self._buf = b""


    # control -----------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int) -> bool:
        """Create a topic; returns False if it already existed (its size is not checked)."""
        if not name or any(c.isspace() for c in name):
            raise ConfigError(f"topic name {name!r} is empty or contains whitespace",
                              field="topic")
        if partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {partitions}",
                              field="partitions")
        return self._command(f"create_topic {name} {partitions}") != "ok exists"

    def delete_topic(self, name: str) -> None:
        """Delete a topic and its data (a topic created again under the name starts
        empty, with the partitions it is created with: the way a test grows a topic,
        since the mock answers no CreatePartitions)."""
        self._command(f"delete_topic {name}")

    def set_rtt(self, rtt_ms: int, broker_id: int = -1) -> None:
        """Delay every broker response by ``rtt_ms`` (``broker_id=-1``: all brokers)."""
        self._command(f"set_rtt {broker_id} {rtt_ms}")

    def broker_down(self, broker_id: int = -1) -> None:
        """Drop the broker's connections and refuse new ones (no leader change)."""
        self._command(f"broker_down {broker_id}")

    def broker_up(self, broker_id: int = -1) -> None:
        self._command(f"broker_up {broker_id}")

    def advertise(self, address: str, broker_id: int = 1) -> None:
        """Name ``address`` (``host:port``, say a proxy's) as the broker's in metadata, so
        that clients reach it only there: a broker replaced behind that address (killed,
        then a new cluster) is, to its clients, one restarted at the same address. The
        broker still listens on its own port only."""
        host, _, port = address.rpartition(":")
        self._command(f"advertise {broker_id} {host} {int(port)}")

    def set_leader(self, topic: str, partition: int, broker_id: int) -> None:
        """Make ``broker_id`` the leader of ``topic``/``partition`` (a cluster of 2 or
        more brokers; the data stays, as after a leader election)."""
        self._command(f"set_leader {topic} {int(partition)} {int(broker_id)}")

    def ping(self) -> None:
        self._command("ping")

    def _command(self, line: str) -> str:
        with self._lock:
            proc = self._proc
            if proc is None or proc.stdin is None:
                raise Misuse("the mock Kafka cluster is not running", hint="call start() first")
            try:
                proc.stdin.write(line.encode() + b"\n")
            except (BrokenPipeError, OSError) as e:
                raise PeerUnavailable(f"mock Kafka cluster is gone: {e}{self._log_tail()}") from e
            reply = self._readline(self.command_timeout_s)
        if reply.startswith("err"):
            raise ConfigError(f"mock Kafka cluster refused {line!r}: {reply}", field="command")
        return reply

    def _readline(self, timeout: float) -> str:
        """Read one line from the child's stdout within ``timeout`` seconds."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteTimeout(f"mock Kafka cluster did not answer in {timeout} s"
                                    f"{self._log_tail()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = proc.poll()
                    raise PeerUnavailable(f"mock Kafka cluster exited (status {code})"
                                          f"{self._log_tail()}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode().strip()

    def _log_tail(self, limit: int = 2000) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - limit))
            tail = self._stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"; its log ends with:\n{tail}" if tail else ""


if __name__ == "__main__":
    sys.exit(_serve())
