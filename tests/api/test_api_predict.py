"""Online inference: JSON and msgpack, both embedding sources, validation, micro-batching."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from api_helpers import AUTH, LiveApi, TwoHeads, settings_for, write_checkpoint

from stream_persia.checkpoint import JIT_FILENAME, CheckpointWriter, read_manifest
from stream_persia.core import wire
from stream_persia.embedding.data import IDTypeFeature, NonIDTypeFeature, PersiaBatch
from stream_persia.nn.batch import from_served
from stream_persia.nn.checkpointing import scripted
from stream_persia.nn.embedding_ctx import EmbeddingCtx, PreprocessMode
from stream_persia.rpc import RpcServer
from stream_persia.testing.samples import make_batch


def json_body(batch: PersiaBatch) -> dict:
    """The JSON form of a batch: slot -> per-sample id lists, name -> rows."""
    return {"id_type_features": {f.name: [x.tolist() for x in f.data]
                                 for f in batch.id_type_features},
            "non_id_type_features": {f.name: f.data.tolist()
                                     for f in batch.non_id_type_features}}


async def reference(job, model, batch: PersiaBatch) -> dict[str, np.ndarray]:
    """What offline evaluation computes: the worker's eval lookup, the context's feature
    preparation, the model."""
    served = await job.client(job.workers[0].address).call(
        "lookup_batch", {"batch": batch.to_wire(), "mode": "eval"})
    ctx = EmbeddingCtx(PreprocessMode.INFERENCE, model=model)
    non_id, emb, _ = ctx.prepare_features(from_served(served))
    with torch.no_grad():
        out = model(non_id, emb)
    return {k: v.numpy() for k, v in out.items()}


@pytest.fixture
async def trained(job, tmp_path):
    await job.train(6)
    model = TwoHeads(seed=1).eval()
    ckpt = await write_checkpoint(job, str(tmp_path / "ckpt-a"), model)
    return job, model, ckpt


def unseen_batch(i: int, size: int) -> PersiaBatch:
    """Ids partly outside the trained vocabulary (0..49)."""
    return make_batch(100 + i, batch_size=size, vocab=80, requires_grad=False)


@pytest.mark.parametrize("source", ["local", "workers"])
async def test_predictions_match_offline_evaluation(trained, source):
    job, model, ckpt = trained
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings=source)) as api:
        info = (await api.client.get("/v1/model")).json()
        assert info["version"] == "ckpt-a" and info["embeddings"] == source
        assert info["kind"] == "torchscript"
        for i, size in enumerate((1, 7, 33)):
            batch = unseen_batch(i, size)
            want = await reference(job, model, batch)
            r = await api.client.post("/v1/predict", json=json_body(batch))
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["checkpoint"] == "ckpt-a" and got["rows"] == size
            assert got["heads"] == ["click", "buy"]
            click = np.array([p["click"] for p in got["predictions"]])
            buy = np.array([p["buy"] for p in got["predictions"]])
            np.testing.assert_allclose(click, want["click"], atol=1e-6, rtol=0)
            np.testing.assert_allclose(buy, want["buy"], atol=1e-6, rtol=0)
            # The same batch as msgpack, answered in msgpack.
            r = await api.client.post("/v1/predict", content=batch.to_bytes(), headers={
                "content-type": "application/msgpack", "accept": "application/msgpack"})
            assert r.status_code == 200, r.text
            packed = wire.unpack(r.content)
            np.testing.assert_allclose(packed["outputs"]["buy"], want["buy"], atol=1e-6)
            assert packed["missing_ids"] == got["missing_ids"]


async def test_missing_ids_are_counted_per_request_even_when_batched(trained):
    job, model, ckpt = trained
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="local",
                                    batch_wait_ms=20)) as api:
        known = {"id_type_features": {"user": [[1, 2]], "item": [3], "tags": [[4]]},
                 "non_id_type_features": {"dense": [[0.0, 0.0, 0.0]]}}
        unknown = {"id_type_features": {"user": [[10**12, 10**12 + 1, 10**12]],
                                        "item": [10**13], "tags": [[10**14, 5]]},
                   "non_id_type_features": {"dense": [[1.0, 0.0, 0.0]]}}
        rs = await asyncio.gather(*(api.client.post("/v1/predict", json=b)
                                    for b in [known, unknown] * 8))
        assert [r.status_code for r in rs] == [200] * 16
        # Distinct absent ids per request: user 2 (repeat counted once), item 1, tags 1.
        assert [r.json()["missing_ids"] for r in rs] == [0, 4] * 8
        stats = api.state.predictor.batcher.stats
        assert stats["requests"] >= 16 and stats["batches"] < stats["requests"]


async def test_a_worker_answering_another_batchs_rows_is_an_error_not_an_answer(trained):
    """A worker (of another job or version) answers ``lookup_batch`` with the rows of a
    batch of another size: concatenated with the micro-batch's other requests they would
    shift every answer after them. The request fails naming the worker (502)."""
    job, model, ckpt = trained
    real = job.client(job.workers[0].address)
    other = await real.call("lookup_batch", {"batch": unseen_batch(0, 3).to_wire(),
                                             "mode": "infer"})

    async def lookup_batch(params):
        return other

    async def health(params):
        return {"ok": True}

    fake = RpcServer({"lookup_batch": lookup_batch, "health": health}, name="worker")
    await fake.start()
    try:
        settings = settings_for(job, model_checkpoint=ckpt, embeddings="workers",
                                embedding_workers=[fake.address])
        async with LiveApi(settings) as api:
            body = {"id_type_features": {"user": [[1, 2], [3]], "item": [3, 4],
                                         "tags": [[4], [5]]},
                    "non_id_type_features": {"dense": [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]}}
            r = await api.client.post("/v1/predict", json=body)
            assert r.status_code == 502, r.text
            assert r.json()["error"]["field"] == "batch_size"
            assert "3 rows for a request of 2" in r.json()["error"]["message"]
    finally:
        await fake.stop()


async def test_concurrent_requests_share_forward_passes_and_keep_their_answers(trained):
    job, model, ckpt = trained
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="local",
                                    batch_wait_ms=20)) as api:
        batches = [unseen_batch(i, 1 + i % 4) for i in range(24)]
        alone = []
        for b in batches:   # one at a time: each is its own forward pass
            alone.append((await api.client.post("/v1/predict", json=json_body(b))).json())
        before = dict(api.state.predictor.batcher.stats)
        together = await asyncio.gather(*(api.client.post("/v1/predict", json=json_body(b))
                                          for b in batches))
        stats = api.state.predictor.batcher.stats
        assert stats["requests"] - before["requests"] == 24
        assert stats["batches"] - before["batches"] < 24
        for a, t in zip(alone, together, strict=True):
            t = t.json()
            assert t["rows"] == a["rows"] and t["missing_ids"] == a["missing_ids"]
            for pa, pt in zip(a["predictions"], t["predictions"], strict=True):
                assert pt["click"] == pytest.approx(pa["click"], abs=1e-6)
                np.testing.assert_allclose(pt["buy"], pa["buy"], atol=1e-6)


async def test_bad_requests_are_422_naming_the_field(trained):
    job, model, ckpt = trained
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="local",
                                    max_rows_per_request=8)) as api:
        dense = {"dense": [[0.0, 0.0, 0.0]]}
        ok = {"user": [[1]], "item": [2], "tags": [[3]]}
        cases = [
            ({"id_type_features": {**ok, "usr": [[1]]}, "non_id_type_features": dense},
             "id_type_features.usr"),
            ({"id_type_features": {**ok, "user": [[1.5]]}, "non_id_type_features": dense},
             "id_type_features.user[0]"),
            ({"id_type_features": {**ok, "user": [["7"]]}, "non_id_type_features": dense},
             "id_type_features.user[0]"),
            ({"id_type_features": {**ok, "user": [[-1]]}, "non_id_type_features": dense},
             "id_type_features.user"),
            ({"id_type_features": {**ok, "user": [[2**64]]}, "non_id_type_features": dense},
             "id_type_features.user"),
            ({"id_type_features": {**ok, "user": [True]}, "non_id_type_features": dense},
             "id_type_features.user[0]"),
            ({"id_type_features": {**ok, "item": [1, 2]}, "non_id_type_features": dense},
             "id_type_features.item"),
            ({"id_type_features": ok, "non_id_type_features": {"dense": [["a", 1, 2]]}},
             "non_id_type_features.dense"),
            ({"id_type_features": ok, "non_id_type_features": {"dense": [[1, 2], [3]]}},
             "non_id_type_features.dense"),
            ({"id_type_features": ok, "non_id_type_features": {"dense": [[0.0, 0.0]]}},
             "non_id_type_features"),
            ({"id_type_features": ok}, "non_id_type_features"),
            ({"id_type_features": {}}, "id_type_features"),
            ({"id_type_features": ok, "labels": {}}, "labels"),
            ([1, 2], "body"),
        ]
        for body, field in cases:
            r = await api.client.post("/v1/predict", json=body)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"]["field"] == field, (body, r.json())
        r = await api.client.post("/v1/predict", content=b"{not json",
                                  headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "body"
        r = await api.client.post("/v1/predict", content=b'{"a": NaN}',
                                  headers={"content-type": "application/json"})
        assert r.status_code == 422
        r = await api.client.post("/v1/predict", content=b"\x93\x01",
                                  headers={"content-type": "application/msgpack"})
        assert r.status_code == 422
        r = await api.client.post("/v1/predict", content=b"x",
                                  headers={"content-type": "text/plain"})
        assert r.status_code == 415
        # Rows over the limit: 413, in both encodings.
        many = {"id_type_features": {"user": [[1]] * 9}}
        r = await api.client.post("/v1/predict", json=many)
        assert r.status_code == 413 and r.json()["error"]["field"] == "id_type_features.user"
        big = make_batch(0, batch_size=9, requires_grad=False)
        r = await api.client.post("/v1/predict", content=big.to_bytes(),
                                  headers={"content-type": "application/msgpack"})
        assert r.status_code == 413
        # Unknown slot in a msgpack batch.
        odd = PersiaBatch([IDTypeFeature("color", [np.array([1], np.uint64)])],
                          [NonIDTypeFeature(np.zeros((1, 3), np.float32), "dense")],
                          requires_grad=False)
        r = await api.client.post("/v1/predict", content=odd.to_bytes(),
                                  headers={"content-type": "application/msgpack"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "id_type_features.color"


@pytest.mark.parametrize("source", ["local", "workers"])
async def test_ids_past_a_raw_slots_fixed_size_are_counted_not_dropped_silently(trained,
                                                                              source):
    """``tags`` is a raw slot of sample_fixed_size 3: a sample naming 100,000 tags was
    answered 200 with missing_ids 0, as if every id had been looked up, though only the
    first 3 were (PERSIA's rule). The answer now says how many it leaves out."""
    job, model, ckpt = trained
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings=source)) as api:
        dense = {"dense": [[0.0, 0.0, 0.0], [0.1, 0.2, 0.3]]}
        body = {"id_type_features": {"user": [[1], [2]], "item": [2, 3],
                                     "tags": [list(range(100_000)), [1, 2]]},
                "non_id_type_features": dense}
        r = await api.client.post("/v1/predict", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["truncated_ids"] == 100_000 - 3
        first = r.json()["predictions"]
        body["id_type_features"]["tags"][0] = [0, 1, 2]   # what was looked up: same answer
        r = await api.client.post("/v1/predict", json=body)
        assert r.json()["truncated_ids"] == 0 and r.json()["predictions"] == first
        batch = PersiaBatch([IDTypeFeature("user", [np.array([1], np.uint64)]),
                             IDTypeFeature("item", [np.array([2], np.uint64)]),
                             IDTypeFeature("tags", [np.arange(5, dtype=np.uint64)])],
                            [NonIDTypeFeature(np.zeros((1, 3), np.float32), "dense")],
                            requires_grad=False)
        r = await api.client.post("/v1/predict", content=batch.to_bytes(),
                                  headers={"content-type": "application/msgpack",
                                           "accept": "application/msgpack"})
        assert r.status_code == 200 and wire.unpack(r.content)["truncated_ids"] == 2


async def test_a_key_given_twice_or_a_boolean_value_is_422_not_read_silently(trained):
    """A JSON parser keeps the last of two equal keys and numpy reads true as 1.0: either
    would score something other than what the request says, without a word."""
    job, model, ckpt = trained
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="local")) as api:
        ids = '"user": [[1]], "item": [2], "tags": [[3]]'
        dense = '"non_id_type_features": {"dense": [[0.1, 0.2, 0.3]]}'

        def doc(id_part: str, rest: str) -> str:
            return '{"id_type_features": {' + id_part + '}, ' + rest + '}'

        cases = [
            (doc('"user": [[7]], ' + ids, dense), "id_type_features.user"),
            (doc(ids, '"non_id_type_features": {"dense": [[0.1, 0.2, 0.3]], '
                      '"dense": [[0.4, 0.5, 0.6]]}'), "non_id_type_features.dense"),
            (doc('"user": [[9]], "item": [9], "tags": [[9]]',
                 '"id_type_features": {' + ids + '}, ' + dense), "id_type_features"),
            (doc(ids, '"non_id_type_features": {"dense": [[true, 0.2, 0.3]]}'),
             "non_id_type_features.dense"),
            (doc(ids, '"non_id_type_features": {"dense": [[false, true, false]]}'),
             "non_id_type_features.dense"),
        ]
        for body, field in cases:
            r = await api.client.post("/v1/predict", content=body.encode(),
                                      headers={"content-type": "application/json"})
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"]["field"] == field, (body, r.json())
        # "true" in a name is not a value (the checkpoint takes its one feature by any name)
        body = doc(ids, '"non_id_type_features": {"is_true": [[1, 0.5, 0]]}').encode()
        r = await api.client.post("/v1/predict", content=body,
                                  headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text


class PickItem(torch.nn.Module):
    """A score, an item id (int64, past 2**24 where float32 has gaps) and a bool flag."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        x = non_id[0]
        item = 16777217 + torch.arange(x.shape[0]) + (x[:, 0] > 0).long() * 1000   # 2**24 + 1
        return {"score": torch.sigmoid(self.linear(x)).squeeze(1), "item": item,
                "flag": x[:, 0] > 0}


async def test_integer_and_bool_heads_are_answered_exactly(job, tmp_path):
    """An integer head went through float32: item 16777217 was answered as 16777216.0."""
    ckpt = await write_checkpoint(job, str(tmp_path / "pick"), PickItem())
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="local")) as api:
        body = {"id_type_features": {"user": [[1], [2]], "item": [2, 3], "tags": [[3], []]},
                "non_id_type_features": {"dense": [[0.5, 0.0, 0.0], [-1.0, 0.0, 0.0]]}}
        r = await api.client.post("/v1/predict", json=body)
        assert r.status_code == 200, r.text
        got = [(p["item"], p["flag"]) for p in r.json()["predictions"]]
        assert got == [(2**24 + 1 + 1000, True), (2**24 + 2, False)]
        assert all(type(i) is int for i, _ in got)
        assert all(isinstance(p["score"], float) for p in r.json()["predictions"])
        r = await api.client.post("/v1/predict", json=body,
                                  headers={"accept": "application/msgpack"})
        outputs = wire.unpack(r.content)["outputs"]
        assert outputs["item"].tolist() == [2**24 + 1 + 1000, 2**24 + 2]
        assert outputs["flag"].tolist() == [True, False]
        assert outputs["score"].dtype == np.float32


async def test_a_patch_checkpoint_is_served_with_its_whole_chain(trained, tmp_path):
    """An incremental checkpoint holds only the rows changed since its parent: served
    alone (local embeddings) most ids answered as missing, zeros, unlike a full
    checkpoint of the same moment."""
    job, model, _ = trained
    root = tmp_path / "chain"
    await write_checkpoint(job, str(root / "base"), model)
    await job.train(1, seed=3)          # a few rows change after the base
    clients = [job.client(a) for a in job.server_addresses]
    with CheckpointWriter(str(root / "patch")) as w:
        w.write_bytes(JIT_FILENAME, scripted(model))
        await w.dump_embeddings(clients, parent=read_manifest(str(root / "base")))
        patch = w.commit(job="test", step=2, offsets={}, stream="direct")
    assert patch.is_patch and 0 < patch.rows < patch.table_rows
    full = await write_checkpoint(job, str(root / "full"), model)
    answers = []
    for ckpt in (full, str(root / "patch")):
        async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="local")) as api:
            r = await api.client.post("/v1/predict", json=json_body(unseen_batch(9, 16)))
            assert r.status_code == 200, r.text
            answers.append(r.json())
    assert answers[1]["missing_ids"] == answers[0]["missing_ids"]
    for p_full, p_patch in zip(answers[0]["predictions"], answers[1]["predictions"],
                               strict=True):
        assert p_patch["click"] == pytest.approx(p_full["click"], abs=1e-6)


async def test_one_bad_request_does_not_fail_its_micro_batch(trained):
    job, model, ckpt = trained
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="local",
                                    batch_wait_ms=30)) as api:
        good = json_body(unseen_batch(0, 2))
        bad = json_body(unseen_batch(1, 2))
        bad["non_id_type_features"]["dense"] = [[0.0] * 5, [0.0] * 5]   # wrong width
        rs = await asyncio.gather(*(api.client.post("/v1/predict", json=b)
                                    for b in [good, bad, good, good]))
        assert [r.status_code for r in rs] == [200, 422, 200, 200]


async def test_model_class_and_state_dict(trained, tmp_path):
    job, model, _ = trained
    ckpt = await write_checkpoint(job, str(tmp_path / "sd"), model, jit=False,
                                  heads=["click", "buy"])
    async with LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="local",
                                    model_class="api_helpers:TwoHeads")) as api:
        batch = unseen_batch(5, 3)
        r = await api.client.post("/v1/predict", json=json_body(batch))
        assert r.status_code == 200, r.text
        want = await reference(job, model, batch)
        got = np.array([p["click"] for p in r.json()["predictions"]])
        np.testing.assert_allclose(got, want["click"], atol=1e-6)
        assert (await api.client.get("/v1/model")).json()["kind"] == "state_dict"
    async with LiveApi(settings_for(job, embeddings="local",
                                    checkpoint_dir=str(tmp_path))) as api:   # no class: 422
        r = await api.client.post("/v1/model/reload", json={"checkpoint": ckpt}, headers=AUTH)
        assert r.status_code == 422 and "jit_dense.pt" in r.json()["error"]["message"]
        assert (await api.client.get("/readyz")).status_code == 200   # no model was asked for


async def test_readiness_waits_for_the_configured_model(trained, tmp_path):
    job, model, ckpt = trained
    async with LiveApi(settings_for(job, embeddings="local", checkpoint_dir=str(tmp_path))) as api:
        assert (await api.client.get("/v1/model")).status_code == 503
        r = await api.client.post("/v1/model/reload", json={"checkpoint": "nope"}, headers=AUTH)
        assert r.status_code == 422 and r.json()["error"]["field"] == "checkpoint"
        r = await api.client.post("/v1/model/reload", json={"checkpoint": "ckpt-a"},
                                  headers=AUTH)   # an id under the checkpoint directory
        assert r.status_code == 200 and r.json()["version"] == "ckpt-a"
        assert (await api.client.get("/readyz")).json()["model"]["version"] == "ckpt-a"


async def test_a_model_that_is_not_there_yet_is_retried(trained, tmp_path):
    job, model, _ = trained
    later = str(tmp_path / "later")
    async with LiveApi(settings_for(job, model_checkpoint=later, embeddings="local")) as api:
        r = await api.client.get("/readyz")
        assert r.status_code == 503
        assert any("no model loaded" in p and "later" in p for p in r.json()["problems"])
        r = await api.client.post("/v1/predict", json=json_body(unseen_batch(0, 1)))
        assert r.status_code == 503 and r.json()["error"]["kind"] == "not_ready"
        await write_checkpoint(job, later, model)
        async with asyncio.timeout(20):
            while (await api.client.get("/readyz")).status_code != 200:
                await asyncio.sleep(0.2)
        r = await api.client.post("/v1/predict", json=json_body(unseen_batch(0, 1)))
        assert r.status_code == 200 and r.json()["checkpoint"] == "later"
