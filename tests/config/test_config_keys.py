"""Every config key is acted on or refused: none is validated and then read by nobody.

Walks the config dataclasses (``global_config.yml`` and ``embedding_config.yml``) and
sorts each key into exactly one of:

- ``READ``: the running code reads it; each entry names where (file and pattern), and the
  pattern must be found there, so removing the reader fails this test;
- ``ONLY``: accepted with the one value that describes what stream-persia does, any other
  value refused (PERSIA features stream-persia does not have);
- ``INERT_KEYS`` (in the code, with the reason): PERSIA keys accepted so PERSIA's files
  load, with no effect in PERSIA either under the values accepted here.

A key that is none of these (a new field nobody wires) fails the suite.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from stream_persia.config import EmbeddingSchema, GlobalConfig, HashStackConfig, SlotConfig
from stream_persia.config.global_config import INERT_KEYS
from stream_persia.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
LAUNCH, API_SETTINGS = "stream_persia/launch/roles.py", "api/settings.py"
CONSUMER, PRODUCER = "stream_persia/kafka/consumer.py", "stream_persia/kafka/producer.py"
KAFKA_CONFIG, POOLING = "stream_persia/config/kafka.py", "stream_persia/worker/pooling.py"
EMBEDDING = "stream_persia/config/embedding.py"
TRAIN_CTX, DENSE_PUBLISHER = "stream_persia/nn/train_ctx.py", "stream_persia/nn/dense_publisher.py"
PERIODIC = "stream_persia/nn/periodic.py"


def _security(name: str) -> list[tuple[str, str]]:
    """A Kafka security key: read by ``security_kwargs``, which the clients call."""
    return [(KAFKA_CONFIG, rf"def security_kwargs[\s\S]*self\.{name}(?!\w)"),
            (CONSUMER, r"kafka\.security_kwargs\(\)"), (PRODUCER, r"kafka\.security_kwargs\(\)")]


READ: dict[str, list[tuple[str, str]]] = {
    "common_config.infer_config.servers": [(API_SETTINGS, r"infer_config\.servers")],
    "common_config.checkpointing_config.keep_checkpoints": [
        (API_SETTINGS, r"checkpointing_config\s*\.keep_checkpoints"),
        ("api/checkpoints.py", r"settings\.keep_checkpoints"),
        (PERIODIC, r"self\.keep = config\.keep_checkpoints")],
    # periodic checkpoints on the NN ranks (stream_persia/nn/periodic.py)
    "common_config.checkpointing_config.every_steps": [
        (TRAIN_CTX, r"if self\.checkpointing_config\.periodic:"),
        (PERIODIC, r"self\.every_steps = config\.every_steps")],
    "common_config.checkpointing_config.every_s": [
        (PERIODIC, r"self\.every_s = config\.every_s")],
    # incremental checkpoints (issue 21): periodic ones are patches on a base
    "embedding_parameter_server_config.enable_incremental_update": [
        (PERIODIC, r"enable_incremental_update")],
    "common_config.checkpointing_config.full_every": [
        (PERIODIC, r"self\.full_every = config\.full_every")],
    "common_config.checkpointing_config.compact_after": [
        (PERIODIC, r"self\.compact_after = config\.compact_after")],
    "common_config.checkpointing_config.periodic_dir": [
        (PERIODIC, r"root = config\.periodic_dir or")],
    "embedding_parameter_server_config.capacity": [(LAUNCH, r"cfg\.capacity")],
    "embedding_parameter_server_config.restore_stage_ttl_s": [
        (LAUNCH, r"cfg\.restore_stage_ttl_s")],
    "embedding_parameter_server_config.store_threads": [(LAUNCH, r"cfg\.store_threads")],
    "embedding_parameter_server_config.update_tokens": [
        (LAUNCH, r"cfg\.update_tokens"),
        ("stream_persia/server/service.py", r"len\(tokens\) > self\.update_tokens")],
    "embedding_worker_config.push_retry_ms": [(LAUNCH, r"wc\.push_retry_ms")],
    "embedding_worker_config.on_server_restart": [
        (LAUNCH, r"on_server_restart=wc\.on_server_restart"),
        ("stream_persia/worker/router.py", r"self\.on_server_restart == \"continue\"")],
    "rpc.max_connections": [(LAUNCH, r"max_connections=rpc\.max_connections")],
    "rpc.idle_timeout_s": [(LAUNCH, r"idle_timeout_s=rpc\.idle_timeout_s")],
    "rpc.handshake_timeout_s": [(LAUNCH, r"handshake_timeout_s=rpc\.handshake_timeout_s")],
    "embedding_worker_config.ready_buffer_bytes": [(LAUNCH, r"wc\.ready_buffer_bytes")],
    "embedding_worker_config.ready_buffer_batches": [(LAUNCH, r"wc\.ready_buffer_batches")],
    "embedding_worker_config.max_inflight_lookups": [
        (LAUNCH, r"wc\.max_inflight_lookups"),
        ("stream_persia/worker/service.py", r"async with self\._lookups")],
    "embedding_worker_config.rpc_timeout_ms": [
        (LAUNCH, r"wc\.rpc_timeout_ms"),
        (API_SETTINGS, r"embedding_worker_config\.rpc_timeout_ms")],
    "kafka.bootstrap_servers": [(KAFKA_CONFIG, r"in_file = kafka\.bootstrap_servers"),
                                (CONSUMER, r"config_servers\(kafka")],
    "kafka.job_name": [(CONSUMER, r"kafka\.job_name")],
    "kafka.samples_topic": [(CONSUMER, r"kafka\.samples_topic"),
                            (PRODUCER, r"kafka\.samples_topic")],
    "kafka.dlq_topic": [("stream_persia/kafka/dlq.py", r"kafka\.dlq_topic")],
    "kafka.num_partitions": [(CONSUMER, r"kafka\.num_partitions")],
    "kafka.compression_type": [(PRODUCER, r"kafka\.compression_type")],
    "kafka.security_protocol": _security("security_protocol"),
    "kafka.sasl_mechanism": _security("sasl_mechanism"),
    "kafka.sasl_username": _security("sasl_username"),
    "kafka.sasl_password": _security(r"read_sasl_password\(\)")
    + [(KAFKA_CONFIG, r"def read_sasl_password[\s\S]*return self\.sasl_password\b")],
    "kafka.sasl_password_file": _security(r"read_sasl_password\(\)")
    + [(KAFKA_CONFIG,
        r"def read_sasl_password[\s\S]*read_secret_file\(self\.sasl_password_file")],
    "kafka.ssl_cafile": _security("ssl_cafile"),
    "kafka.ssl_certfile": _security("ssl_certfile"),
    "kafka.ssl_keyfile": _security("ssl_keyfile"),
    "kafka.fetch_max_wait_ms": [(CONSUMER, r"kafka\.fetch_max_wait_ms")],
    "kafka.on_data_loss": [(CONSUMER, r"kafka\.on_data_loss\)")],
    "kafka.startup_timeout_ms": [(CONSUMER, r"kafka\.startup_timeout_ms / 1000")],
    "kafka.broker_timeout_ms": [(CONSUMER, r"kafka\.broker_timeout_ms / 1000")],
    "kafka.enable_idempotence": [
        (KAFKA_CONFIG, r"def resolve_idempotence[\s\S]*in_file = kafka\.enable_idempotence"),
        (PRODUCER, r"resolve_idempotence\(kafka\)"),
        ("stream_persia/kafka/dlq.py", r"resolve_idempotence\(kafka\)"),
        ("stream_persia/kafka/updates.py", r"resolve_idempotence\(gc\.kafka\)"),
        (API_SETTINGS, r"resolve_idempotence\(kafka\)"),
        ("stream_persia/kafka/_client.py",
         r"enable_idempotence=resolve_idempotence\(None, enable_idempotence\)")],
    "kafka.max_batch_bytes": [(CONSUMER, r"kafka\.max_batch_bytes"),
                              (PRODUCER, r"kafka\.max_batch_bytes")],
    "api.host": [(API_SETTINGS, r"api\.host")],
    "api.port": [(API_SETTINGS, r"api\.port")],
    "api.token": [(API_SETTINGS, r"api\.read_token\(\)"),
                  ("stream_persia/config/global_config.py",
                   r"def read_token[\s\S]*return self\.token\b")],
    "api.token_file": [(API_SETTINGS, r"api\.read_token\(\)"),
                       ("stream_persia/config/global_config.py",
                        r"def read_token[\s\S]*read_secret_file\(self\.token_file")],
    "api.max_body_bytes": [(API_SETTINGS, r"api\.max_body_bytes")],
    "api.max_rows_per_request": [(API_SETTINGS, r"api\.max_rows_per_request")],
    "model_updates.enabled": [(TRAIN_CTX, r"model_updates\.enabled"),
                              (LAUNCH, r"mu = gc\.model_updates[\s\S]*model_updates=mu\.enabled")],
    # each embedding server's update feed (stream_persia/server/updates.py)
    "model_updates.model_update_interval_ms": [
        (LAUNCH, r"mu = gc\.model_updates[\s\S]*=mu\.model_update_interval_ms")],
    "model_updates.update_log_bytes": [
        (LAUNCH, r"mu = gc\.model_updates[\s\S]*update_log_bytes=mu\.update_log_bytes")],
    "model_updates.dense_every_steps": [(DENSE_PUBLISHER, r"cfg\.dense_every_steps")],
    "model_updates.dense_interval_ms": [(DENSE_PUBLISHER, r"cfg\.dense_interval_ms")],
    "model_updates.max_dense_bytes": [
        (LAUNCH, r"mu = gc\.model_updates[\s\S]*max_dense_bytes=mu\.max_dense_bytes"),
        ("stream_persia/server/dense_hub.py", r"> self\.max_dense_bytes"),
        (DENSE_PUBLISHER, r"cfg\.max_dense_bytes")],
    # progressive validation on the NN ranks (stream_persia/nn/progressive.py)
    "progressive.enabled": [(TRAIN_CTX, r"pc = self\.progressive_config[\s\S]*if pc\.enabled")],
    "progressive.window_samples": [(TRAIN_CTX, r"ProgressiveValidation\(\s*pc\.window_samples")],
    # embedding_config.yml
    "feature_index_prefix_bit": [("stream_persia/worker/batchplan.py",
                                  r"schema\.feature_index_prefix_bit")],
    "feature_groups": [("stream_persia/config/embedding.py",
                        r"feature_groups[\s\S]*index_prefix"),
                       (POOLING, r"slot\.index_prefix")],
    "slots_config.<slot>.dim": [("stream_persia/worker/batchplan.py", r"slot\.dim")],
    "slots_config.<slot>.sample_fixed_size": [(POOLING, r"slot\.sample_fixed_size")],
    "slots_config.<slot>.embedding_summation": [(POOLING, r"slot\.embedding_summation")],
    "slots_config.<slot>.sqrt_scaling": [(POOLING, r"slot\.sqrt_scaling")],
    "slots_config.<slot>.hash_stack_config.hash_stack_rounds": [
        (POOLING, r"hash_stack_config\.hash_stack_rounds")],
    "slots_config.<slot>.hash_stack_config.embedding_size": [
        (POOLING, r"hash_stack_config\.embedding_size")],
    # the table policies (issue 20): each slot's SlotPolicy, which the launcher hands the
    # embedding servers and the NN rank 0 sends in configure (policy_params)
    **{f"slots_config.<slot>.{key}": [
        (EMBEDDING, r'_FLAT: ClassVar\[dict\[str, type\]\] = \{"policy": SlotPolicy\}'),
        ("stream_persia/core/embedding_config.py",
         rf"class SlotPolicy:[\s\S]*\n    {key}: "),
        (EMBEDDING, r"def policy_params[\s\S]*p\.to_dict\(\)"),
        (LAUNCH, r"policies = embedding_schema\(args\)\.policy_params\(\)"),
        (TRAIN_CTX, r"schema = checkpointing\.job_schema\(\)[\s\S]*schema\.policy_params\(\)")]
       for key in ("admit_probability", "min_count", "ttl_s", "ttl_steps", "max_rows",
                   "dtype")},
    "admission.sketch_bytes": [(LAUNCH, r"sketch_bytes=gc\.admission\.sketch_bytes"),
                               ("stream_persia/server/service.py",
                                r"shards=store_threads,\s*sketch_bytes=sketch_bytes")],
}

#: key -> (the value accepted, a value refused)
ONLY: dict[str, tuple[object, object]] = {
    "common_config.job_type": ("Train", "Infer"),
    "common_config.metrics_config.enable_metrics": (False, True),
    "common_config.infer_config.embedding_checkpoint": (None, "/ckpt/x"),
}


def _walk(cls: type, prefix: str) -> list[str]:
    nested, flat = getattr(cls, "_NESTED", {}), getattr(cls, "_FLAT", {})
    out = []
    for f in dataclasses.fields(cls):
        if f.name in flat:   # its keys stand in the entry itself
            out += [f"{prefix}.{k.name}" for k in dataclasses.fields(flat[f.name])]
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        out += _walk(nested[f.name], path) if f.name in nested else [path]
    return out


def config_keys() -> list[str]:
    """Every key a file may set, as a dotted path (``<slot>`` for any slot's name)."""
    slot_keys = [k for k in _walk(SlotConfig, "slots_config.<slot>")
                 if k.rsplit(".", 1)[1] not in SlotConfig._REJECTED]   # name, index_prefix
    schema_keys = [f.name for f in dataclasses.fields(EmbeddingSchema)]
    assert schema_keys == ["feature_index_prefix_bit", "slots", "feature_groups"], \
        "EmbeddingSchema changed: classify its new keys here"
    return _walk(GlobalConfig, "") + ["feature_index_prefix_bit", "feature_groups", *slot_keys]


def test_every_config_key_is_read_refused_by_value_or_inert_with_a_reason():
    keys = config_keys()
    assert len(keys) == len(set(keys))
    classes = {"READ": set(READ), "ONLY": set(ONLY), "INERT_KEYS": set(INERT_KEYS)}
    for a, sa in classes.items():
        for b, sb in classes.items():
            assert a == b or not sa & sb, f"{sorted(sa & sb)} are in both {a} and {b}"
    unknown = sorted(set(keys) - set().union(*classes.values()))
    assert not unknown, (
        f"config keys validated but read by nobody: {unknown}. Wire each to what its name "
        "promises (and add it to READ), or refuse it with the reason (_REJECTED or a check "
        "in __post_init__); INERT_KEYS is only for PERSIA keys with no effect in PERSIA "
        "either")
    stale = sorted(set().union(*classes.values()) - set(keys))
    assert not stale, f"not config keys (any more): {stale}"
    for key, reason in INERT_KEYS.items():
        assert len(reason) > 20, key


@pytest.mark.parametrize("key", sorted(READ))
def test_a_read_key_is_read_where_the_table_says(key):
    for file, pattern in READ[key]:
        text = (ROOT / file).read_text()
        assert re.search(pattern, text), f"{key}: {pattern!r} is not in {file}"


def _nested(key: str, value: object) -> dict:
    out: object = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("key", sorted(ONLY))
def test_only_the_value_stream_persia_acts_on_is_accepted(key):
    accepted, refused = ONLY[key]
    GlobalConfig.from_dict(_nested(key, accepted))
    with pytest.raises(ConfigError) as info:
        GlobalConfig.from_dict(_nested(key, refused), source="g.yml")
    assert info.value.field == key
    assert info.value.hint, "a refusal says what to do instead"


def test_the_walk_sees_nested_and_embedding_keys():
    keys = config_keys()
    assert "embedding_worker_config.max_inflight_lookups" in keys
    assert "slots_config.<slot>.hash_stack_config.embedding_size" in keys
    assert HashStackConfig().enabled is False
