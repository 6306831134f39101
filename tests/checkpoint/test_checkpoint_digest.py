"""The manifest's ``config_digest`` (``checkpoint.digest``): one digest of the job's embedding
schema, written by every writer and checked by every restore. Restores through real roles
are in tests/nn/test_nn_checkpoint.py and tests/api/test_api_checkpoints.py."""

from __future__ import annotations

import copy
import logging

import pytest

from stream_persia.checkpoint import CheckpointWriter, Manifest, check_config, config_digest
from stream_persia.checkpoint.digest import schema_differences
from stream_persia.config import EmbeddingSchema
from stream_persia.errors import Misuse
from stream_persia.testing.samples import SCHEMA, SCHEMA_DICT


def changed(**slots) -> EmbeddingSchema:
    d = copy.deepcopy(SCHEMA_DICT)
    for name, settings in slots.items():
        if settings is None:
            del d["slots_config"][name]
        else:
            d["slots_config"].setdefault(name, {}).update(settings)
    return EmbeddingSchema.from_dict(d)


def manifest_of(schema: EmbeddingSchema | None, tmp_path) -> Manifest:
    with CheckpointWriter(str(tmp_path / "ck")) as w:
        return w.commit(job="j", step=1, offsets={}, stream="direct", schema=schema)


def test_the_digest_is_the_embedding_schemas():
    assert config_digest(SCHEMA) == "schema-v1:" + SCHEMA.digest()
    assert config_digest(None) is None
    assert config_digest(EmbeddingSchema.from_dict(copy.deepcopy(SCHEMA_DICT))) == \
        config_digest(SCHEMA)
    assert config_digest(changed(user={"dim": 16})) != config_digest(SCHEMA)


def test_the_same_schema_restores(tmp_path):
    m = manifest_of(SCHEMA, tmp_path)
    assert m.config_digest == config_digest(SCHEMA)
    assert m.extra["embedding_schema"] == SCHEMA.to_dict()
    check_config(m, EmbeddingSchema.from_dict(copy.deepcopy(SCHEMA_DICT)))


def test_another_schema_is_refused_naming_what_differs(tmp_path):
    m = manifest_of(SCHEMA, tmp_path)
    with pytest.raises(Misuse, match=r"slot 'user' has dim 8 in the checkpoint, 16 here") \
            as err:
        check_config(m, changed(user={"dim": 16}), "checkpoint 'c1'")
    msg = err.value.message
    assert msg.startswith("checkpoint 'c1' was trained with another embedding config")
    assert config_digest(SCHEMA) in msg and config_digest(changed(user={"dim": 16})) in msg
    assert err.value.field == "config_digest" and "embedding_schema" in err.value.hint
    with pytest.raises(Misuse, match="slot 'tags' is in the checkpoint but not in this job"):
        check_config(m, changed(tags=None))
    with pytest.raises(Misuse, match="slot 'age' is in this job's config but not in the "):
        check_config(m, changed(age={"dim": 2}))


def test_a_refusal_without_the_recorded_schema_still_names_the_digests(tmp_path):
    m = manifest_of(SCHEMA, tmp_path)
    m.extra.pop("embedding_schema")
    with pytest.raises(Misuse, match=r"another embedding config than this job's \(config "
                                     r"digest schema-v1:"):
        check_config(m, changed(user={"dim": 16}))


def test_old_checkpoints_restore_unchecked_and_say_so(tmp_path, caplog):
    m = manifest_of(None, tmp_path)
    assert m.config_digest is None and "embedding_schema" not in m.extra
    with caplog.at_level(logging.INFO, logger="stream_persia.checkpoint.digest"):
        check_config(m, SCHEMA)
        # A digest of an older form (a sha256 of other inputs) cannot be compared.
        m.config_digest = "ab" * 32
        check_config(m, SCHEMA)
    assert "no config digest" in caplog.text and "older form" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stream_persia.checkpoint.digest"):
        check_config(manifest_of(SCHEMA, tmp_path), None)   # this job's schema unknown
    assert "unchecked" in caplog.text


def test_schema_differences_in_words():
    base = SCHEMA.to_dict()
    assert schema_differences(base, base) == []
    other = copy.deepcopy(base)
    other["feature_index_prefix_bit"] = 12
    other["slots_config"]["item"]["sqrt_scaling"] = False
    other["slots_config"]["tags"]["hash_stack_config"] = {"hash_stack_rounds": 2,
                                                          "embedding_size": 100}
    assert schema_differences(base, other) == [
        "feature_index_prefix_bit is 8 in the checkpoint, 12 here",
        "slot 'item' has sqrt_scaling True in the checkpoint, False here",
        "slot 'tags' has hash_stack_config {'hash_stack_rounds': 0, 'embedding_size': 0} in "
        "the checkpoint, {'hash_stack_rounds': 2, 'embedding_size': 100} here"]
    swapped = copy.deepcopy(base)
    swapped["slots_config"] = dict(reversed(list(base["slots_config"].items())))
    assert schema_differences(base, swapped) == [
        "slots_config lists the slots in another order (it decides the id prefixes)"]
    grouped = copy.deepcopy(base)
    grouped["feature_groups"] = {"ui": ["user", "item"]}
    assert schema_differences(base, grouped) == [
        "feature_groups are {} in the checkpoint, {'ui': ['user', 'item']} here"]
