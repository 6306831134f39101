"""Served predictions equal offline evaluation (``eval_ctx``) of the same checkpoint.

The checkpoint is written by a job with 2 embedding servers and restored by ``eval_ctx``
into another job with 3; the API serves it both ways (embeddings from the workers of the
restored job, and loaded into the API process), and both agree with the evaluation on
every sample within 1e-6, in JSON and in msgpack.
"""

from __future__ import annotations

import asyncio

import numpy as np
from api_helpers import LiveApi, TwoHeads, settings_for, start_job, stop_job, write_checkpoint

from stream_persia.ctx import eval_ctx
from stream_persia.embedding.data import PersiaBatch
from stream_persia.testing.samples import make_batch


def eval_batches() -> list[PersiaBatch]:
    out = []
    for i, size in enumerate((1, 5, 64)):
        b = make_batch(200 + i, batch_size=size, vocab=70)   # some ids never trained
        out.append(PersiaBatch(b.id_type_features, b.non_id_type_features, b.labels,
                               requires_grad=False))
    return out


def offline(worker: str, ckpt: str, batches: list[PersiaBatch]) -> list[dict]:
    model = TwoHeads(seed=12345)     # other weights until the checkpoint is loaded
    with eval_ctx(model=model.eval(), embedding_workers=[worker], ready_timeout_s=30) as ctx:
        ctx.load_checkpoint(ckpt)
        results = []
        for b in batches:
            out, _ = ctx.forward(ctx.get_embedding_from_data(b))
            results.append({k: v.detach().numpy() for k, v in out.items()})
        return results


async def test_served_predictions_equal_eval_ctx(job, tmp_path):
    await job.train(8)
    ckpt = await write_checkpoint(job, str(tmp_path / "ckpt-eval"), TwoHeads(seed=3).eval())
    restored = await start_job(n_servers=3)
    try:
        batches = eval_batches()
        want = await asyncio.to_thread(offline, restored.worker_addresses[0], ckpt, batches)
        for source, roles in (("workers", restored), ("local", None)):
            settings = settings_for(roles, model_checkpoint=ckpt, embeddings=source)
            async with LiveApi(settings) as api:
                for b, w in zip(batches, want, strict=True):
                    body = {"id_type_features": {f.name: [x.tolist() for x in f.data]
                                                 for f in b.id_type_features},
                            "non_id_type_features": {f.name: f.data.tolist()
                                                     for f in b.non_id_type_features}}
                    r = await api.client.post("/v1/predict", json=body)
                    assert r.status_code == 200, r.text
                    preds = r.json()["predictions"]
                    np.testing.assert_allclose([p["click"] for p in preds], w["click"],
                                               atol=1e-6, rtol=0, err_msg=source)
                    np.testing.assert_allclose([p["buy"] for p in preds], w["buy"],
                                               atol=1e-6, rtol=0, err_msg=source)
                    r = await api.client.post("/v1/predict", content=b.to_bytes(),
                                              headers={"content-type": "application/msgpack"})
                    assert r.status_code == 200, r.text
                    np.testing.assert_allclose([p["click"] for p in r.json()["predictions"]],
                                               w["click"], atol=1e-6, rtol=0)
    finally:
        await stop_job(restored)
