"""``stream-persia produce``: chunked readers, the mapping contract, progress, and the CLI
end to end (a subprocess) into the Kafka test broker and into an embedding worker."""

from __future__ import annotations

import argparse
import asyncio
import gzip
import io
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from stream_persia.core.aio import LoopThread
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.data import PersiaBatch
from stream_persia.embedding.optim import SGD
from stream_persia.errors import BadInput, ConfigError
from stream_persia.loader.produce import (
    Progress,
    Summary,
    add_arguments,
    detect_format,
    load_mapping,
    produce,
    read_chunks,
    split_ids,
)
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import SCHEMA
from stream_persia.worker.service import EmbeddingWorker

pytestmark = pytest.mark.timeout(90)

MAPPING = textwrap.dedent('''
    import numpy as np
    from stream_persia.embedding.data import (IDTypeFeature, IDTypeFeatureWithSingleID,
                                              Label, NonIDTypeFeature, PersiaBatch)
    from stream_persia.loader.produce import split_ids


    def make_batch(columns, batch_index):
        return PersiaBatch(
            [IDTypeFeatureWithSingleID("user", columns["user"].astype(np.uint64)),
             IDTypeFeature.from_csr("tags", *split_ids(columns["tags"]))],
            non_id_type_features=[
                NonIDTypeFeature(np.asarray(columns["price"], np.float32)[:, None], "price")],
            labels=[Label(np.asarray(columns["click"], np.float32)[:, None], "click")],
            batch_id=batch_index)


    def from_npz(columns, batch_index):
        return PersiaBatch([IDTypeFeature.from_csr("user", columns["user"],
                                                   np.arange(len(columns["user"]) + 1))],
                           labels=[Label(columns["label"], "label")], batch_id=batch_index)


    def not_a_batch(columns, batch_index):
        return {"user": columns["user"]}


    def crashes(columns, batch_index):
        if batch_index == 1:
            raise KeyError("no_such_column")
        return make_batch(columns, batch_index)
''')


def write_csv(path, rows: int, *, sep: str = ",", header: bool = True) -> list[tuple]:
    data = [(i * 7 % 13, "|".join(str(i + k) for k in range(i % 3)), i / 4, i % 2)
            for i in range(rows)]
    lines = [sep.join(["user", "tags", "price", "click"])] if header else []
    lines += [sep.join(str(v) for v in row) for row in data]
    path.write_text("\n".join(lines) + "\n")
    return data


def chunks(path, fmt=None, batch_size=4, **kw) -> list[dict]:
    return list(read_chunks(str(path), detect_format(str(path), fmt), batch_size, **kw))


# ----------------------------------------------------------------------- readers

def test_format_comes_from_the_extension_or_the_flag():
    assert [detect_format(p) for p in ("a.csv", "b.TSV", "c.tab", "d.csv.gz", "e.npz")] == \
        ["csv", "tsv", "tsv", "csv", "npz"]
    assert detect_format("data.txt", "tsv") == "tsv"
    for path, fmt in (("data.parquet", None), ("a.csv", "xls")):
        with pytest.raises(ConfigError) as err:
            detect_format(path, fmt)
        assert err.value.field == "--format"


def test_csv_chunks_by_rows_and_infers_column_types(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('id,big,x,name,maybe\n'
                    '1,18446744073709551615,0.5,"a, quoted",3\n'
                    '\n'
                    '-2,7,1e3,b,\n'
                    '3,8,2,c,5\n'
                    '4,9,3,d,6\n'
                    '5,10,4,e,7\n')
    got = chunks(path, batch_size=2)
    assert [len(c["id"]) for c in got] == [2, 2, 1]  # the blank line is skipped
    first = got[0]
    assert first["id"].dtype == np.int64 and first["id"].tolist() == [1, -2]
    assert first["big"].dtype == np.uint64 and first["big"][0] == 2**64 - 1
    assert first["x"].dtype == np.float64 and first["x"].tolist() == [0.5, 1000.0]
    assert first["name"].tolist() == ["a, quoted", "b"]
    assert first["maybe"].dtype == np.float64 and np.isnan(first["maybe"][1])
    assert got[1]["x"].dtype == np.int64  # inferred per chunk: cast in the mapping
    first["id"][0] = 99  # new, writable arrays


def test_csv_integers_float64_would_round_stay_text(tmp_path):
    """A hashed-id column (ids past 2**53) with an empty field, or with a negative value
    beside ids past int64, used to be inferred float64, rounding every id: a mapping's
    ``astype(np.uint64)`` then sent other ids, silently. Such columns stay text."""
    path = tmp_path / "d.csv"
    path.write_text("gap,mixed,small,huge\n"
                    "12345678901234567891,-1,1,1e300\n"
                    ",18446744073709551615,,2.5\n"
                    "9007199254740993,3,9007199254740992,-9007199254740993.5\n")
    (got,) = chunks(path, batch_size=3)
    assert got["gap"].tolist() == ["12345678901234567891", "", "9007199254740993"]
    assert got["mixed"].tolist() == ["-1", "18446744073709551615", "3"]
    # float64 holds these exactly, or they were written as floats: still numbers
    assert got["small"].dtype == np.float64 and got["small"][2] == 2**53
    assert got["huge"].dtype == np.float64


def test_csv_without_header_tsv_and_gzip(tmp_path):
    path = tmp_path / "d.tsv.gz"
    with gzip.open(path, "wt") as f:
        f.write("1\ta b\n2\tc\n")
    (got,) = chunks(path, header=False)
    assert got["col0"].tolist() == [1, 2] and got["col1"].tolist() == ["a b", "c"]


@pytest.mark.parametrize("text,where", [
    ("a,b\n1,2\n3\n", "line 3"),
    ("a,b\n1,2\n\n1,2,3\n", "line 4"),
    ("a,a\n1,2\n", "appears twice"),
    ("a,\n1,2\n", "no name"),
])
def test_malformed_csv_names_the_line(tmp_path, text, where):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(BadInput, match=where) as err:
        chunks(path)
    assert str(path) in str(err.value)


def test_binary_file_as_csv_is_bad_input(tmp_path):
    path = tmp_path / "bin.csv"
    path.write_bytes(b"a,b\n\xff\xfe\x00,1\n")
    with pytest.raises(BadInput, match="UTF-8"):
        chunks(path)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_is_sliced_along_axis_zero(tmp_path, save):
    path = tmp_path / "d.npz"
    ids = np.arange(10, dtype=np.uint64) * 3
    feats = np.arange(30, dtype=np.float32).reshape(10, 3)
    fortran = np.asfortranarray(np.arange(20, dtype=np.int16).reshape(10, 2))
    save(path, ids=ids, feats=feats, fortran=fortran)
    got = chunks(path, batch_size=4)
    assert [len(c["ids"]) for c in got] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([c["ids"] for c in got]), ids)
    np.testing.assert_array_equal(np.concatenate([c["feats"] for c in got]), feats)
    np.testing.assert_array_equal(np.concatenate([c["fortran"] for c in got]), fortran)
    assert got[0]["feats"].shape == (4, 3) and got[0]["feats"].dtype == np.float32
    got[0]["feats"][0, 0] = 1.0  # writable


def test_npz_arrays_of_different_lengths_or_0d_are_bad_input(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.zeros(3), y=np.zeros(4))
    with pytest.raises(BadInput, match="differ in length"):
        chunks(tmp_path / "a.npz")
    np.savez(tmp_path / "b.npz", x=np.float64(1.0))
    with pytest.raises(BadInput, match="0-d"):
        chunks(tmp_path / "b.npz")
    (tmp_path / "c.npz").write_bytes(b"not a zip")
    with pytest.raises(BadInput, match="not an npz"):
        chunks(tmp_path / "c.npz")


def test_split_ids_gives_csr():
    values, offsets = split_ids(np.array(["1|2", "", "18446744073709551615"]))
    assert values.dtype == np.uint64 and values.tolist() == [1, 2, 2**64 - 1]
    assert offsets.tolist() == [0, 2, 2, 3]
    values, offsets = split_ids(np.array(["", ""]))
    assert values.size == 0 and offsets.tolist() == [0, 0, 0]
    with pytest.raises(BadInput, match="unsigned"):
        split_ids(np.array(["1|x"]))


# ----------------------------------------------------------------------- mapping

def test_mapping_loads_from_file_or_module_and_checks_the_signature(tmp_path):
    (tmp_path / "mapping.py").write_text(MAPPING + "\ndef one_arg(columns):\n    pass\n")
    assert load_mapping(str(tmp_path / "mapping.py")).__name__ == "make_batch"
    assert load_mapping(f"{tmp_path / 'mapping.py'}:from_npz").__name__ == "from_npz"
    assert load_mapping("stream_persia.testing.samples:make_batch").__name__ == "make_batch"
    for spec, match in ((f"{tmp_path / 'mapping.py'}:nope", "no function 'nope'"),
                        (f"{tmp_path / 'mapping.py'}:one_arg", "cannot be called"),
                        (str(tmp_path / "missing.py"), "does not exist"),
                        ("no_such_module_xyz", "no module named")):
        with pytest.raises(BadInput, match=match) as err:
            load_mapping(spec)
        assert err.value.field == "--mapping"


class Collect:
    """Collects what produce() sends (a sink standing in for DataCtx)."""

    def __init__(self):
        self.batches: list[PersiaBatch] = []

    def send_data(self, batch):
        self.batches.append(batch)

    def stats(self):
        return {"bytes": sum(b.batch_size for b in self.batches)}


def test_produce_limit_repeat_skip_and_errors_naming_the_chunk(tmp_path):
    path = tmp_path / "d.csv"
    write_csv(path, 10)
    (tmp_path / "m.py").write_text(MAPPING)
    mapping = load_mapping(str(tmp_path / "m.py"))
    sink = Collect()
    summary = produce(str(path), mapping, sink, batch_size=4, repeat=3, limit=25)
    assert [b.batch_size for b in sink.batches] == [4, 4, 2, 4, 4, 2, 4, 1]
    assert [b.batch_id for b in sink.batches] == list(range(8))
    assert (summary.rows, summary.batches) == (25, 8)

    def skip_odd(columns, index):
        return None if index % 2 else mapping(columns, index)

    summary = produce(str(path), skip_odd, Collect(), batch_size=4)
    assert (summary.rows, summary.batches, summary.skipped) == (10, 2, 1)

    with pytest.raises(BadInput, match=r"returned a dict for batch 0 \(rows 1-4\)") as err:
        produce(str(path), load_mapping(f"{tmp_path / 'm.py'}:not_a_batch"), Collect(),
                batch_size=4)
    assert err.value.field == "--mapping"
    with pytest.raises(BadInput, match=r"raised KeyError.*batch 1 \(rows 5-8\)"):
        produce(str(path), load_mapping(f"{tmp_path / 'm.py'}:crashes"), Collect(),
                batch_size=4)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("repeat", [0, 3])
def test_a_file_without_rows_is_read_once_whatever_repeat_says(tmp_path, caplog, repeat):
    """A header-only file with ``--repeat 0`` re-read itself forever, sending nothing and
    saying nothing; a pass that reads no row now ends the run, with a warning."""
    path = tmp_path / "d.csv"
    path.write_text("user,item,click\n")
    (tmp_path / "m.py").write_text(MAPPING)
    with caplog.at_level("WARNING", logger="stream_persia.loader.produce"):
        summary = produce(str(path), load_mapping(str(tmp_path / "m.py")), Collect(),
                          repeat=repeat)
    assert (summary.rows, summary.batches) == (0, 0)
    assert any("no rows" in r.getMessage() and str(path) in r.getMessage()
               for r in caplog.records)


def test_progress_redraws_on_a_terminal_and_logs_otherwise(caplog):
    out = io.StringIO()
    progress = Progress(out, tty=True, interval_s=0)
    progress.update(Summary(rows=2048, batches=2, bytes=3_000_000, seconds=2.0))
    progress.close()
    text = out.getvalue()
    assert text.startswith("\r\x1b[K") and text.endswith("\n")
    assert "2,048 rows in 2 batches" in text and "1,024 rows/s" in text and "1.50 MB/s" in text
    quiet = io.StringIO()
    with caplog.at_level(logging.INFO, logger="stream_persia.loader.produce"):
        Progress(quiet, tty=False, interval_s=0).update(Summary(rows=5, batches=1))
    assert quiet.getvalue() == "" and "5 rows in 1 batches" in caplog.text
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["f.csv", "--mapping", "m.py"])
    assert (args.batch_size, args.repeat, args.limit) == (1024, 1, None)


# ---------------------------------------------------------------------- the CLI

def cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PERSIA_GLOBAL_CONFIG", "PERSIA_EMBEDDING_CONFIG")}
    return subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", "produce", *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)


def read_topic(bootstrap: str, topic: str, count: int) -> list[PersiaBatch]:
    async def run() -> list:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                    fetch_max_wait_ms=50)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])
            await consumer.seek_to_beginning()
            records: list = []
            while len(records) < count:
                for got in (await consumer.getmany(timeout_ms=100)).values():
                    records += got
            for got in (await consumer.getmany(timeout_ms=300)).values():
                records += got
            return records
        finally:
            await consumer.stop()

    records = asyncio.run(asyncio.wait_for(run(), 20))
    return [PersiaBatch.from_bytes(r.value) for r in records]


def test_cli_streams_csv_into_kafka(tmp_path, kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    data = write_csv(tmp_path / "d.csv", 11)
    (tmp_path / "m.py").write_text(MAPPING)
    done = cli(str(tmp_path / "d.csv"), "--mapping", str(tmp_path / "m.py"),
               "--kafka", kafka_broker.bootstrap_servers, "--topic", topic,
               "--batch-size", "4", "--compression", "gzip")
    assert done.returncode == 0, done.stderr
    assert "produced 11 rows in 3 batches" in done.stderr and topic in done.stderr
    batches = read_topic(kafka_broker.bootstrap_servers, topic, 3)
    assert [b.batch_id for b in batches] == [0, 1, 2]
    user = np.concatenate([b.id_type_features[0].values for b in batches])
    assert user.tolist() == [row[0] for row in data]
    tags = [t for b in batches for t in b.id_type_features[1].data]
    assert [t.tolist() for t in tags] == [[int(x) for x in row[1].split("|") if x]
                                          for row in data]
    price = np.concatenate([b.non_id_type_features[0].data[:, 0] for b in batches])
    np.testing.assert_allclose(price, [row[2] for row in data])


def test_cli_streams_npz_with_limit_and_repeat(tmp_path, kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    np.savez(tmp_path / "d.npz", user=np.arange(6, dtype=np.uint64),
             label=np.arange(12, dtype=np.float32).reshape(6, 2))
    (tmp_path / "m.py").write_text(MAPPING)
    done = cli(str(tmp_path / "d.npz"), "--mapping", f"{tmp_path / 'm.py'}:from_npz",
               "--kafka", kafka_broker.bootstrap_servers, "--topic", topic,
               "--batch-size", "4", "--repeat", "3", "--limit", "14", "--no-progress")
    assert done.returncode == 0, done.stderr
    batches = read_topic(kafka_broker.bootstrap_servers, topic, 5)
    assert [b.batch_size for b in batches] == [4, 2, 4, 2, 2]
    user = np.concatenate([b.id_type_features[0].values for b in batches])
    assert user.tolist() == [0, 1, 2, 3, 4, 5] * 2 + [0, 1]
    np.testing.assert_array_equal(batches[0].labels[0].data,
                                  np.arange(8, dtype=np.float32).reshape(4, 2))


@pytest.mark.parametrize("spec,data,message", [
    ("m.py:not_a_batch", "d.csv", "mapping not_a_batch returned a dict for batch 0"),
    ("m.py:nope", "d.csv", "--mapping"),
    ("m.py", "bad.csv", "line 3: expected 4 fields, got 2"),
    ("m.py", "d.parquet", "--format"),
])
def test_cli_bad_input_exits_2_naming_it(tmp_path, spec, data, message):
    write_csv(tmp_path / "d.csv", 3)
    (tmp_path / "bad.csv").write_text("user,tags,price,click\n1,2,3,0\n1,2\n")
    (tmp_path / "d.parquet").write_text("")
    (tmp_path / "m.py").write_text(MAPPING)
    # The destination is never reached: a port with nothing listening.
    done = cli(str(tmp_path / data), "--mapping", str(tmp_path / spec),
               "--embedding-workers", "127.0.0.1:9", "--no-progress")
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_cli_broker_less_into_an_embedding_worker(tmp_path):
    write_csv(tmp_path / "d.csv", 9)
    (tmp_path / "m.py").write_text(MAPPING)
    lt = LoopThread(name="produce-job")

    async def up():
        server = EmbeddingServer(1000, SGD(lr=0.1), EmbeddingConfig((-0.1, 0.1)))
        await server.start()
        worker = EmbeddingWorker(SCHEMA, [server.address], ready_buffer_batches=8)
        await worker.start()
        return server, worker

    async def down(server, worker):
        await worker.stop()
        await server.stop()

    server, worker = lt.run(up(), 20)
    try:
        done = cli(str(tmp_path / "d.csv"), "--mapping", str(tmp_path / "m.py"),
                   "--embedding-workers", worker.address, "--batch-size", "3")
        assert done.returncode == 0, done.stderr
        assert "produced 9 rows in 3 batches" in done.stderr and worker.address in done.stderr
        assert len(worker.ready) == 3
    finally:
        lt.run(down(server, worker), 20)
        lt.close()
