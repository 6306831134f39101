"""Hostile flags (and environment defaults) for every subcommand of the console script.

Each one must end the command with exit status 2 and a message naming the flag (or the
variable) before anything starts: no role is launched, no run directory or role process
is created, nothing is produced. The command runs in this process (``cli.main``), with
the step that would start work replaced by one that fails the test, so a check that
comes too late fails fast instead of starting a job. A few run as real processes too.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stream_persia.errors import ConfigError
from stream_persia.launch import cli
from stream_persia.launch import roles as launch
from stream_persia.launch.processes import RoleProcess
from stream_persia.loader import produce

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = str(ROOT / "topologies" / "synthetic_ctr")
# Environment defaults of the parsers: none may leak in from the shell running the tests.
ENV_DEFAULTS = ("REPLICA_INDEX", "REPLICA_SIZE", "NPROC_PER_NODE", "NNODES", "NODE_RANK",
                "MASTER_PORT", "MASTER_ADDR", "LOG_LEVEL", "PERSIA_EMBEDDING_SERVERS",
                "PERSIA_EMBEDDING_WORKERS", "STREAM_PERSIA_SAMPLES", "STREAM_PERSIA_EPOCHS",
                "STREAM_PERSIA_BATCH_SIZE", "STREAM_PERSIA_EVAL_SAMPLES",
                "EMBEDDING_STALENESS", "STREAM_PERSIA_SEED", "KAFKA_BOOTSTRAP_SERVERS")


class Started(AssertionError):
    """Work started although the command line was bad."""


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    for name in ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)

    def started(*args, **kwargs):
        raise Started("work started before the bad flag was refused")

    for role in launch.ROLES:
        monkeypatch.setitem(launch.ROLES, role, started)
    monkeypatch.setattr(produce, "main", started)
    monkeypatch.setattr(RoleProcess, "start", started)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def refused(argv: list[str], named: str, capsys) -> str:
    code, err = run_cli(argv, capsys)
    assert code == 2, (code, err)
    assert named in err, err
    assert "Traceback" not in err
    return err


# ---------------------------------------------------------------------- run
RUN = [
    (["--samples", "abc"], "--samples"),
    (["--samples", "-5"], "--samples"),
    (["--samples", "1.5"], "--samples"),
    (["--samples", "nan"], "--samples"),
    (["--batch-size", "0"], "--batch-size"),
    (["--epochs", "1.5"], "--epochs"),
    (["--epochs", "0"], "--epochs"),
    (["--eval-samples", "-1"], "--eval-samples"),
    (["--seed", "-1"], "--seed"),
    (["--embedding-staleness", "0"], "--embedding-staleness"),
    (["--embedding-staleness", "two"], "--embedding-staleness"),
    (["--nn-workers", "0"], "--nn-workers"),
    (["--embedding-servers", "0"], "--embedding-servers"),
    (["--embedding-workers", "-1"], "--embedding-workers"),
    (["--data-loaders", "x"], "--data-loaders"),
    (["--predict-samples", "-1"], "--predict-samples"),
    (["--timeout-s", "0"], "--timeout-s"),
    (["--timeout-s", "nan"], "--timeout-s"),
    (["--timeout-s", "inf"], "--timeout-s"),
    (["--stop-checkpoint-s", "-1"], "--stop-checkpoint-s"),
    (["--kafka", "nonsense"], "--kafka"),
    (["--kafka", "127.0.0.1:99999"], "--kafka"),
    (["--kafka", "127.0.0.1:9092", "--topic", "no spaces"], "--topic"),
    (["--kafka", "127.0.0.1:9092", "--partitions", "0"], "--partitions"),
    (["--log-level", "loud"], "--log-level"),
    # flags that would be ignored
    (["--topic", "t"], "--topic needs --kafka"),
    (["--partitions", "4"], "--partitions"),
    (["--kafka", "127.0.0.1:9092", "--topic", "t", "--partitions", "4"], "--partitions"),
    (["--no-api", "--predict-samples", "5"], "--predict-samples"),
    (["--data", "/tmp/clicks.csv"], "--data"),   # synthetic_ctr reads no dataset
    # empty (an unset shell variable): it read as "not given", so KAFKA_BOOTSTRAP_SERVERS
    # or the file decided instead
    (["--kafka", ""], "--kafka"),
    (["--kafka", " , "], "--kafka"),
    (["--output-dir", ""], "--output-dir"),   # it wrote to runs/<job>-<time> instead
    (["--data-dir", ""], "--data"),
]


@pytest.mark.parametrize(("flags", "named"), RUN, ids=[" ".join(f) for f, _ in RUN])
def test_run_refuses_bad_flags_before_any_role_starts(tmp_path, capsys, flags, named):
    out = tmp_path / "run"
    refused(["run", TOPOLOGY, "--output-dir", str(out), *flags], named, capsys)
    assert not out.exists(), "the run directory was made: the check came too late"


@pytest.mark.parametrize(("var", "value"), [
    ("EMBEDDING_STALENESS", "0"), ("STREAM_PERSIA_SAMPLES", "abc"),
    ("STREAM_PERSIA_EPOCHS", "1.5"), ("STREAM_PERSIA_BATCH_SIZE", "-3"),
    ("LOG_LEVEL", "loud"),
])
def test_run_refuses_bad_environment_the_roles_would_read(tmp_path, capsys, monkeypatch,
                                                           var, value):
    monkeypatch.setenv(var, value)
    out = tmp_path / "run"
    refused(["run", TOPOLOGY, "--output-dir", str(out)], var, capsys)
    assert not out.exists()


def test_run_refuses_bad_topology_run_settings_naming_file_and_key(tmp_path, capsys):
    topo = tmp_path / "topo"
    shutil.copytree(TOPOLOGY, topo)
    text = (topo / "topology.yml").read_text()
    (topo / "topology.yml").write_text(text.replace("epochs: 1", "epochs: 1.5"))
    err = refused(["run", str(topo), "--output-dir", str(tmp_path / "run")], "run.epochs",
                  capsys)
    assert str(topo / "topology.yml") in err
    # a flag overrides the file's value, so the run would be fine with --epochs
    assert "--epochs" in err


def test_run_refuses_a_key_given_twice_in_topology_yml(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys: a second ``run:`` section (say, pasted in
    to try other sizes) silently dropped the first's settings, and a second
    ``roles:`` its counts."""
    topo = tmp_path / "topo"
    shutil.copytree(TOPOLOGY, topo)
    with open(topo / "topology.yml", "a") as f:
        f.write("run:\n  epochs: 2\n")
    err = refused(["run", str(topo), "--output-dir", str(tmp_path / "run")],
                  "duplicate key 'run'", capsys)
    assert str(topo / "topology.yml") in err and "first at line" in err
    assert not (tmp_path / "run").exists()


TOPOLOGY_EDITS = [
    # (what replaces what in synthetic_ctr's topology.yml, the key named)
    # `tasks: click` was read letter by letter: tasks c, l, i, c, k
    (("tasks: [click]", "tasks: click"), "tasks"),
    (("tasks: [click]", "tasks: [yes]"), "tasks"),         # YAML's true
    # a gate's min of true was 1.0; a mapping for the list went through its keys
    (("min: 0.95", "min: true"), "gates[0]"),
    (("min: 0.95", "min: .nan"), "gates[0]"),
    (("  - {metric: bayes_lift.click, min: 0.95}", "  metric: auc.click"), "gates"),
    # a misspelt run setting: refused by the scripts only once every role had started
    (("  epochs: 1", "  epoch: 3"), "run.epoch"),
    (("seed: 0", "seed: 0\ndata: {required: 'false'}"), "data.required"),  # a true string
    (("seed: 0", "seed: 0\n  output_dir: 12"), "run.output_dir"),
    (("seed: 0", "seed: 0\n  checkpoint_dir: ' '"), "run.checkpoint_dir"),
    (("model_kwargs: {}", "model_kwargs: [64, 32]"), "serving.model_kwargs"),
    (("model: model:DNN", "model: DNN"), "serving.model"),
    # a process each: run's --embedding-servers has the same bound
    (("embedding_servers: 1", "embedding_servers: 100000"), "roles.embedding_servers"),
    (("nn_workers: {nproc_per_node: 1}", "nn_workers: {nproc_per_node: 5000}"),
     "roles.nn_workers.nproc_per_node"),
]


@pytest.mark.parametrize(("edit", "key"), TOPOLOGY_EDITS,
                         ids=[e[1] for e, _ in TOPOLOGY_EDITS])
def test_run_refuses_topology_values_it_would_misread(tmp_path, capsys, edit, key):
    topo = tmp_path / "topo"
    shutil.copytree(TOPOLOGY, topo)
    text = (topo / "topology.yml").read_text()
    assert edit[0] in text
    (topo / "topology.yml").write_text(text.replace(edit[0], edit[1], 1))
    err = refused(["run", str(topo), "--output-dir", str(tmp_path / "run")], f": {key}:",
                  capsys)
    assert str(topo / "topology.yml") in err
    assert not (tmp_path / "run").exists()


def test_run_honours_run_output_dir_and_says_what_it_does_with_checkpoint_dir(
        tmp_path, capsys, monkeypatch):
    """``run.output_dir`` is where run writes unless ``--output-dir`` says otherwise (which
    says so); ``run.checkpoint_dir`` cannot be honoured (the API serves checkpoints only
    under the run's directory), and run says so instead of ignoring it silently."""
    from stream_persia.launch.run_args import add_arguments, check_topology, output_dir
    from stream_persia.launch.topology import load_topology

    topo_dir = tmp_path / "topo"
    shutil.copytree(TOPOLOGY, topo_dir)
    text = (topo_dir / "topology.yml").read_text()
    (topo_dir / "topology.yml").write_text(text.replace(
        "seed: 0", "seed: 0\n  output_dir: results\n  checkpoint_dir: /data/ckpt", 1))
    topo = load_topology(str(topo_dir))
    monkeypatch.chdir(tmp_path)
    default = tmp_path / "default"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    check_topology(topo, parser.parse_args([str(topo_dir)]))
    assert "run.checkpoint_dir '/data/ckpt'" in capsys.readouterr().err
    assert output_dir(topo, argparse.Namespace(output_dir=None), default) == \
        tmp_path / "results"
    flag = str(tmp_path / "flag")
    assert output_dir(topo, argparse.Namespace(output_dir=flag), default) == Path(flag)
    assert "--output-dir" in capsys.readouterr().err
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "report.json").write_text("{}")   # a run before this one
    with pytest.raises(ConfigError) as err:
        output_dir(topo, argparse.Namespace(output_dir=None), default)
    assert err.value.field == "run.output_dir" and "already holds a run" in err.value.message
    plain = load_topology(str(TOPOLOGY))
    assert output_dir(plain, argparse.Namespace(output_dir=None), default) == default


def test_run_with_kafka_keeps_the_dead_letter_topic_the_global_config_names(tmp_path):
    """``run --kafka`` rewrites the global config for its samples topic; a ``dlq_topic``
    the file names stays (it was dropped: refused records went elsewhere than the file
    said), and without one the run's topic gets its own."""
    import yaml

    from stream_persia.launch.run import Job
    from stream_persia.launch.run_args import add_arguments
    from stream_persia.launch.topology import load_topology

    topo_dir = tmp_path / "topo"
    shutil.copytree(TOPOLOGY, topo_dir)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(topo_dir), "--kafka", "127.0.0.1:9"])
    plain = Job(load_topology(str(topo_dir)), args, tmp_path / "a")._global_config()
    assert "dlq_topic" not in yaml.safe_load(plain.read_text())["kafka"]
    cfg = topo_dir / "global_config.yml"
    cfg.write_text(cfg.read_text().replace("  job_name: synthetic_ctr",
                                           "  job_name: synthetic_ctr\n  dlq_topic: my.dlq", 1))
    got = Job(load_topology(str(topo_dir)), args, tmp_path / "b")._global_config()
    kafka = yaml.safe_load(got.read_text())["kafka"]
    assert kafka["dlq_topic"] == "my.dlq" and kafka["bootstrap_servers"] == "127.0.0.1:9"


def test_run_refuses_a_topology_yml_that_is_not_utf8(tmp_path, capsys):
    topo = tmp_path / "topo"
    shutil.copytree(TOPOLOGY, topo)
    with open(topo / "topology.yml", "ab") as f:
        f.write(b"# caf\xe9\n")
    err = refused(["run", str(topo), "--output-dir", str(tmp_path / "run")],
                  "topology.yml file is not UTF-8 text", capsys)
    assert "Traceback" not in err


def test_the_run_settings_load_topology_accepts_are_those_the_scripts_read():
    sys.path.insert(0, str(ROOT / "topologies"))
    try:
        import common
    finally:
        sys.path.remove(str(ROOT / "topologies"))
    from stream_persia.launch.topology import RUN_KEYS

    assert RUN_KEYS == tuple(name for name, _, _ in common._FIELDS)


def test_run_refuses_a_dataset_that_does_not_exist(tmp_path, capsys):
    out = tmp_path / "run"
    err = refused(["run", str(ROOT / "topologies" / "taobao_ple"), "--output-dir", str(out),
                   "--data-file", str(tmp_path / "missing.csv")], "--data", capsys)
    assert "does not exist" in err
    assert not out.exists()


def test_run_refuses_an_output_dir_it_cannot_make(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    refused(["run", TOPOLOGY, "--output-dir", str(tmp_path / "file" / "run")],
            "--output-dir", capsys)


def test_run_accepts_sizes_written_as_1e6(monkeypatch):
    args = cli.build_parser().parse_args(
        ["run", TOPOLOGY, "--samples", "2e5", "--eval-samples", "1_000", "--epochs", "2"])
    assert (args.samples, args.eval_samples, args.epochs) == (200_000, 1000, 2)


# ---------------------------------------------------------------------- launch
LAUNCH = [
    (["embedding-server", "--port", "99999"], "--port"),
    (["embedding-server", "--port", "-1"], "--port"),
    (["embedding-server", "--port", "http"], "--port"),
    (["embedding-server", "--metrics-port", "70000"], "--metrics-port"),
    (["embedding-server", "--replica-index", "-1"], "--replica-index"),
    (["embedding-server", "--replica-size", "0"], "--replica-size"),
    (["embedding-server", "--replica-index", "2", "--replica-size", "2"], "--replica-index"),
    (["embedding-server", "--capacity", "0"], "--capacity"),
    (["embedding-server", "--capacity", str((1 << 30) + 1)], "--capacity"),
    (["embedding-server", "--capacity", "1e6"], "--capacity"),
    (["embedding-server", "--store-threads", "257"], "--store-threads"),
    (["embedding-server", "--store-threads", "4", "--capacity", "2"], "--store-threads"),
    (["embedding-server", "--log-level", "loud"], "--log-level"),
    (["embedding-worker", "--port", "65536"], "--port"),
    (["embedding-worker", "--num-partitions", "0"], "--num-partitions"),
    (["embedding-worker", "--kafka", "nonsense"], "--kafka"),
    (["embedding-worker", "--topic", ".."], "--topic"),
    (["embedding-worker", "--embedding-servers", "127.0.0.1:7000,nonsense"],
     "--embedding-servers"),
    (["data-loader", "loader.py", "--port", "9000"], "--port"),
    (["data-loader", "loader.py", "--metrics-port", "9400"], "--metrics-port"),
    (["data-loader", "loader.py", "--kafka", "kafka"], "--kafka"),
    (["data-loader", "loader.py", "--replica-index", "1"], "--replica-index"),
    (["api", "--port", "99999"], "--port"),
    (["api", "--batch-wait-ms", "-1"], "--batch-wait-ms"),
    (["api", "--batch-wait-ms", "nan"], "--batch-wait-ms"),
    (["api", "--batch-wait-ms", "5000"], "--batch-wait-ms"),
    (["api", "--max-batch-rows", "0"], "--max-batch-rows"),
    (["api", "--metrics-port", "9400"], "--metrics-port"),
    (["api", "--replica-index", "1"], "--replica-index"),
    (["api", "--embeddings", "disk"], "--embeddings"),
    (["api", "--embedding-workers", "w0"], "--embedding-workers"),
    (["nn-worker", "train.py", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["nn-worker", "train.py", "--nnodes", "0"], "--nnodes"),
    (["nn-worker", "train.py", "--nnodes", "2", "--node-rank", "2"], "--node-rank"),
    (["nn-worker", "train.py", "--nnodes", "2", "--node-rank", "1"], "--master-port"),
    (["nn-worker", "train.py", "--master-port", "70000"], "--master-port"),
    (["nn-worker", "train.py", "--embedding-workers", ":1"], "--embedding-workers"),
    # empty values (an unset shell variable): they read as "not given", so the built-in
    # defaults, the environment or the well-known ports were used instead
    (["embedding-server", "--global-config", ""], "--global-config"),
    (["embedding-server", "--embedding-config="], "--embedding-config"),
    (["embedding-worker", "--kafka", ""], "--kafka"),
    (["embedding-worker", "--embedding-servers", ","], "--embedding-servers"),
    (["data-loader", "loader.py", "--embedding-workers", ""], "--embedding-workers"),
    (["api", "--global-config", " "], "--global-config"),
    (["nn-worker", "train.py", "--global-config="], "--global-config"),
    (["embedding-server", "--checkpoint-root", ""], "--checkpoint-root"),
    (["embedding-worker", "--ready-file", ""], "--ready-file"),
    (["api", "--checkpoint-dir", ""], "--checkpoint-dir"),
    (["api", "--model", ""], "--model"),
]


@pytest.mark.parametrize(("flags", "named"), LAUNCH, ids=[" ".join(f) for f, _ in LAUNCH])
def test_launch_refuses_bad_flags_before_the_role_starts(capsys, flags, named):
    refused(["launch", *flags], named, capsys)


@pytest.mark.parametrize(("role", "var", "value", "named"), [
    ("embedding-server", "REPLICA_INDEX", "abc", "--replica-index"),
    ("embedding-server", "REPLICA_INDEX", "1", "--replica-index"),   # REPLICA_SIZE 1
    ("embedding-worker", "REPLICA_SIZE", "0", "--replica-size"),
    ("embedding-worker", "PERSIA_EMBEDDING_SERVERS", "nonsense", "--embedding-servers"),
    ("data-loader", "REPLICA_INDEX", "-2", "--replica-index"),
    ("api", "PERSIA_EMBEDDING_WORKERS", "host-without-port", "--embedding-workers"),
    ("nn-worker", "NPROC_PER_NODE", "x", "--nproc-per-node"),
    ("nn-worker", "MASTER_PORT", "99999", "--master-port"),
    ("nn-worker", "NODE_RANK", "-1", "--node-rank"),
    ("embedding-server", "LOG_LEVEL", "verbose", "--log-level"),
])
def test_launch_refuses_bad_environment_defaults_naming_flag_and_variable(
        capsys, monkeypatch, role, var, value, named):
    monkeypatch.setenv(var, value)
    err = refused(["launch", role], named, capsys)
    assert var in err


def test_launch_flags_in_range_reach_the_role(monkeypatch, capsys):
    seen = {}
    monkeypatch.setitem(launch.ROLES, "embedding-server",
                        lambda args: seen.update(vars(args)) or 0)
    monkeypatch.setenv("REPLICA_INDEX", "1")
    assert cli.main(["launch", "embedding-parameter-server", "--replica-size", "2",
                     "--port", "0", "--metrics-port", "65535", "--capacity",
                     str(1 << 30), "--log-level", "WARNING"]) == 0
    assert (seen["replica_index"], seen["port"], seen["metrics_port"], seen["capacity"]) == (
        1, 0, 65535, 1 << 30)


# ---------------------------------------------------------------------- produce, checkpoint
PRODUCE = [
    (["--batch-size", "0"], "--batch-size"),
    (["--max-inflight", "0"], "--max-inflight"),
    (["--timeout-ms", "0"], "--timeout-ms"),
    (["--limit", "0"], "--limit"),
    (["--limit", "-5"], "--limit"),
    (["--repeat", "-1"], "--repeat"),
    (["--compression", "brotli"], "--compression"),
    (["--topic", "a/b"], "--topic"),
    (["--kafka", "broker"], "--kafka"),
    (["--embedding-workers", "w:0"], "--embedding-workers"),
    (["--log-level", "0"], "--log-level"),
    (["--kafka", ""], "--kafka"),
    (["--global-config", ""], "--global-config"),
]


@pytest.mark.parametrize(("flags", "named"), PRODUCE, ids=[" ".join(f) for f, _ in PRODUCE])
def test_produce_refuses_bad_flags_before_producing(capsys, flags, named):
    refused(["produce", "data.csv", "--mapping", "m.py", *flags], named, capsys)


@pytest.mark.parametrize("argv", [["checkpoint", "inspect", "d", "--log-level", "loud"],
                                  ["checkpoint", "list", "r", "--log-level", "5"]])
def test_checkpoint_refuses_a_bad_log_level(capsys, argv):
    refused(argv, "--log-level", capsys)


@pytest.mark.parametrize("argv", [["checkpoint", "clean", ""], ["checkpoint", "list", " "],
                                  ["checkpoint", "inspect", ""],
                                  ["checkpoint", "compact", "ckpt", "--dst="]],
                         ids=["clean", "list", "inspect", "compact --dst"])
def test_checkpoint_refuses_an_empty_path(capsys, monkeypatch, tmp_path, argv):
    # `checkpoint clean "$ROOT"` with ROOT unset cleaned the current directory
    monkeypatch.chdir(tmp_path)
    err = refused(argv, "is empty", capsys)
    assert "argument" in err


# ---------------------------------------------------------------------- real processes
@pytest.mark.parametrize("argv", [
    ["run", TOPOLOGY, "--samples", "abc"],
    ["run", TOPOLOGY, "--epochs", "1.5"],
    ["launch", "embedding-server", "--port", "99999"],
])
def test_the_console_script_exits_2_naming_the_flag(tmp_path, argv):
    out = tmp_path / "run"
    if argv[0] == "run":
        argv = [*argv, "--output-dir", str(out)]
    proc = subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"argument {argv[2]}" in proc.stderr
    assert not out.exists()
