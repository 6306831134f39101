"""The stream watermarks' bookkeeping (stream_persia.core.watermarks), without sockets: how a
server advances and checks them, restores them from a cut, and how a worker merges every
server's into where it may start a partition."""

from __future__ import annotations

import pytest

from stream_persia.core.watermarks import (
    Mark,
    PartitionMark,
    Source,
    Watermarks,
    merge,
    parse_cut,
    parse_cut_fingerprints,
    parse_source,
    refusals,
    resume_fingerprints,
    resume_points,
)
from stream_persia.errors import BadInput, StreamReplay


def src(offset: int, writer: str = "a.1", partition: int = 0, topic: str = "t") -> Source:
    return Source(topic, partition, offset, writer)


def apply(marks: Watermarks, source: Source) -> None:
    marks.check(source)
    marks.advance(source)


def test_one_writer_advances_its_mark_in_any_order():
    marks = Watermarks("embedding server 0")
    for o in (0, 2, 1, 5, 3):        # pushes overlap with staleness > 1
        apply(marks, src(o))
    assert marks.get("t", 0) == Mark(5, "a.1")
    apply(marks, src(4))              # still the same writer: below the mark is fine
    assert marks.get("t", 0) == Mark(5, "a.1")
    apply(marks, src(0, partition=1))
    assert marks.to_wire() == {"t": {"0": {"offset": 5, "writer": "a.1"},
                                     "1": {"offset": 0, "writer": "a.1"}}}


def test_another_writer_at_or_below_the_mark_is_a_replay():
    marks = Watermarks("embedding server 3")
    for o in range(4):
        apply(marks, src(o))
    for o in (0, 3):
        with pytest.raises(StreamReplay) as err:
            apply(marks, src(o, writer="b.1"))
        msg = str(err.value)
        assert f"embedding server 3 refuses the update of t/0 offset {o} from stream b.1" in msg
        assert "up to offset 3 (applied by stream a.1)" in msg
        assert err.value.field == "offset"
    assert marks.get("t", 0) == Mark(3, "a.1")        # nothing changed
    apply(marks, src(4, writer="b.1"))                 # past it: the new stream takes over
    assert marks.get("t", 0) == Mark(4, "b.1")
    with pytest.raises(StreamReplay):                  # and the old one is refused now
        apply(marks, src(4, writer="a.1"))
    apply(marks, src(0, writer="a.1", topic="u"))      # topics are apart


def test_a_cut_restores_marks_that_refuse_every_writer_below_it():
    marks = Watermarks("embedding server 0", parse_cut({"t": {"0": 5, "1": 0}}))
    assert marks.get("t", 0) == Mark(4, None) and marks.get("t", 1) == Mark(-1, None)
    with pytest.raises(StreamReplay, match="applied by a checkpoint restored since"):
        apply(marks, src(4))
    apply(marks, src(5))
    apply(marks, src(0, partition=1))
    assert marks.get("t", 0) == Mark(5, "a.1")
    marks.clear()
    assert len(marks) == 0 and marks.to_wire() == {}
    apply(marks, src(0, writer="b.1"))                 # cleared: the stream starts over


def test_the_partitions_a_server_tracks_are_bounded(monkeypatch):
    monkeypatch.setattr("stream_persia.core.watermarks.MAX_PARTITIONS", 3)
    marks = Watermarks("embedding server 0")
    for p in range(3):
        apply(marks, src(0, partition=p))
    apply(marks, src(5, partition=2))           # known ones go on
    with pytest.raises(BadInput) as err:
        apply(marks, src(0, partition=3))
    assert err.value.field == "source.partition" and len(marks) == 3
    with pytest.raises(BadInput, match="more than 3"):
        parse_cut({"t": {"0": 1, "1": 1}, "u": {"0": 1, "1": 1}})
    assert marks.to_wire("nope") == {} and list(marks.to_wire("t")) == ["t"]


def test_gaps_are_fine_it_is_a_high_watermark():
    marks = Watermarks("embedding server 0")
    for o in (0, 1, 7, 100):          # on_data_loss: skip, dead letters, eval batches
        apply(marks, src(o))
    assert marks.get("t", 0) == Mark(100, "a.1")


@pytest.mark.parametrize("value,field", [
    ("x", "source"),
    ({"topic": "t", "partition": 0, "offset": 0}, "source.writer"),
    ({"topic": "t", "partition": 0, "offset": 0, "writer": ""}, "source.writer"),
    ({"topic": "t", "partition": 0, "offset": 0, "writer": "w" * 65}, "source.writer"),
    ({"topic": "", "partition": 0, "offset": 0, "writer": "w"}, "source.topic"),
    ({"topic": "t" * 250, "partition": 0, "offset": 0, "writer": "w"}, "source.topic"),
    ({"topic": "t", "partition": -1, "offset": 0, "writer": "w"}, "source.partition"),
    ({"topic": "t", "partition": True, "offset": 0, "writer": "w"}, "source.partition"),
    ({"topic": "t", "partition": 0, "offset": 1 << 63, "writer": "w"}, "source.offset"),
    ({"topic": "t", "partition": 0, "offset": "3", "writer": "w"}, "source.offset"),
    ({"topic": "t", "partition": 0, "offset": 0, "writer": "w", "x": 1}, "source.x"),
])
def test_a_bad_source_is_refused_naming_the_field(value, field):
    with pytest.raises(BadInput) as err:
        parse_source(value)
    assert err.value.field == field


@pytest.mark.parametrize("value,field", [
    ([], "cut"), ({"t": []}, "cut.t"), ({"t": {"x": 1}}, "cut.t.x"),
    ({"t": {"0": -1}}, "cut.t.0"), ({"": {"0": 1}}, "cut"),
])
def test_a_bad_cut_is_refused_naming_the_field(value, field):
    with pytest.raises(BadInput) as err:
        parse_cut(value)
    assert err.value.field == field


def test_parse_accepts_the_wire_forms():
    assert parse_source(None) is None
    assert parse_source(src(3).to_wire()) == src(3)
    assert parse_cut(None) == {} and parse_cut({"t": {"2": 7, 3: 1}}) == {"t": {2: 7, 3: 1}}


def test_a_worker_merges_every_servers_marks():
    s0 = Watermarks("s0", parse_cut({"t": {"0": 5, "1": 5, "2": 5}}))
    s1 = Watermarks("s1", parse_cut({"t": {"0": 5, "1": 5, "2": 5}}))
    apply(s1, src(5, partition=1))    # partition 1 trained past the cut, on server 1 only
    apply(s0, src(9, partition=3))
    marks = merge([{"topics": s0.to_wire()}, {"topics": s1.to_wire()}], "t")
    assert marks == {0: PartitionMark(4, 0, None, True), 1: PartitionMark(5, 1, "a.1", False),
                     2: PartitionMark(4, 0, None, True), 3: PartitionMark(9, 0, "a.1", False)}
    assert merge([{"topics": s0.to_wire()}], "other") == {}
    # Where a partition given no start offset starts: at a restored cut nothing passed.
    assert resume_points(marks) == {0: 5, 2: 5}
    refused = refusals("t", marks, {0: 5, 1: 5, 2: 0, 3: 10, 4: 0})
    assert [(r.partition, r.start, r.mark.offset) for r in refused] == [(1, 5, 5), (2, 0, 4)]
    text = refused[0].describe("embedding worker 0", ["h0:1", "h1:2"])
    assert "embedding worker 0 refuses to serve t/1 from offset 5" in text
    assert "embedding server 1 (h1:2) holds the updates of that partition up to offset 5" \
        in text
    assert refused[0].to_dict() == {"topic": "t", "partition": 1, "start": 5, "watermark": 5,
                                    "server": 1, "writer": "a.1"}
    with pytest.raises(BadInput):
        merge([{"nope": 1}], "t")


def fp(offset: int, digest: str = "0123456789abcdef") -> dict:
    return {"offset": offset, "timestamp": 1_700_000_000_000, "digest": digest}


def test_restored_marks_keep_the_cuts_fingerprints_until_trained_past():
    """A load's fingerprints stay with its restored marks (one of another offset is not
    kept), travel in the watermarks reply, and reach the worker's merge, which hands them
    to where it resumes; a mark trained past (or cleared) drops its fingerprint."""
    cut = parse_cut({"t": {"0": 5, "1": 5, "2": 3}})
    prints = parse_cut_fingerprints({"t": {"0": fp(4), "1": fp(4, "f" * 16), "2": fp(7)}})
    s0 = Watermarks("s0", cut, prints)
    s1 = Watermarks("s1", cut)                   # a server loaded without them
    assert s0.to_wire()["t"] == {"0": {"offset": 4, "writer": None, "fingerprint": fp(4)},
                                 "1": {"offset": 4, "writer": None,
                                       "fingerprint": fp(4, "f" * 16)},
                                 "2": {"offset": 2, "writer": None}}
    apply(s0, src(5, partition=1))
    assert s0.to_wire()["t"]["1"] == {"offset": 5, "writer": "a.1"}
    marks = merge([{"topics": s1.to_wire()}, {"topics": s0.to_wire()}], "t")
    assert marks[0] == PartitionMark(4, 0, None, True, fp(4))
    assert resume_points(marks) == {0: 5, 2: 3}
    assert resume_fingerprints(marks) == {0: fp(4)}
    s0.clear()
    apply(s0, src(4))
    assert s0.to_wire()["t"] == {"0": {"offset": 4, "writer": "a.1"}}


@pytest.mark.parametrize("value,field", [
    ([], "cut_fingerprints"), ({"t": []}, "cut_fingerprints.t"),
    ({"t": {"x": fp(1)}}, "cut_fingerprints.t.x"),
    ({"t": {"0": {"offset": 1}}}, "cut_fingerprints.t.0"),
    ({"t": {"0": {**fp(1), "offset": True}}}, "cut_fingerprints.t.0"),
    ({"t": {"0": {**fp(1), "digest": "a" * 32}}}, "cut_fingerprints.t.0"),
    ({"t": {"0": {**fp(1), "digest": "X" * 16}}}, "cut_fingerprints.t.0"),
    ({"t": {"0": {**fp(1), "offset": -1}}}, "cut_fingerprints.t.0"),
    ({"t": {"0": {**fp(1), "more": 1}}}, "cut_fingerprints.t.0"),
    ({"": {"0": fp(1)}}, "cut_fingerprints"),
])
def test_bad_cut_fingerprints_are_refused_naming_the_field(value, field):
    with pytest.raises(BadInput) as err:
        parse_cut_fingerprints(value)
    assert err.value.field == field


def test_a_worker_skips_a_malformed_fingerprint_naming_the_server(caplog):
    """The servers check fingerprints as the worker reads them; one a server sends
    malformed all the same (another version) is not checked, logged naming the server
    and partition, instead of keeping the worker from starting."""
    from types import SimpleNamespace

    from stream_persia.kafka.fingerprint import Fingerprint
    from stream_persia.worker.ingest import KafkaIngest

    marks = {0: PartitionMark(4, 1, None, True, fp(4)),
             1: PartitionMark(4, 2, None, True, {**fp(4), "digest": "zz"}),
             2: PartitionMark(4, 0, None, True, fp(4))}
    ingest = SimpleNamespace(worker=SimpleNamespace(replica_index=0),
                             consumer=SimpleNamespace(topic="t"))
    with caplog.at_level("WARNING"):
        got = KafkaIngest._resume_fingerprints(ingest, marks, {0: 5, 1: 5})
    assert got == {0: Fingerprint.from_dict(fp(4))}
    assert "embedding server 2's fingerprint of t/1 is not one" in caplog.text
