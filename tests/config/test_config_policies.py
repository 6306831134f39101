"""Table policies in ``embedding_config.yml`` (issue 20): the per-slot keys, their errors
naming the file, slot and key, a group's slots agreeing, ``feature_index_prefix_bit: 0``,
``EmbeddingSchema.policies()`` / ``policy_params()``, the digest, and ``admission`` in
``global_config.yml``."""

from __future__ import annotations

import textwrap

import pytest
import yaml
from test_config import PERSIA_DOCS_EMBEDDING  # tests/config is on sys.path (rootdir mode)

from stream_persia.config import (
    AdmissionConfig,
    EmbeddingSchema,
    GlobalConfig,
    load_embedding_config,
    load_global_config,
)
from stream_persia.core.embedding_config import SlotPolicy
from stream_persia.errors import BadInput, ConfigError

#: PERSIA_DOCS_EMBEDDING's digest before policies existed (checkpoints record it).
PERSIA_DOCS_DIGEST = "46c183aa9583d171db3b3a0c5b84daa56e9a5874b426997968bb28de9afefac4"

POLICIES = """\
feature_index_prefix_bit: 8
slots_config:
  user_id: {dim: 16, admit_probability: 0.5, min_count: 2, ttl_s: 86400, max_rows: 1000000, dtype: float16}
  item_id: {dim: 8}
  cat: {dim: 8, ttl_steps: 1000}
  brand: {dim: 8, ttl_steps: 1000}
feature_groups:
  goods: [cat, brand]
"""


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_the_issues_example_loads_and_indexes_policies_as_set_policies_wants(tmp_path):
    schema = load_embedding_config(write(tmp_path, "embedding_config.yml", POLICIES))
    assert schema.group_names == ("goods", "user_id", "item_id")
    user = SlotPolicy(admit_probability=0.5, min_count=2, ttl_s=86400.0, max_rows=1_000_000,
                      dtype="float16")
    goods = SlotPolicy(ttl_steps=1000)
    assert schema.slot("user_id").policy == user
    assert schema.slot("item_id").policy.is_default
    # entry g + 1 is group g's (the id prefix is g + 1); 0 and default groups are None
    assert schema.policies() == [None, goods, user, None]
    params = schema.policy_params()
    assert params == {"prefix_bits": 8,
                      "policies": [None, goods.to_dict(), user.to_dict(), None],
                      "names": [None, "goods", "user_id", "item_id"]}
    assert yaml.safe_load(yaml.safe_dump(params)) == params   # plain data for the wire
    again = EmbeddingSchema.from_dict(schema.to_dict())
    assert again == schema and again.digest() == schema.digest()


def test_persias_files_load_unchanged_with_the_same_digest_and_no_policies(tmp_path):
    schema = load_embedding_config(write(tmp_path, "e.yml", PERSIA_DOCS_EMBEDDING))
    assert schema.digest() == PERSIA_DOCS_DIGEST
    assert all(p is None for p in schema.policies())
    assert len(schema.policies()) == len(schema.group_names) + 1
    assert schema.policy_params() is None
    for slot in schema.slots.values():
        assert not set(slot.to_dict()) & set(SlotPolicy().to_dict())


def test_the_checkpoint_digest_leaves_policies_out_and_to_dict_keeps_them():
    """A job that changes a policy still restores its checkpoints (the rows mean the same);
    the servers' configuration digest covers policies (tests/server)."""
    plain = EmbeddingSchema.from_dict({"slots_config": {"u": {"dim": 4}}})
    spelled = EmbeddingSchema.from_dict(
        {"slots_config": {"u": {"dim": 4, "min_count": 1, "dtype": "float32", "ttl_s": None}}})
    assert spelled.digest() == plain.digest() and spelled == plain
    for key, value in [("min_count", 2), ("ttl_s", 60), ("ttl_steps", 5), ("max_rows", 9),
                       ("dtype", "bfloat16"), ("admit_probability", 0.25)]:
        other = EmbeddingSchema.from_dict({"slots_config": {"u": {"dim": 4, key: value}}})
        assert other.digest() == plain.digest(), key
        assert other != plain and other.to_dict()["slots_config"]["u"][key] == value
    wider = EmbeddingSchema.from_dict({"slots_config": {"u": {"dim": 8, "min_count": 2}}})
    assert wider.digest() != plain.digest()


@pytest.mark.parametrize("entry, key, words", [
    ("{dim: 4, min_count: 0}", "min_count", "[1, "),
    ("{dim: 4, min_count: '2'}", "min_count", "an int in [1, 255]"),
    ("{dim: 4, min_count: true}", "min_count", "an int in [1, 255]"),
    ("{dim: 4, ttl_s: -5}", "ttl_s", "> 0"),
    ("{dim: 4, ttl_s: .inf}", "ttl_s", "finite"),
    ("{dim: 4, ttl_steps: 0}", "ttl_steps", "[1, "),
    ("{dim: 4, max_rows: 0}", "max_rows", "[1, "),
    ("{dim: 4, max_rows: 2000000000}", "max_rows", "1073741824"),
    ("{dim: 4, dtype: int8}", "dtype", "float16"),
    ("{dim: 4, admit_probability: 1.5}", "admit_probability", "[0, 1]"),
    ("{dim: 4, min_cnt: 2}", "min_cnt", "min_count"),
])
def test_a_bad_policy_key_names_the_file_slot_and_key(tmp_path, entry, key, words):
    path = write(tmp_path, "emb.yml", f"slots_config:\n  user_id: {entry}\n")
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    assert info.value.field == f"slots_config.user_id.{key}"
    assert "emb.yml" in str(info.value) and words in str(info.value)


def test_slots_of_one_group_must_agree_naming_the_slot_and_key(tmp_path):
    path = write(tmp_path, "emb.yml", """\
        slots_config:
          cat: {dim: 8, ttl_steps: 1000}
          brand: {dim: 8, ttl_steps: 10}
        feature_groups:
          goods: [cat, brand]
        """)
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    assert info.value.field == "slots_config.brand.ttl_steps"
    assert "'cat'" in str(info.value) and "'goods'" in str(info.value)
    assert "emb.yml" in str(info.value)


def test_a_policy_without_id_prefixes_is_an_error_naming_the_key(tmp_path):
    path = write(tmp_path, "emb.yml", """\
        feature_index_prefix_bit: 0
        slots_config:
          user_id: {dim: 8}
          item_id: {dim: 8, max_rows: 100}
        """)
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    assert info.value.field == "slots_config.item_id.max_rows"
    assert "feature_index_prefix_bit" in str(info.value)
    schema = EmbeddingSchema.from_dict({"feature_index_prefix_bit": 0,
                                        "slots_config": {"u": {"dim": 8}}})
    assert schema.policies() == [] and schema.policy_params() is None


def test_slot_policy_validates_and_round_trips():
    p = SlotPolicy(min_count=3, ttl_s=10, dtype="bfloat16")
    assert p.ttl_s == 10.0 and not p.is_default and SlotPolicy().is_default
    assert SlotPolicy.from_dict(p.to_dict()) == p
    with pytest.raises(BadInput) as info:
        SlotPolicy.from_dict({"ttl_steps": -1}, "policies[2]")
    assert info.value.field == "policies[2].ttl_steps"
    with pytest.raises(BadInput) as info:
        SlotPolicy.from_dict({"colour": 1}, "x")
    assert info.value.field == "x.colour"


def test_admission_sketch_bytes_in_global_config(tmp_path):
    assert GlobalConfig().admission == AdmissionConfig(sketch_bytes=8 << 20)
    gc = load_global_config(write(tmp_path, "g.yml", "admission: {sketch_bytes: 1048576}\n"))
    assert gc.admission.sketch_bytes == 1 << 20
    assert GlobalConfig.from_dict(gc.to_dict()) == gc
    for bad in ("0", "'8MiB'", str(1 << 40)):
        with pytest.raises(ConfigError) as info:
            load_global_config(write(tmp_path, "g.yml", f"admission: {{sketch_bytes: {bad}}}\n"))
        assert info.value.field == "admission.sketch_bytes" and "g.yml" in str(info.value)


def test_admission_sketch_bytes_must_cover_every_store_thread(tmp_path):
    """Each internal shard of a store has a sketch of at least 4096 bytes within the
    server's sketch_bytes: a config where they cannot fit is refused, naming the key."""
    ok = ("embedding_parameter_server_config: {store_threads: 4}\n"
          "admission: {sketch_bytes: 16384}\n")
    assert load_global_config(write(tmp_path, "g.yml", ok)).admission.sketch_bytes == 16384
    with pytest.raises(ConfigError) as info:
        load_global_config(write(tmp_path, "g.yml", ok.replace("16384", "16383")))
    assert info.value.field == "admission.sketch_bytes" and "store_threads" in str(info.value)
