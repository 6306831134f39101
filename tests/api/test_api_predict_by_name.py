"""``POST /v1/predict`` matches a request's features to the model's inputs by name.

A PERSIA model takes positional lists; a JSON object (or a msgpack ``PersiaBatch``) names
its features in whatever order the client chose. The same samples scored with the keys in
schema order, reversed and sorted must get the same answers (issue 17 saw three different
sets of scores, all 200), and a name the model does not take (``xyz`` for ``dense``) or
one it lacks is 422 naming it. The model here has two non-ID features of the same width,
so that swapping them (or any two slots of one total width) would run and score
differently instead of failing.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from api_helpers import AUTH, DenseAndContext, LiveApi, TwoHeads, settings_for, write_checkpoint
from stream_persia.api.features import signature, truncated_ids
from stream_persia.api.inputs import ModelInputs, NonIdInput

from stream_persia.core import wire
from stream_persia.embedding.data import NonIDTypeFeature, PersiaBatch
from stream_persia.nn.batch import from_served, input_signature
from stream_persia.nn.embedding_ctx import EmbeddingCtx, PreprocessMode
from stream_persia.testing.samples import make_batch


def batch_of(i: int, size: int) -> PersiaBatch:
    """Slots user, item, tags and the non-ID features dense (3) and ctx (3), in the order
    the model was trained with."""
    b = make_batch(100 + i, batch_size=size, vocab=80, requires_grad=False)
    ctx = np.random.default_rng(i).normal(size=(size, 3)).astype(np.float32)
    return PersiaBatch(b.id_type_features, [b.non_id_type_features[0],
                                            NonIDTypeFeature(ctx, "ctx")],
                       requires_grad=False)


def body(batch: PersiaBatch, order=lambda names: names) -> dict:
    """The JSON form of ``batch`` with the keys of both objects in ``order(names)``."""
    ids = {f.name: [x.tolist() for x in f.data] for f in batch.id_type_features}
    dense = {f.name: f.data.tolist() for f in batch.non_id_type_features}
    return {"id_type_features": {k: ids[k] for k in order(list(ids))},
            "non_id_type_features": {k: dense[k] for k in order(list(dense))}}


def reordered(batch: PersiaBatch) -> PersiaBatch:
    """``batch`` with its slots and its non-ID features each in reverse order."""
    return PersiaBatch(batch.id_type_features[::-1], batch.non_id_type_features[::-1],
                       requires_grad=False)


async def offline(job, model, batch: PersiaBatch):
    """What offline evaluation computes for ``batch`` (in training order)."""
    served = await job.client(job.workers[0].address).call(
        "lookup_batch", {"batch": batch.to_wire(), "mode": "eval"})
    non_id, emb, _ = EmbeddingCtx(PreprocessMode.INFERENCE, model=model).prepare_features(
        from_served(served))
    with torch.no_grad():
        out = model(non_id, emb)
    return {k: v.numpy() for k, v in out.items()} if isinstance(out, dict) else out.numpy()


@pytest.fixture
async def served(job, tmp_path):
    """A checkpoint of a trained job whose manifest records the model's inputs as
    ``dump_checkpoint`` does (``input_signature`` of a batch the workers served)."""
    await job.train(6)
    model = DenseAndContext(seed=3).eval()
    reply = await job.client(job.workers[0].address).call(
        "lookup_batch", {"batch": batch_of(0, 2).to_wire(), "mode": "eval"})
    inputs = input_signature(from_served(reply))
    assert inputs == {"id_type_features": ["user", "item", "tags"],
                      "non_id_type_features": [
                          {"name": "dense", "dtype": "float32", "shape": [3]},
                          {"name": "ctx", "dtype": "float32", "shape": [3]}]}
    root = tmp_path / "ckpts"
    await write_checkpoint(job, str(root / "named"), model, inputs=inputs)
    # Written as before the record existed: one non-ID feature, no inputs recorded.
    await write_checkpoint(job, str(root / "older"), TwoHeads(seed=1), heads=["click", "buy"])
    return job, model, str(root)


@pytest.mark.parametrize("source", ["local", "workers"])
async def test_key_order_does_not_change_predictions(served, source):
    job, model, root = served
    async with LiveApi(settings_for(job, model_checkpoint=f"{root}/named", embeddings=source,
                                    checkpoint_dir=root, batch_wait_ms=20)) as api:
        info = (await api.client.get("/v1/model")).json()
        assert info["inputs"]["recorded"] is True
        assert info["inputs"]["id_type_features"] == ["user", "item", "tags"]
        batch = batch_of(1, 4)
        want = await offline(job, model, batch)
        orders = {"schema": lambda n: n, "reversed": lambda n: n[::-1], "sorted": sorted}
        for name, order in orders.items():
            r = await api.client.post("/v1/predict", json=body(batch, order))
            assert r.status_code == 200, (name, r.text)
            got = [p["output"] for p in r.json()["predictions"]]
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=name)
        # msgpack: a PersiaBatch with both lists reversed, answered in msgpack.
        r = await api.client.post("/v1/predict", content=reordered(batch).to_bytes(),
                                  headers={"content-type": "application/msgpack",
                                           "accept": "application/msgpack"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(wire.unpack(r.content)["outputs"]["output"], want,
                                   atol=1e-6, rtol=0)
        # Concurrent requests in every order (micro-batched together when they meet).
        rs = await asyncio.gather(*(api.client.post("/v1/predict", json=body(
            batch, orders[k])) for k in ["schema", "reversed", "sorted"] * 4))
        assert [r.status_code for r in rs] == [200] * 12
        for r in rs:
            np.testing.assert_allclose([p["output"] for p in r.json()["predictions"]], want,
                                       atol=1e-6, rtol=0)


async def test_unknown_and_missing_names_are_422_naming_them(served):
    job, model, root = served
    async with LiveApi(settings_for(job, model_checkpoint=f"{root}/named", embeddings="local",
                                    checkpoint_dir=root)) as api:
        ok = body(batch_of(2, 2))
        ids, dense = ok["id_type_features"], ok["non_id_type_features"]
        cases = [
            # issue 17: a wrong non-ID name was accepted
            ({"id_type_features": ids,
              "non_id_type_features": {"xyz": dense["dense"], "ctx": dense["ctx"]}},
             "non_id_type_features.xyz"),
            ({"id_type_features": ids, "non_id_type_features": {"dense": dense["dense"]}},
             "non_id_type_features.ctx"),
            ({"id_type_features": {k: v for k, v in ids.items() if k != "tags"},
              "non_id_type_features": dense}, "id_type_features.tags"),
            ({"id_type_features": ids,
              "non_id_type_features": {**dense, "extra": dense["ctx"]}},
             "non_id_type_features.extra"),
            ({"id_type_features": ids,
              "non_id_type_features": {**dense, "ctx": [[0.0, 1.0], [2.0, 3.0]]}},
             "non_id_type_features.ctx"),
        ]
        for req, field in cases:
            r = await api.client.post("/v1/predict", json=req)
            assert r.status_code == 422, (field, r.text)
            assert r.json()["error"]["field"] == field, r.json()
        r = await api.client.post("/v1/predict", json=cases[0][0])
        assert "dense" in r.json()["error"]["message"] + r.json()["error"]["hint"]
        # The same through msgpack: an unknown non-ID name, and a slot given twice over.
        b = batch_of(2, 2)
        odd = PersiaBatch(b.id_type_features, [b.non_id_type_features[1],
                                               NonIDTypeFeature(b.non_id_type_features[0]
                                                                .data, "xyz")],
                          requires_grad=False)
        r = await api.client.post("/v1/predict", content=odd.to_bytes(),
                                  headers={"content-type": "application/msgpack"})
        assert r.status_code == 422 and r.json()["error"]["field"] == \
            "non_id_type_features.xyz", r.text
        twice = PersiaBatch(b.id_type_features, [b.non_id_type_features[0]] * 2,
                            requires_grad=False)
        r = await api.client.post("/v1/predict", content=twice.to_bytes(),
                                  headers={"content-type": "application/msgpack"})
        assert r.status_code == 422 and r.json()["error"]["field"] == \
            "non_id_type_features.dense", r.text
        # Still serving.
        r = await api.client.post("/v1/predict", json=ok)
        assert r.status_code == 200, r.text


async def test_a_checkpoint_without_a_record_takes_the_embedding_configs_order(served):
    """Older checkpoints: slots in ``slots_config`` order whatever the request's order,
    every slot required; one non-ID feature is taken whatever its name, several cannot be
    matched by name, so are refused."""
    job, _, root = served
    async with LiveApi(settings_for(job, embeddings="local", checkpoint_dir=root)) as api:
        r = await api.client.post("/v1/model/reload", json={"checkpoint": "older"},
                                  headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["inputs"] == {"id_type_features": ["user", "item", "tags"],
                                      "non_id_type_features": None, "recorded": False}
        both = batch_of(3, 3)
        batch = PersiaBatch(both.id_type_features, both.non_id_type_features[:1],
                            requires_grad=False)
        want = (await offline(job, TwoHeads(seed=1).eval(), batch))["click"]
        for order in (lambda n: n, lambda n: n[::-1], sorted):
            r = await api.client.post("/v1/predict", json=body(batch, order))
            assert r.status_code == 200, r.text
            np.testing.assert_allclose([p["click"] for p in r.json()["predictions"]], want,
                                       atol=1e-6, rtol=0)
        r = await api.client.post("/v1/predict", json=body(both, lambda n: n[::-1]))
        assert r.status_code == 422 and r.json()["error"]["field"] == "non_id_type_features"
        assert "order" in r.json()["error"]["message"]
        req = body(batch, lambda n: n[::-1])
        del req["id_type_features"]["item"]
        r = await api.client.post("/v1/predict", json=req)
        assert r.status_code == 422 and r.json()["error"]["field"] == "id_type_features.item"


def test_requests_in_any_order_share_one_micro_batch_signature():
    """The micro-batcher groups requests by signature, taken after arranging: key order
    alone never splits a forward pass."""
    inputs = ModelInputs(("user", "item", "tags"), (NonIdInput("dense", "float32", (3,)),
                                                   NonIdInput("ctx", "float32", (3,))), True)
    b = batch_of(0, 2)
    assert inputs.arrange(b) is b
    assert signature(inputs.arrange(reordered(b))) == signature(b)


def test_truncated_ids_are_unknown_without_an_embedding_config():
    """Without the API's embedding config the slots' sample_fixed_size is not known: the
    count is None (null in the answer), never a 0 that says every id was used."""
    assert truncated_ids(make_batch(1, batch_size=4, requires_grad=False), None) is None
