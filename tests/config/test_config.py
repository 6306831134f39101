"""Config loaders (stream_persia.config): PERSIA's keys and defaults, id prefixes, errors
that name file + key + fix, environment variables, round trips."""

from __future__ import annotations

import dataclasses
import textwrap

import numpy as np
import pytest

from stream_persia import config as cfgmod
from stream_persia.config import (
    ApiConfig,
    EmbeddingParameterServerConfig,
    EmbeddingSchema,
    EmbeddingWorkerConfig,
    GlobalConfig,
    HashStackConfig,
    KafkaConfig,
    SlotConfig,
    load_embedding_config,
    load_global_config,
    resolve_bootstrap_servers,
)
from stream_persia.errors import BadInput, ConfigError, Misuse

U64 = np.uint64


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------- defaults (PERSIA's)

def test_embedding_defaults_match_persia():
    schema = EmbeddingSchema.from_dict({"slots_config": {"user_id": {"dim": 16}}})
    assert schema.feature_index_prefix_bit == 8
    slot = schema.slot("user_id")
    assert (slot.name, slot.dim, slot.sample_fixed_size, slot.embedding_summation,
            slot.sqrt_scaling) == ("user_id", 16, 10, True, False)
    assert slot.hash_stack_config == HashStackConfig(hash_stack_rounds=0, embedding_size=0)
    assert slot.index_prefix == 1 << 56
    assert schema.feature_groups == {}


def test_global_defaults_match_persia():
    g = GlobalConfig.from_dict({})
    assert g == GlobalConfig()
    c = g.common_config
    assert c.job_type == "Train" and g.job_type == "Train"
    assert (c.metrics_config.enable_metrics, c.metrics_config.push_interval_sec) == (False, 10)
    assert c.checkpointing_config.num_workers == 4
    assert c.infer_config.servers == () and c.infer_config.embedding_checkpoint is None
    ps = g.embedding_parameter_server_config
    assert ps == EmbeddingParameterServerConfig(
        capacity=1_000_000_000, num_hashmap_internal_shards=100,
        full_amount_manager_buffer_size=1000, enable_incremental_update=False,
        incremental_buffer_size=1_000_000, incremental_dir=None,
        incremental_channel_capacity=1000, restore_stage_ttl_s=600, store_threads=1)
    w = g.embedding_worker_config
    assert (w.ready_buffer_batches, w.max_inflight_lookups) == (16, 16)
    assert w.rpc_timeout_ms == 10_000
    k = g.kafka
    assert k.bootstrap_servers is None and k.embedded
    assert (k.job_name, k.samples_topic, k.dlq_topic) == (
        "persia", "persia.samples", "persia.samples.dlq")
    assert (k.compression_type, k.security_protocol, k.fetch_max_wait_ms) == (
        "none", "PLAINTEXT", 50)
    assert (g.api.host, g.api.port, g.api.token, g.api.token_file) == (
        "127.0.0.1", 8080, None, None)


def test_configs_are_frozen():
    g = GlobalConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.api = ApiConfig()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.kafka.job_name = "x"  # type: ignore[misc]


# ---------------------------------------------------------------- id prefixes

def _schema_with_group_index_99(bits: int = 12) -> EmbeddingSchema:
    # 100 ungrouped slots: the last one has group index 99, so group_index + 1 = 100.
    return EmbeddingSchema.from_dict({"feature_index_prefix_bit": bits,
                                      "slots_config": {f"s{i}": {"dim": 4} for i in range(100)}})


def test_prefix_vector_from_the_issue():
    schema = _schema_with_group_index_99()
    assert schema.group_index("s99") == 99
    assert schema.slot("s99").index_prefix == 100 << 52 == 450359962737049600
    out = schema.prefix_ids("s99", np.array([12, 16000000000000000], dtype=U64))
    assert out.dtype == U64
    assert out.tolist() == [450359962737049612, 452849163854938115]


def test_prefix_formula_at_the_top_of_the_range_does_not_overflow():
    schema = _schema_with_group_index_99()
    ids = np.array([0, 2**52 - 2, 2**52 - 1, 2**64 - 1], dtype=U64)
    expected = [(int(i) % (2**52 - 1)) + (100 << 52) for i in ids]
    with np.errstate(all="raise"):
        assert schema.prefix_ids("s99", ids).tolist() == expected
    # the largest group a prefix bit count allows: 2**b - 1 groups
    top = EmbeddingSchema.from_dict({"feature_index_prefix_bit": 2, "slots_config": {
        "a": {"dim": 1}, "b": {"dim": 1}, "c": {"dim": 1}}})
    assert top.slot("c").index_prefix == 3 << 62
    assert top.prefix_ids("c", np.array([2**64 - 1], U64)).tolist() == [
        (2**64 - 1) % (2**62 - 1) + (3 << 62)]


def test_prefix_leaves_input_alone_and_accepts_read_only_and_signed():
    schema = _schema_with_group_index_99()
    ids = np.array([12, 13], dtype=U64)
    ids.setflags(write=False)
    out = schema.prefix_ids("s99", ids)
    assert ids.tolist() == [12, 13] and out is not ids
    assert schema.prefix_ids("s99", np.array([12], np.int64)).tolist() == [450359962737049612]
    with pytest.raises(BadInput, match="non-negative"):
        schema.prefix_ids("s99", np.array([-1], np.int64))
    with pytest.raises(BadInput, match="uint64"):
        schema.prefix_ids("s99", np.array([1.5]))


def test_prefix_bit_zero_returns_ids_unchanged():
    schema = EmbeddingSchema.from_dict({"feature_index_prefix_bit": 0,
                                        "slots_config": {f"s{i}": {"dim": 2} for i in range(300)}})
    ids = np.array([1, 2**64 - 1], dtype=U64)
    assert schema.prefix_ids("s299", ids) is ids
    assert all(s.index_prefix == 0 for s in schema.slots.values())


def test_group_indices_follow_persia_declared_groups_first():
    schema = EmbeddingSchema.from_dict({
        "feature_index_prefix_bit": 8,
        "slots_config": {"a": {"dim": 4}, "b": {"dim": 4}, "c": {"dim": 4}, "d": {"dim": 4}},
        "feature_groups": {"g1": ["d", "b"]},
    })
    # PERSIA: declared groups in file order, then ungrouped slots in slots_config order.
    assert schema.group_names == ("g1", "a", "c")
    assert [schema.group_index(s) for s in "abcd"] == [1, 0, 2, 0]
    assert schema.group_of("b") == "g1" and schema.group_of("a") == "a"
    same = np.array([42], U64)
    assert schema.prefix_ids("b", same).tolist() == schema.prefix_ids("d", same).tolist()
    assert schema.prefix_ids("a", same).tolist() != schema.prefix_ids("c", same).tolist()
    assert schema.slot("b").index_prefix == 1 << 56


def test_replace_recomputes_prefixes():
    schema = _schema_with_group_index_99(bits=12)
    wider = dataclasses.replace(schema, feature_index_prefix_bit=16)
    assert wider.slot("s99").index_prefix == 100 << 48


def test_unknown_slot_is_bad_input_naming_it():
    schema = EmbeddingSchema.from_dict({"slots_config": {"user_id": {"dim": 4}}})
    with pytest.raises(BadInput, match="unknown slot 'user_ids'.*did you mean 'user_id'"):
        schema.prefix_ids("user_ids", np.array([1], U64))


# ---------------------------------------------------------------- errors: file + key + fix

EMB_ERRORS = [
    # (mapping, key path in the message, words of the message or the fix)
    ({"slots_config": {"user_id": {"dim": "8"}}}, "slots_config.user_id.dim", "without quotes"),
    ({"slots_config": {"user_id": {"dim": True}}}, "slots_config.user_id.dim", "True (bool)"),
    ({"slots_config": {"user_id": {"dim": 0}}}, "slots_config.user_id.dim", "[1, 65536]"),
    ({"slots_config": {"user_id": {"dim": 8.0}}}, "slots_config.user_id.dim", "integer"),
    ({"slots_config": {"user_id": {}}}, "slots_config.user_id.dim", "required"),
    ({"slots_config": {"user_id": {"dim": 8, "sqrt_scaling": "yes"}}},
     "slots_config.user_id.sqrt_scaling", "true or false"),
    ({"slots_config": {"user_id": {"dim": 8, "dimm": 3}}}, "slots_config.user_id.dimm",
     "did you mean 'dim'"),
    ({"slots_config": {"user_id": {"dim": 8, "capacity": 100}}},
     "slots_config.user_id.capacity", "embedding_parameter_server_config.capacity"),
    ({"slots_config": {"user_id": {"dim": 8, "index_prefix": 5}}},
     "slots_config.user_id.index_prefix", "computed"),
    ({"slots_config": {"a": {"dim": 8, "hash_stack_config": {"hash_stack_rounds": 2}}}},
     "slots_config.a.hash_stack_config.embedding_size", "hash_stack_rounds to 0"),
    ({"slots_config": {"a": {"dim": 8, "hash_stack_config": {"embedding_size": 10}}}},
     "slots_config.a.hash_stack_config.hash_stack_rounds", "no effect"),
    ({"slots_config": {"a": {"dim": 8}}, "feature_groups": {"g": ["b"]}},
     "feature_groups.g", "not in slots_config"),
    ({"slots_config": {"a": {"dim": 8}, "b": {"dim": 8}},
      "feature_groups": {"g1": ["a"], "g2": ["a", "b"]}}, "feature_groups.g2",
     "already in group 'g1'"),
    ({"slots_config": {"a": {"dim": 8}}, "feature_groups": {"g": ["a", "a"]}},
     "feature_groups.g", "already in this group"),
    ({"slots_config": {"a": {"dim": 8}}, "feature_groups": {"g": []}}, "feature_groups.g",
     "at least one slot"),
    ({"slots_config": {"a": {"dim": 8}}, "feature_groups": {"g": "a"}}, "feature_groups.g",
     "[a]"),
    ({"slots_config": {"a": {"dim": 8}, "b": {"dim": 8}}, "feature_groups": {"a": ["b"]}},
     "feature_groups.a", "rename the group"),
    ({"feature_index_prefix_bit": 1, "slots_config": {"a": {"dim": 8}, "b": {"dim": 8}}},
     "feature_index_prefix_bit", "at least 2"),
    ({"feature_index_prefix_bit": 33, "slots_config": {"a": {"dim": 8}}},
     "feature_index_prefix_bit", "[0, 32]"),
    ({"feature_index_prefix_bit": True, "slots_config": {"a": {"dim": 8}}},
     "feature_index_prefix_bit", "integer"),
    ({"feature_groups": {}}, "slots_config", "required"),
    ({"slots_config": {"a": {"dim": 8}}, "slot_config": {}}, "slot_config",
     "keep only slots_config"),
    ({"slots_config": {"a": {"dim": 8}}, "feature_group": {}}, "feature_group",
     "did you mean 'feature_groups'"),
    ({"slots_config": [{"dim": 8}]}, "slots_config", "mapping"),
    ({"slots_config": {1: {"dim": 8}}}, "slots_config.1", "strings"),
]


@pytest.mark.parametrize("raw,key,words", EMB_ERRORS)
def test_embedding_config_errors_name_file_key_and_fix(tmp_path, raw, key, words):
    import yaml

    path = tmp_path / "embedding_config.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    text = str(info.value)
    assert text.startswith(f"{path}: {key}:"), text
    assert info.value.field == key
    assert words in text, text


GLOBAL_ERRORS = [
    ({"common_config": {"job_type": "Predict"}}, "common_config.job_type", "Train, Eval, Infer"),
    ({"common_config": {"job_typ": "Train"}}, "common_config.job_typ", "did you mean 'job_type'"),
    ({"common_config": {"intent": "Train"}}, "common_config.intent", "job_type"),
    ({"common_config": {"metrics_config": {"push_interval_sec": "1e9"}}},
     "common_config.metrics_config.push_interval_sec", "1000000000"),
    ({"common_config": {"infer_config": {"servers": ["no-port"]}}},
     "common_config.infer_config.servers[0]", "host:port"),
    ({"common_config": {"checkpointing_config": {"num_workers": 0}}},
     "common_config.checkpointing_config.num_workers", "[1, 1024], got 0"),
    ({"common_config": {"checkpointing_config": {"every_steps": 0}}},
     "common_config.checkpointing_config.every_steps", "got 0"),
    ({"common_config": {"checkpointing_config": {"every_steps": "100"}}},
     "common_config.checkpointing_config.every_steps", "without quotes"),
    ({"common_config": {"checkpointing_config": {"every_s": 0}}},
     "common_config.checkpointing_config.every_s", "seconds in (0,"),
    ({"common_config": {"checkpointing_config": {"every_s": float("nan")}}},
     "common_config.checkpointing_config.every_s", "seconds in (0,"),
    ({"common_config": {"checkpointing_config": {"periodic_dir": "/ckpt"}}},
     "common_config.checkpointing_config.periodic_dir", "neither every_steps nor every_s"),
    ({"common_config": {"checkpointing_config": {"every_s": 60, "periodic_dir": ""}}},
     "common_config.checkpointing_config.periodic_dir", "must not be empty"),
    ({"common_config": {"checkpointing_config": {"every_step": 10}}},
     "common_config.checkpointing_config.every_step", "did you mean 'every_steps'"),
    ({"common_config": {"num_embedding_io_workers": 2, "checkpointing_config":
                        {"num_workers": 8}}},
     "common_config.num_embedding_io_workers", "keep only"),
    ({"embedding_parameter_server_config": {"capacity": 0}},
     "embedding_parameter_server_config.capacity", "1000000000"),
    ({"embedding_parameter_server_config": {"capacity": 1.5e9}},
     "embedding_parameter_server_config.capacity", "integer"),
    # The store holds at most 2**30 rows: refused here, naming the key, not by the server.
    ({"embedding_parameter_server_config": {"capacity": (1 << 30) + 1}},
     "embedding_parameter_server_config.capacity", "[1, 1073741824], got 1073741825"),
    ({"embedding_parameter_server_config": {"capacity": 1 << 48}},
     "embedding_parameter_server_config.capacity", "the store's limit"),
    # PERSIA features stream-persia does not have: refused by value, not ignored.
    ({"common_config": {"job_type": "Infer"}}, "common_config.job_type", "launch api"),
    ({"common_config": {"job_type": "eval"}}, "common_config.job_type", "Eval is not"),
    ({"common_config": {"metrics_config": {"enable_metrics": True}}},
     "common_config.metrics_config.enable_metrics", "--metrics-port"),
    ({"common_config": {"infer_config": {"embedding_checkpoint": "/ckpt"}}},
     "common_config.infer_config.embedding_checkpoint", "--model"),
    ({"embedding_worker_config": {"buffered_data_expired_sec": 1000}},
     "embedding_worker_config.buffered_data_expired_sec", "exactly-once"),
    ({"embedding_worker_config": {"forward_buffer_size": 8, "ready_buffer_batches": 8}},
     "embedding_worker_config.ready_buffer_batches", "given twice"),
    ({"embedding_worker_config": {"forward_buffer_size": 0}},
     "embedding_worker_config.ready_buffer_batches", "forward_buffer_size"),
    ({"embedding_worker_config": {"max_inflight_lookups": 0}},
     "embedding_worker_config.max_inflight_lookups", "got 0"),
    ({"embedding_parameter_server_config": {"restore_stage_ttl_s": 0}},
     "embedding_parameter_server_config.restore_stage_ttl_s", "staged restore"),
    ({"embedding_parameter_server_config": {"store_threads": 0}},
     "embedding_parameter_server_config.store_threads", "one per core"),
    ({"embedding_parameter_server_config": {"store_threads": 257}},
     "embedding_parameter_server_config.store_threads", "256"),
    ({"embedding_parameter_server_config": {"store_threads": 8, "capacity": 4}},
     "embedding_parameter_server_config.store_threads", "raise capacity"),
    ({"common_config": {"checkpointing_config": {"full_every": 0}}},
     "common_config.checkpointing_config.full_every", "full base"),
    ({"common_config": {"checkpointing_config": {"compact_after": 0}}},
     "common_config.checkpointing_config.compact_after", "compact a periodic chain"),
    ({"embedding_parameter_server_config": {"num_embedding_io_workers": 4}},
     "embedding_parameter_server_config.num_embedding_io_workers",
     "checkpointing_config.num_workers"),
    ({"embedding_worker_config": {"rpc_timeout_ms": -1}},
     "embedding_worker_config.rpc_timeout_ms", "got -1"),
    ({"middleware_config": {}}, "middleware_config", "embedding_worker_config"),
    ({"kafak": {}}, "kafak", "did you mean 'kafka'"),
    ({"kafka": {"group_id": "g"}}, "kafka.group_id", "statically"),
    ({"kafka": {"consumer_group": "g"}}, "kafka.consumer_group", "p mod W"),
    ({"kafka": {"enable_auto_commit": True}}, "kafka.enable_auto_commit", "checkpoint"),
    ({"kafka": {"bootstrap_servers": "localhost"}}, "kafka.bootstrap_servers", "host:port"),
    ({"kafka": {"bootstrap_servers": "a:9092,b:99999"}}, "kafka.bootstrap_servers",
     "localhost:9092"),
    ({"kafka": {"job_name": "my job"}}, "kafka.job_name", "a-z"),
    ({"kafka": {"samples_topic": "ads.samples\n"}}, "kafka.samples_topic",
     "not a valid Kafka topic"),
    ({"kafka": {"dlq_topic": ".."}}, "kafka.dlq_topic", "a-z"),
    ({"kafka": {"samples_topic": "t", "dlq_topic": "t"}}, "kafka.dlq_topic", "own topic"),
    ({"kafka": {"compression_type": "brotli"}}, "kafka.compression_type", "gzip"),
    ({"kafka": {"security_protocol": "SASL_SSL"}}, "kafka.sasl_username", "PLAIN"),
    ({"kafka": {"security_protocol": "SASL_SSL", "sasl_username": "u"}},
     "kafka.sasl_password", "sasl_password_file"),
    ({"kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"}},
     "kafka.sasl_mechanism", "SCRAM-SHA-512"),
    ({"kafka": {"ssl_cafile": "/ca.pem"}}, "kafka.ssl_cafile", "SSL"),
    ({"kafka": {"sasl_username": "u"}}, "kafka.sasl_username", "SASL_SSL"),
    ({"kafka": {"security_protocol": "SSL", "ssl_certfile": "/c.pem"}}, "kafka.ssl_keyfile",
     "both"),
    ({"kafka": {"num_partitions": 0}}, "kafka.num_partitions", "got 0"),
    ({"api": {"port": 70000}}, "api.port", "[0, 65535]"),
    ({"api": {"token": "t", "token_file": "/f"}}, "api.token_file", "keep one"),
    ({"api": {"host": ""}}, "api.host", "empty"),
    ({"api": []}, "api", "mapping"),
]


@pytest.mark.parametrize("raw,key,words", GLOBAL_ERRORS)
def test_global_config_errors_name_file_key_and_fix(tmp_path, raw, key, words):
    import yaml

    path = tmp_path / "global_config.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_global_config(path)
    text = str(info.value)
    assert text.startswith(f"{path}: {key}:"), text
    assert info.value.field == key
    assert words in text, text


def test_unknown_key_lists_accepted_keys():
    with pytest.raises(ConfigError) as info:
        GlobalConfig.from_dict({"embedding_worker_config": {"forward_bufer_size": 1}},
                               source="g.yml")
    assert "did you mean 'forward_buffer_size'" in info.value.hint
    for key in ("max_inflight_lookups", "ready_buffer_batches", "rpc_timeout_ms"):
        assert key in info.value.hint


def test_every_compression_codec_is_installed():
    """cramjam is a dependency: lz4, snappy and zstd need nothing installed by hand."""
    for codec in ("lz4", "snappy", "zstd", "gzip"):
        assert KafkaConfig(compression_type=codec).compression_type == codec
    assert KafkaConfig(compression_type="GZIP").compression_type == "gzip"


def test_programmatic_construction_is_validated_too():
    with pytest.raises(ConfigError) as info:
        SlotConfig(name="a", dim="8")
    assert info.value.field == "dim"
    with pytest.raises(ConfigError, match="rpc_timeout_ms"):
        EmbeddingWorkerConfig(rpc_timeout_ms=0)
    # a mapping for a section is built like a file's
    g = GlobalConfig(kafka={"job_name": "ads"})
    assert g.kafka.samples_topic == "ads.samples"
    with pytest.raises(ConfigError) as info:
        GlobalConfig(kafka={"job_name": "ads", "group_id": "x"})
    assert info.value.field == "kafka.group_id"


# ---------------------------------------------------------------- files and env vars

def test_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.yml"
    with pytest.raises(ConfigError, match=f"{missing}: embedding_config file does not exist"):
        load_embedding_config(missing)
    with pytest.raises(ConfigError, match="is a directory"):
        load_global_config(tmp_path)
    bad = write(tmp_path, "bad.yml", "common_config:\n  job_type: [Train\n")
    with pytest.raises(ConfigError, match=rf"{bad}: not valid YAML at line \d+"):
        load_global_config(bad)
    empty = write(tmp_path, "empty.yml", "")
    with pytest.raises(ConfigError, match=f"{empty}: global_config file is empty"):
        load_global_config(empty)
    listy = write(tmp_path, "list.yml", "- a\n- b\n")
    with pytest.raises(ConfigError, match=f"{listy}: expected a YAML mapping"):
        load_embedding_config(listy)


def test_duplicate_yaml_keys_are_refused(tmp_path):
    # PyYAML would silently keep the second user_id; a demanding loader says so.
    path = write(tmp_path, "emb.yml", """\
        slots_config:
          user_id: {dim: 8}
          user_id: {dim: 16}
        """)
    with pytest.raises(ConfigError, match="duplicate key 'user_id'"):
        load_embedding_config(path)
    # overriding a key merged in from an anchor is not a duplicate
    path = write(tmp_path, "anchors.yml", """\
        slots_config:
          user_id: &common {dim: 8, sqrt_scaling: true}
          item_id:
            <<: *common
            dim: 16
        """)
    schema = load_embedding_config(path)
    assert (schema.slot("item_id").dim, schema.slot("item_id").sqrt_scaling) == (16, True)


def test_env_vars_give_the_paths(tmp_path, monkeypatch):
    emb = write(tmp_path, "emb.yml", "slots_config: {a: {dim: 3}}\n")
    glob = write(tmp_path, "glob.yml", "embedding_parameter_server_config: {capacity: 77}\n")
    monkeypatch.setenv("PERSIA_EMBEDDING_CONFIG", str(emb))
    monkeypatch.setenv("PERSIA_GLOBAL_CONFIG", str(glob))
    assert load_embedding_config().slot("a").dim == 3
    assert load_global_config().embedding_parameter_server_config.capacity == 77
    # an explicit path wins over the environment
    other = write(tmp_path, "other.yml", "slots_config: {b: {dim: 5}}\n")
    assert list(load_embedding_config(other).slots) == ["b"]


@pytest.mark.parametrize("loader,var", [(load_embedding_config, "PERSIA_EMBEDDING_CONFIG"),
                                        (load_global_config, "PERSIA_GLOBAL_CONFIG")])
def test_no_path_and_no_env_var_names_the_env_var(monkeypatch, loader, var):
    monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=var):
        loader()
    monkeypatch.setenv(var, "/does/not/exist.yml")
    with pytest.raises(ConfigError, match=f"/does/not/exist.yml.*{var}"):
        loader()


def test_bootstrap_servers_precedence_cli_then_env_then_file(monkeypatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    g = GlobalConfig.from_dict({"kafka": {"bootstrap_servers": ["f1:9092", " f2:9093"]}})
    assert g.kafka.bootstrap_servers == "f1:9092,f2:9093"
    assert resolve_bootstrap_servers(g) == "f1:9092,f2:9093"
    assert resolve_bootstrap_servers(g.kafka) == "f1:9092,f2:9093"
    assert resolve_bootstrap_servers(None) is None
    assert resolve_bootstrap_servers(GlobalConfig()) is None
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "env:9092")
    assert resolve_bootstrap_servers(g) == "env:9092"
    assert resolve_bootstrap_servers(None) == "env:9092"
    assert resolve_bootstrap_servers(g, cli_value="[::1]:9092") == "[::1]:9092"
    assert resolve_bootstrap_servers(g, cli_value="") == "env:9092"
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "broken")
    with pytest.raises(ConfigError, match="KAFKA_BOOTSTRAP_SERVERS"):
        resolve_bootstrap_servers(g)
    with pytest.raises(ConfigError, match="--kafka"):
        resolve_bootstrap_servers(g, cli_value="nope")
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    with pytest.raises(Misuse, match="GlobalConfig, KafkaConfig or None"):
        resolve_bootstrap_servers(42)


# ---------------------------------------------------------------- PERSIA's own files

PERSIA_DOCS_GLOBAL = """\
    common_config:
      metrics_config:
        enable_metrics: true
        push_interval_sec: 10
      job_type: Train
      checkpointing_config:
        num_workers: 8
    embedding_parameter_server_config:
      capacity: 1000000
      num_hashmap_internal_shards: 1
      enable_incremental_update: false
      incremental_buffer_size: 5000000
      incremental_channel_capacity: 1000
    embedding_worker_config:
      forward_buffer_size: 1000
    """

PERSIA_ADULT_INCOME_INFER = """\
    common_config:
      metrics_config:
        enable_metrics: true
        push_interval_sec: 10
      job_type: Infer
      infer_config:
        servers:
          - embedding_parameter_server:8888
        embedding_checkpoint: /cache/adult_income_ckpt/
      checkpointing_config:
        num_workers: 8
    embedding_parameter_server_config:
      capacity: 1000000
      num_hashmap_internal_shards: 1
      enable_incremental_update: false
      incremental_buffer_size: 5000000
      incremental_channel_capacity: 1000
    embedding_worker_config:
      forward_buffer_size: 1000
    """

PERSIA_DOCS_EMBEDDING = """\
    feature_index_prefix_bit: 8
    slot_config:
      workclass:
        dim: 8
        embedding_summation: true
      education:
        dim: 8
        embedding_summation: true
      marital_status:
        dim: 8
        embedding_summation: true
      occupation:
        dim: 8
        embedding_summation: true
      relationship:
        dim: 8
        embedding_summation: true
      race:
        dim: 8
        embedding_summation: true
      gender:
        dim: 8
        embedding_summation: true
      native_country:
        dim: 8
        embedding_summation: true
    feature_groups:
      group1:
        - workclass
        - education
        - race
      group2:
        - marital_status
        - occupation
    """


def test_persia_docs_global_config_loads_once_no_push_gateway_is_asked_for(tmp_path):
    # PERSIA pushed metrics to a gateway; nothing here would: refused, naming what to use.
    with pytest.raises(ConfigError) as info:
        load_global_config(write(tmp_path, "global_config.yml", PERSIA_DOCS_GLOBAL))
    assert info.value.field == "common_config.metrics_config.enable_metrics"
    assert "GET /metrics" in info.value.hint
    g = load_global_config(write(tmp_path, "global_config.yml", PERSIA_DOCS_GLOBAL.replace(
        "enable_metrics: true", "enable_metrics: false")))
    assert g.common_config.checkpointing_config.num_workers == 8
    assert g.embedding_parameter_server_config.capacity == 1_000_000
    assert g.embedding_parameter_server_config.incremental_buffer_size == 5_000_000
    # PERSIA's forward_buffer_size is the worker's buffer of batches waiting for NN workers
    assert g.embedding_worker_config.ready_buffer_batches == 1000


def test_persia_adult_income_infer_config_is_refused_naming_each_gap(tmp_path):
    text = PERSIA_ADULT_INCOME_INFER.replace("enable_metrics: true", "enable_metrics: false")
    with pytest.raises(ConfigError) as info:
        load_global_config(write(tmp_path, "global_config_infer.yml", text))
    assert info.value.field == "common_config.infer_config.embedding_checkpoint"
    assert "untrained rows" in str(info.value)
    text = "".join(line for line in text.splitlines(keepends=True)
                   if "embedding_checkpoint" not in line)
    with pytest.raises(ConfigError) as info:
        load_global_config(write(tmp_path, "global_config_infer.yml", text))
    assert info.value.field == "common_config.job_type"
    g = load_global_config(write(tmp_path, "global_config_infer.yml",
                                 text.replace("job_type: Infer", "job_type: Train")))
    # the API takes its embedding servers from infer_config.servers
    assert g.common_config.infer_config.servers == ("embedding_parameter_server:8888",)


def test_persia_docs_embedding_config_loads(tmp_path):
    schema = load_embedding_config(write(tmp_path, "embedding_config.yml",
                                         PERSIA_DOCS_EMBEDDING))
    assert len(schema.slots) == 8
    assert schema.group_names == ("group1", "group2", "relationship", "gender",
                                  "native_country")
    assert schema.slot("race").index_prefix == schema.slot("workclass").index_prefix == 1 << 56
    assert schema.slot("occupation").index_prefix == 2 << 56
    assert schema.slot("native_country").index_prefix == 5 << 56


def test_persia_draft_spelling_and_legacy_keys(tmp_path):
    # reference/000: `slot_configs:`; older PERSIA: push_interval_seconds, job_type in
    # lower case, initial_sparse_checkpoint, common_config.num_embedding_io_workers.
    schema = load_embedding_config(write(tmp_path, "e.yml", """\
        slot_configs:
          id:
            dim: 8
            embedding_summation: true # optional field
          age:
            dim: 8
        """))
    assert list(schema.slots) == ["id", "age"]
    g = GlobalConfig.from_dict({"common_config": {
        "job_type": "train", "num_embedding_io_workers": 6,
        "metrics_config": {"push_interval_seconds": 30}}})
    assert g.job_type == "Train"
    assert g.common_config.checkpointing_config.num_workers == 6
    assert g.common_config.metrics_config.push_interval_sec == 30
    with pytest.raises(ConfigError) as info:
        GlobalConfig.from_dict({"common_config": {
            "infer_config": {"initial_sparse_checkpoint": "/ckpt"}}})
    assert info.value.field == "common_config.infer_config.embedding_checkpoint"


def test_empty_sections_mean_defaults(tmp_path):
    g = load_global_config(write(tmp_path, "g.yml", """\
        common_config:
          metrics_config:
        embedding_worker_config:
        """))
    assert g == GlobalConfig()


# ---------------------------------------------------------------- round trips and digests

def test_embedding_round_trip_and_digest(tmp_path):
    schema = load_embedding_config(write(tmp_path, "e.yml", PERSIA_DOCS_EMBEDDING))
    again = EmbeddingSchema.from_dict(schema.to_dict())
    assert again == schema and again.digest() == schema.digest()
    assert len(schema.digest()) == 64 and int(schema.digest(), 16) >= 0
    # slot order decides group indices, so it is part of the digest
    d = schema.to_dict()
    d["slots_config"] = dict(reversed(list(d["slots_config"].items())))
    reordered = EmbeddingSchema.from_dict(d)
    assert reordered.digest() != schema.digest()
    assert reordered.slot("native_country").index_prefix == 3 << 56
    assert schema.slot("native_country").index_prefix == 5 << 56


def test_global_round_trip_digest_and_secrets():
    g = GlobalConfig.from_dict({
        "kafka": {"bootstrap_servers": "k:9092", "security_protocol": "SASL_SSL",
                  "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u",
                  "sasl_password": "hunter2", "ssl_cafile": "/ca.pem"},
        "api": {"token": "s3cret", "port": 0}})
    assert GlobalConfig.from_dict(g.to_dict()) == g
    assert g.to_dict()["kafka"]["sasl_password"] == "hunter2"
    redacted = g.to_dict(redact=True)
    assert redacted["kafka"]["sasl_password"] == "<redacted>"
    assert redacted["api"]["token"] == "<redacted>"
    assert "hunter2" not in repr(g) and "s3cret" not in repr(g)
    rotated = dataclasses.replace(g, kafka=dataclasses.replace(g.kafka, sasl_password="new"))
    assert rotated.digest() == g.digest()
    bigger = dataclasses.replace(g, embedding_parameter_server_config=dataclasses.replace(
        g.embedding_parameter_server_config, capacity=5))
    assert bigger.digest() != g.digest()


def test_kafka_security_kwargs_and_secret_files(tmp_path):
    secret = write(tmp_path, "pw", "hunter2\n")
    k = KafkaConfig(security_protocol="sasl_plaintext", sasl_username="u",
                    sasl_password_file=str(secret))
    assert k.security_protocol == "SASL_PLAINTEXT" and k.sasl_mechanism == "PLAIN"
    assert k.security_kwargs() == {"security_protocol": "SASL_PLAINTEXT",
                                   "sasl_mechanism": "PLAIN", "sasl_plain_username": "u",
                                   "sasl_plain_password": "hunter2"}
    assert KafkaConfig().security_kwargs() == {"security_protocol": "PLAINTEXT"}
    gone = KafkaConfig(security_protocol="SASL_PLAINTEXT", sasl_username="u",
                       sasl_password_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="kafka.sasl_password_file"):
        gone.security_kwargs()
    token = write(tmp_path, "token", "  abc \n")
    assert ApiConfig(token_file=str(token)).read_token() == "abc"
    assert ApiConfig(token="x").read_token() == "x"
    assert ApiConfig().read_token() is None
    with pytest.raises(ConfigError, match="empty"):
        ApiConfig(token_file=str(write(tmp_path, "blank", "\n"))).read_token()


def test_public_names_are_exported():
    for name in cfgmod.__all__:
        assert hasattr(cfgmod, name), name
    assert cfgmod.ENV_NN_WORKER_ENTRY == "PERSIA_NN_WORKER_ENTRY"
    assert cfgmod.ENV_DATALOADER_ENTRY == "PERSIA_DATALOADER_ENTRY"
