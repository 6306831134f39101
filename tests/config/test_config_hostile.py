"""Hostile but legitimate config input (stream_persia.config): YAML that expands or nests
without bound, files that are not what they claim, empty values that used to read as
"not given", and the environment overriding a file. Each is refused or said out loud,
naming the file or variable and the key."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from stream_persia.config import GlobalConfig, load_embedding_config, load_global_config
from stream_persia.config.files import MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_VALUES
from stream_persia.config.kafka import resolve_bootstrap_servers, resolve_idempotence
from stream_persia.core import aio, switches
from stream_persia.errors import ConfigError
from stream_persia.rpc import auth, unix


def write(tmp_path, name: str, text: str | bytes):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def laughs(levels: int) -> str:
    """A slot whose ``dim`` is ten lines of aliases standing for 10**levels values."""
    lines = ['      - &l0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"      - &l{i} [" + ",".join([f"*l{i - 1}"] * 10) + "]"
              for i in range(1, levels)]
    return "slots_config:\n  user_id:\n    dim:\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------- YAML bounds

@pytest.mark.timeout(30)
def test_aliases_that_expand_past_the_bound_are_refused_before_any_walk(tmp_path):
    # 10**7 values from 7 short lines: the error message's repr of the value alone would
    # build them all (10**9, with two lines more, would not end).
    assert 10**7 > MAX_YAML_VALUES
    path = write(tmp_path, "emb.yml", laughs(7))
    with pytest.raises(ConfigError, match=rf"{path}: refused: .*more than {MAX_YAML_VALUES} "
                                          r"values once its aliases \(\*name\) are expanded"):
        load_embedding_config(path)


def test_aliases_within_the_bound_and_merge_keys_still_load(tmp_path):
    path = write(tmp_path, "emb.yml", """\
slots_config:
  user_id: &common {dim: 8, sqrt_scaling: true}
  item_id: {<<: *common, dim: 16}
feature_groups:
  g: &members [user_id, item_id]
""")
    schema = load_embedding_config(path)
    assert schema.slot("item_id").sqrt_scaling and schema.feature_groups["g"] == (
        "user_id", "item_id")


@pytest.mark.parametrize("text", ["slots_config:\n  u: {dim: &a [*a]}\n",
                                  "slots_config:\n  u: &a {dim: 8, x: *a}\n"],
                         ids=["list", "mapping"])
def test_an_alias_inside_its_own_anchor_is_refused(tmp_path, text):
    # A list came back as [[...]] (endless) and reached the checks; a mapping failed as
    # "not valid YAML" with a hint about indentation.
    path = write(tmp_path, "emb.yml", text)
    with pytest.raises(ConfigError, match=f"{path}: refused: an alias .* refers to a node "
                                          "that contains it") as err:
        load_embedding_config(path)
    assert "indentation" not in str(err.value)


@pytest.mark.parametrize("depth", [MAX_YAML_DEPTH + 5, 20_000])
def test_nesting_past_the_bound_is_a_config_error_not_a_recursion_error(tmp_path, depth):
    path = write(tmp_path, "emb.yml", "slots_config:\n  u: {dim: " + "[" * depth
                 + "]" * depth + "}\n")
    with pytest.raises(ConfigError, match=f"{path}: refused: lists and mappings nest more "
                                          f"than {MAX_YAML_DEPTH} deep"):
        load_embedding_config(path)


@pytest.mark.parametrize("value", ["010000", "0700", "+07", "00"])
def test_a_zero_padded_number_yaml_reads_as_octal_is_refused(tmp_path, value):
    # capacity: 010000 was 4096 rows
    path = write(tmp_path, "glob.yml", f"embedding_parameter_server_config:\n"
                                       f"  capacity: {value}\n")
    with pytest.raises(ConfigError, match=rf"{path}: refused: '{re.escape(value)}' at line 2 "
                                          r"starts with 0, which YAML reads as an octal"):
        load_global_config(path)
    # 0, quoted text and hexadecimal are what they look like
    path = write(tmp_path, "ok.yml", "embedding_parameter_server_config: {capacity: 0x10, "
                                     "num_hashmap_internal_shards: 10}\nkafka: {job_name: '007'}\n")
    cfg = load_global_config(path)
    assert cfg.embedding_parameter_server_config.capacity == 16
    assert cfg.kafka.job_name == "007"


@pytest.mark.timeout(60)
def test_a_file_larger_than_the_bound_is_refused_unread(tmp_path):
    path = write(tmp_path, "glob.yml", "api: {port: 8081}\n#" + "x" * MAX_YAML_BYTES + "\n")
    with pytest.raises(ConfigError, match=f"{path}: global_config file is larger than "
                                          f"{MAX_YAML_BYTES} bytes"):
        load_global_config(path)


def test_a_device_that_never_ends_is_read_only_up_to_the_bound():
    with pytest.raises(ConfigError, match="/dev/zero: global_config file is larger than"):
        load_global_config("/dev/zero")


def test_a_file_that_is_not_utf8_names_the_line(tmp_path):
    path = write(tmp_path, "glob.yml", b"api:\n  host: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{path}: global_config file is not UTF-8 text "
                                          r"\(byte 16, line 2"):
        load_global_config(path)


def test_an_empty_path_is_refused_not_taken_as_the_current_directory():
    with pytest.raises(ConfigError, match="the global_config path is empty"):
        load_global_config("")


# ---------------------------------------------------------------- values

@pytest.mark.parametrize("value", ['""', "' '", "[]", '","'])
def test_empty_bootstrap_servers_in_the_file_are_refused_not_broker_less(tmp_path, value):
    # An unexpanded ${KAFKA} left "" and the job ran without Kafka (no replay, no
    # exactly-once) while its file named a kafka section.
    path = write(tmp_path, "glob.yml", f"kafka:\n  bootstrap_servers: {value}\n")
    with pytest.raises(ConfigError, match=rf"{path}: kafka\.bootstrap_servers: is empty") \
            as err:
        load_global_config(path)
    assert "write null or remove the key" in err.value.hint
    assert load_global_config(write(tmp_path, "null.yml", "kafka:\n  bootstrap_servers: null\n"
                                    )).kafka.embedded


def test_a_periodic_dir_under_home_written_with_a_tilde_is_refused(tmp_path):
    path = write(tmp_path, "glob.yml", "common_config:\n  checkpointing_config:\n"
                                       "    every_steps: 100\n    periodic_dir: ~/ckpt\n")
    with pytest.raises(ConfigError, match=r"common_config\.checkpointing_config\.periodic_dir: "
                                          r"'~/ckpt' starts with ~"):
        load_global_config(path)


@pytest.mark.timeout(30)
def test_secret_files_are_read_only_up_to_a_bound(tmp_path, monkeypatch):
    # /dev/zero (or a data file) was read whole: memory, or a secret of gigabytes
    api = GlobalConfig.from_dict({"api": {"token_file": "/dev/zero"}}).api
    with pytest.raises(ConfigError, match="api.token_file: '/dev/zero' is larger than"):
        api.read_token()
    kafka = GlobalConfig.from_dict({"kafka": {
        "bootstrap_servers": "k:9092", "security_protocol": "SASL_PLAINTEXT",
        "sasl_username": "u", "sasl_password_file": "/dev/zero"}}).kafka
    with pytest.raises(ConfigError, match="kafka.sasl_password_file: '/dev/zero' is larger"):
        kafka.read_sasl_password()
    with pytest.raises(ConfigError, match="PERSIA_ROLE_SECRET_FILE: '/dev/zero' is larger"):
        auth.RoleSecret.from_env({"PERSIA_ROLE_SECRET_FILE": "/dev/zero"})
    token = write(tmp_path, "token", "  s3cret-token-of-the-api \n")
    assert GlobalConfig.from_dict({"api": {"token_file": str(token)}}).api.read_token() == \
        "s3cret-token-of-the-api"


# ---------------------------------------------------------------- environment

def test_the_environment_overriding_the_files_brokers_is_logged_once(monkeypatch, caplog):
    g = GlobalConfig.from_dict({"kafka": {"bootstrap_servers": "file:9092",
                                          "enable_idempotence": True}})
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "env:9092")
    monkeypatch.setenv("KAFKA_ENABLE_IDEMPOTENCE", "off")
    with caplog.at_level(logging.WARNING, logger="stream_persia.config.kafka"):
        assert resolve_bootstrap_servers(g) == "env:9092"
        assert resolve_bootstrap_servers(g) == "env:9092"
        assert resolve_idempotence(g) is False
        assert resolve_bootstrap_servers(g, cli_value="cli:9092") == "cli:9092"
        # a client handed the value resolved from the environment resolves it again
        # (kafka._client.config_servers): nothing new to say, and no false "--kafka"
        assert resolve_bootstrap_servers(g, cli_value="env:9092") == "env:9092"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "environment KAFKA_BOOTSTRAP_SERVERS = 'env:9092' overrides kafka.bootstrap_servers "
        "= 'file:9092' of the global config",
        "environment KAFKA_ENABLE_IDEMPOTENCE = False overrides kafka.enable_idempotence = "
        "True of the global config",
        "--kafka = 'cli:9092' overrides kafka.bootstrap_servers = 'file:9092' of the global "
        "config"], lines
    caplog.clear()
    # the same value, or a file that names none, is nothing to say
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "file:9092")
    assert resolve_bootstrap_servers(g) == "file:9092"
    assert resolve_bootstrap_servers(GlobalConfig(), cli_value="cli:9092") == "cli:9092"
    assert not caplog.records


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("true", True), ("ON", True),
                                            ("yes", True), ("0", False), ("false", False),
                                            ("Off", False), (" no ", False)])
def test_switches_read_every_spelling_of_true_and_false(monkeypatch, raw, value):
    monkeypatch.setenv("STREAM_PERSIA_RPC_UNIX", raw)
    monkeypatch.setenv("STREAM_PERSIA_NO_UVLOOP", raw)
    # `false` left the Unix-socket shortcut on and turned uvloop off: only "0" counted
    assert unix.enabled() is value
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pytest.skip("uvloop is not installed")
    assert aio.uvloop_available() is (not value)


def test_a_switch_that_is_neither_names_the_variable(monkeypatch):
    monkeypatch.setenv("STREAM_PERSIA_RPC_UNIX", "disabled")
    with pytest.raises(ConfigError, match="STREAM_PERSIA_RPC_UNIX = 'disabled' is not true "
                                          "or false"):
        unix.enabled()
    monkeypatch.setenv("STREAM_PERSIA_RPC_UNIX", "")
    assert switches.env_switch("STREAM_PERSIA_RPC_UNIX", True) is True


@pytest.mark.parametrize(("raw", "value"), [("true", "True"), ("0", "False"),
                                            ("maybe", "ConfigError")])
def test_pure_python_reads_true_as_on(raw, value):
    # Read once at import: a fresh interpreter. `true` used to pick no twin at all.
    code = ("from stream_persia.errors import ConfigError\n"
            "try:\n    from stream_persia.kernels import twins\n"
            "    print(twins.PURE_PYTHON)\n"
            "except ConfigError as e:\n    print('ConfigError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "STREAM_PERSIA_PURE_PYTHON": raw})
    assert out.stdout.startswith(value), (out.stdout, out.stderr)
