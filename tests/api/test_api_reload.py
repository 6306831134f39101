"""``POST /v1/model/reload`` under load: no request fails, the version in answers changes."""

from __future__ import annotations

import asyncio

import pytest
from api_helpers import AUTH, LiveApi, TwoHeads, settings_for, write_checkpoint

from stream_persia.testing.samples import make_batch


def body(i: int) -> dict:
    b = make_batch(i, batch_size=1 + i % 3, requires_grad=False)
    return {"id_type_features": {f.name: [x.tolist() for x in f.data]
                                 for f in b.id_type_features},
            "non_id_type_features": {f.name: f.data.tolist() for f in b.non_id_type_features}}


@pytest.mark.parametrize("source", ["local", "workers"])
async def test_reload_under_load_drops_nothing(job, tmp_path, source):
    await job.train(4)
    first = await write_checkpoint(job, str(tmp_path / "ckpt-1"), TwoHeads(seed=1), step=1)
    await job.train(4, seed=1)
    second = await write_checkpoint(job, str(tmp_path / "ckpt-2"), TwoHeads(seed=2), step=2)
    settings = settings_for(job, model_checkpoint=first, embeddings=source, batch_wait_ms=1,
                            checkpoint_dir=str(tmp_path))
    async with LiveApi(settings) as api:
        seen: list[tuple[int, str, float]] = []
        errors: list[str] = []
        stop = asyncio.Event()

        async def client(c: int) -> None:
            i = 0
            loop = asyncio.get_running_loop()
            while not stop.is_set():
                started = loop.time()
                r = await api.client.post("/v1/predict", json=body(c * 1000 + i))
                if r.status_code != 200:
                    errors.append(r.text)
                else:
                    seen.append((c, r.json()["checkpoint"], started))
                i += 1

        clients = [asyncio.create_task(client(c)) for c in range(4)]
        while len(seen) < 20:
            await asyncio.sleep(0.01)
        r = await api.client.post("/v1/model/reload", json={"checkpoint": second},
                                  headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["version"] == "ckpt-2" and r.json()["step"] == 2
        swapped_at = asyncio.get_running_loop().time()
        n_at_swap = len(seen)
        while len(seen) < n_at_swap + 20:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 30)
    assert errors == []
    versions = [v for _, v, _ in seen]
    assert versions[0] == "ckpt-1" and versions[-1] == "ckpt-2"
    # Once the swap is answered, every request sent later gets the new model (one already
    # running when it landed may still finish on the old one).
    late = [v for _, v, t in seen if t > swapped_at]
    assert late and set(late) == {"ckpt-2"}
    # Versions only move forward per client.
    for c in range(4):
        mine = [v for cc, v, _ in seen if cc == c]
        assert mine == sorted(mine)
