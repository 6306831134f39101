"""deploy/: every manifest parses, and every ``stream-persia`` command line in the compose
file, the Kubernetes manifests and the Procfile parses with the real CLI parser, so flags,
ports, addresses, topics and config paths cannot drift from the code or from each other.

No Docker or Kubernetes here: these read files only. Environment references in the
manifests (compose ``${VAR:-default}``, downward-API fields, secrets) are replaced by
sample values before parsing.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest
import yaml

from stream_persia.checkpoint.root import CheckpointRoot
from stream_persia.config import GlobalConfig
from stream_persia.launch.cli import build_parser
from stream_persia.rpc.auth import SECRET_ENV, SECRET_FILE_ENV, RoleSecret, check_bind

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
TOPOLOGY = REPO / "topologies" / "synthetic_ctr"
IMAGE = "stream-persia"
IMAGE_WORKDIR = "/app/"              # the Dockerfile's WORKDIR; the repo's topologies/ go there
UID = 10001                          # the image's user; every pod sharing storage runs as it
ROLES = {"embedding-server", "embedding-worker", "api", "nn-worker", "data-loader"}
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
JOB_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
SAMPLES = {"PERSIA_API_TOKEN": "sample-token",   # for compose's required ${VAR:?...}
           "PERSIA_ROLE_SECRET": "sample-role-secret-0123456789"}
#: roles that serve RPC: a role secret, and their checkpoint RPCs confined to a root
RPC_ROLES = ("embedding-server", "embedding-worker")
CHECKPOINT_VARS = ("PERSIA_CHECKPOINT_DIR", "PERSIA_CKPT_DIR")


# ------------------------------------------------------------------------- helpers
def parse_cli(argv: list[str], env: dict[str, str]):
    """``stream-persia ARGV`` as the CLI parses it in a process with environment ``env``
    (the parser reads its env defaults when it is built)."""
    if argv[:2] == ["launch", "nn-worker"] and "--" in argv:
        argv = argv[:argv.index("--")]       # main() hands the rest to the script
    with mock.patch.dict(os.environ, env, clear=True):
        try:
            ns = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"the CLI rejects: stream-persia {shlex.join(argv)}")
    if ns.command == "launch" and ns.role != "nn-worker":
        assert 0 <= ns.replica_index < ns.replica_size, argv
    return ns


def compose_expand(value: str) -> str:
    """Compose interpolation: ``${VAR:-default}`` -> default, ``${VAR:?err}`` -> a sample."""
    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        return arg if op.endswith("-") else SAMPLES[name]
    out = re.sub(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}", sub, str(value))
    assert "$" not in out, f"uninterpreted variable in {value!r}"
    return out


def addresses(raw: str) -> list[str]:
    out = raw.split(",")
    for a in out:
        assert re.fullmatch(r"[\w.-]+:\d{1,5}", a), f"{a!r} is not host:port"
    return out


def repo_path(path: str) -> Path:
    """A path as the image sees it (under /app) or relative to the repo root -> the file."""
    return REPO / (path[len(IMAGE_WORKDIR):] if path.startswith(IMAGE_WORKDIR) else path)


def global_config(text: str) -> GlobalConfig:
    return GlobalConfig.from_dict(yaml.safe_load(text))


# ------------------------------------------------------------------------- all YAML
def test_every_yaml_file_parses():
    files = sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])
    assert len(files) >= 9
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), f


# ------------------------------------------------------------------------- compose
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def compose_roles(compose: dict) -> dict[str, tuple[object, dict[str, str], dict]]:
    """service -> (parsed command, environment, service) of the stream-persia services."""
    out = {}
    for name, svc in compose["services"].items():
        if not str(svc.get("image", "")).startswith(IMAGE + ":"):
            continue
        env = {k: compose_expand(v) for k, v in (svc.get("environment") or {}).items()}
        argv = [compose_expand(a) for a in svc["command"]]
        assert argv[0] == "launch", f"{name}: the image's ENTRYPOINT is already stream-persia"
        out[name] = (parse_cli(argv, env), env, svc)
    return out


def _replicas(roles: dict, role: str) -> list[tuple[str, object, dict]]:
    """(service, args, env) of one role, in replica order; indices are 0..n-1 of n."""
    found = sorted(((ns.replica_index, name, ns, env) for name, (ns, env, _) in roles.items()
                    if ns.role == role), key=lambda t: t[0])
    assert [i for i, *_ in found] == list(range(len(found))), role
    assert {ns.replica_size for _, _, ns, _ in found} == {len(found)}, role
    return [(name, ns, env) for _, name, ns, env in found]


def test_compose_commands_parse_and_cover_every_role(compose):
    roles = compose_roles(compose)
    assert {ns.role for ns, _, _ in roles.values()} == ROLES
    assert set(compose["services"]) - set(roles) == {"kafka", "kafka-init"}, \
        "a service that runs neither Kafka nor stream-persia: parse its command here"
    for name, (ns, _, svc) in roles.items():
        assert name.startswith(ns.role), name
        if ns.role in ("embedding-server", "embedding-worker", "api"):
            assert ns.host == "0.0.0.0", f"{name} must listen beyond its container"
        if ns.role in ("nn-worker", "data-loader"):
            assert repo_path(ns.entry).is_file(), ns.entry
        for key in ("PERSIA_EMBEDDING_CONFIG", "PERSIA_GLOBAL_CONFIG"):
            targets = {c["target"] for c in svc["configs"]}
            assert svc["environment"][key] in targets, (name, key)


def test_compose_addresses_ports_and_healthchecks_agree(compose):
    roles = compose_roles(compose)
    for role, var, fixed in (("embedding-server", "PERSIA_EMBEDDING_SERVERS", 9000),
                             ("embedding-worker", "PERSIA_EMBEDDING_WORKERS", 9100)):
        reps = _replicas(roles, role)
        assert len(reps) == 2
        expected = [f"{name}:{ns.port}" for name, ns, _ in reps]
        for name, ns, _ in reps:
            assert (ns.port, ns.metrics_port) == (fixed, 9400), name
            check = " ".join(compose["services"][name]["healthcheck"]["test"])
            assert f"'127.0.0.1', {ns.port})" in check, name
        users = [n for n, (_, env, _) in roles.items() if var in env]
        assert set(users) >= {n for n, (ns, _, _) in roles.items()
                              if ns.role in {"embedding-server": ("embedding-worker", "api"),
                                             "embedding-worker": ("nn-worker", "api")}[role]}
        for name in users:
            assert addresses(roles[name][1][var]) == expected, (name, var)
    (api, (ns, env, svc)), = [(n, r) for n, r in roles.items() if r[0].role == "api"]
    assert ns.port == 8080 and f"127.0.0.1:{ns.port}:{ns.port}" in svc["ports"]
    assert f"http://127.0.0.1:{ns.port}/healthz" in " ".join(svc["healthcheck"]["test"])
    assert env["PERSIA_API_TOKEN"], "the API listens on 0.0.0.0: it needs a token"


def test_compose_kafka_is_kraft_with_the_jobs_topics(compose):
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    kenv = kafka["environment"]
    assert "controller" in kenv["KAFKA_PROCESS_ROLES"] and not any("ZOOKEEPER" in k for k in kenv)
    assert str(kenv["KAFKA_AUTO_CREATE_TOPICS_ENABLE"]) == "false"
    advertised = {u.split("://")[1] for u in kenv["KAFKA_ADVERTISED_LISTENERS"].split(",")}

    gc = global_config((DEPLOY / compose["configs"]["global_config"]["file"]).read_text())
    script = compose["services"]["kafka-init"]["command"][0]
    created = {m.group(1): int(m.group(2))
               for m in re.finditer(r"--topic (\S+) --partitions (\d+)", script)}
    assert set(created) == {gc.kafka.samples_topic, gc.kafka.dlq_topic}

    roles = compose_roles(compose)
    workers = _replicas(roles, "embedding-worker")
    assert created[gc.kafka.samples_topic] >= len(workers), "a worker would own no partition"
    for name, ns, _ in workers:
        assert ns.kafka in advertised, name
        assert compose["services"][name]["depends_on"]["kafka-init"]["condition"] == \
            "service_completed_successfully"
    loader_env = next(env for ns, env, _ in roles.values() if ns.role == "data-loader")
    assert loader_env["KAFKA_BOOTSTRAP_SERVERS"] in advertised


def test_compose_configs_are_the_topologys_and_storage_is_shared(compose):
    for key, cfg in compose["configs"].items():
        path = (DEPLOY / cfg["file"]).resolve()
        assert path == TOPOLOGY / f"{key}.yml" and path.is_file()
    mounts = {}
    for name, (ns, env, svc) in compose_roles(compose).items():
        if ns.role in ("embedding-server", "api", "nn-worker"):
            (mount,) = [v for v in svc.get("volumes", []) if v.startswith("persia-data:")]
            mounts[name] = mount.split(":")[1]
        for var in ("PERSIA_CHECKPOINT_DIR", "PERSIA_CKPT_DIR", "PERSIA_OUTPUT_DIR"):
            if var in env and name in mounts:
                assert env[var].startswith(mounts[name] + "/"), (name, var)
    assert len(set(mounts.values())) == 1, "checkpoint paths are sent between roles"


def check_role_security(roles: list[tuple[object, dict[str, str]]], secret_file: Path | None,
                        where: str) -> None:
    """Every role holds the job's role secret (each RPC client presents it, each server
    requires it), a server or worker on a non-loopback host would start with it, and
    every checkpoint directory of the job lies under the servers' and workers' root."""
    roots, dirs = [], []
    for ns, env in roles:
        if secret_file is not None and SECRET_FILE_ENV in env:
            env = {**env, SECRET_FILE_ENV: str(secret_file)}
        secret = RoleSecret.from_env(env)
        assert secret is not None, f"{where}: {ns.role} has no role secret"
        if ns.role in RPC_ROLES:
            check_bind(ns.host, secret, f"{where}: {ns.role}")
            assert ns.checkpoint_root, f"{where}: {ns.role} has no checkpoint root"
            roots.append(CheckpointRoot(ns.checkpoint_root))
        dirs += [env[v] for v in CHECKPOINT_VARS if v in env]
    assert roots and dirs, where
    for root in roots:
        for d in dirs:
            root.confine(d, "dir")     # BadInput if a checkpoint would be refused


def test_compose_wires_the_role_secret_and_checkpoint_root_to_every_role(compose):
    roles = compose_roles(compose)
    for name, (_, _, svc) in roles.items():
        assert svc["environment"][SECRET_ENV].startswith("${PERSIA_ROLE_SECRET:?"), name
    check_role_security([(ns, env) for ns, env, _ in roles.values()], None, "compose")


# ------------------------------------------------------------------------- Kubernetes
@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    docs = {}
    for f in sorted(K8S.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d and d.get("kind") != "Kustomization":
                docs[(d["kind"], d["metadata"]["name"])] = d
    return docs


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def replicas(doc: dict) -> int:
    if doc["kind"] == "Job":
        assert doc["spec"]["completionMode"] == "Indexed"
        assert doc["spec"]["completions"] == doc["spec"]["parallelism"]
        return doc["spec"]["completions"]
    return doc["spec"]["replicas"]


def container_env(c: dict, index: int) -> dict[str, str]:
    """The container's environment in replica ``index`` (downward API resolved)."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] in (POD_INDEX, JOB_INDEX), e
            env[e["name"]] = str(index)
    return env


def k8s_roles(k8s: dict) -> dict[str, list[tuple[object, dict, dict, dict]]]:
    """role -> [(parsed args, env, container, workload) per replica]."""
    out: dict[str, list] = {}
    for (kind, _), doc in k8s.items():
        if kind not in ("StatefulSet", "Deployment", "Job"):
            continue
        (c,) = pod_spec(doc)["containers"]
        assert c["image"].split(":")[0] == IMAGE
        for i in range(replicas(doc)):
            env = container_env(c, i)
            ns = parse_cli([str(a) for a in c["args"]], env)
            out.setdefault(ns.role, []).append((ns, env, c, doc))
    return out


def test_k8s_manifests_are_namespace_agnostic_and_all_in_the_kustomization(k8s):
    for (kind, name), doc in k8s.items():
        assert doc["apiVersion"] and "namespace" not in doc["metadata"], (kind, name)
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(kust["resources"]) == files and len(kust["resources"]) == len(files)
    assert [i["name"] for i in kust["images"]] == [IMAGE]


def test_k8s_commands_parse_with_replica_indices_from_the_pod(k8s):
    roles = k8s_roles(k8s)
    assert set(roles) == ROLES
    for role, reps in roles.items():
        for i, (ns, _env, c, doc) in enumerate(reps):
            fields = {e["valueFrom"]["fieldRef"]["fieldPath"] for e in c.get("env", [])
                      if "valueFrom" in e}
            if doc["kind"] == "StatefulSet":
                assert fields == {POD_INDEX} and (ns.replica_index, ns.replica_size) == \
                    (i, replicas(doc)), role
                assert ns.host == "0.0.0.0" and ns.metrics_port, role
            if role == "data-loader":
                assert fields == {JOB_INDEX} and (ns.replica_index, ns.replica_size) == \
                    (i, replicas(doc))
            if role == "nn-worker":
                assert fields == {JOB_INDEX} and (ns.node_rank, ns.nnodes) == (i, replicas(doc))
            if role in ("nn-worker", "data-loader"):
                assert repo_path(ns.entry).is_file(), ns.entry


def test_k8s_stable_addresses_match_headless_services(k8s):
    roles = k8s_roles(k8s)
    for role, var, users in (("embedding-server", "PERSIA_EMBEDDING_SERVERS",
                              ("embedding-worker", "api")),
                             ("embedding-worker", "PERSIA_EMBEDDING_WORKERS",
                              ("nn-worker", "api"))):
        ns, _, c, sts = roles[role][0]
        svc = k8s[("Service", sts["spec"]["serviceName"])]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"].items() <= \
            sts["spec"]["template"]["metadata"]["labels"].items()
        ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        cports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["rpc"] == cports["rpc"] == ns.port
        assert ports["metrics"] == cports["metrics"] == ns.metrics_port
        expected = [f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{ns.port}"
                    for i in range(replicas(sts))]
        for user in users:
            for user_ns, env, _, _ in roles[user]:
                if var == "PERSIA_EMBEDDING_WORKERS" and \
                        getattr(user_ns, "embeddings", None) == "replica":
                    assert var not in env   # serving replicas never use the workers
                    continue
                assert addresses(env[var]) == expected, (user, var)

    ns, env, c, job = roles["nn-worker"][0]
    spec = pod_spec(job)
    svc = k8s[("Service", spec["subdomain"])]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= \
        job["spec"]["template"]["metadata"]["labels"].items()
    assert ns.master_addr == f"{job['metadata']['name']}-0.{spec['subdomain']}"
    assert ns.master_port in [p["port"] for p in svc["spec"]["ports"]]


def test_k8s_kafka_is_strimzi_kraft_with_the_jobs_topics(k8s):
    (kafka,) = [d for (kind, _), d in k8s.items() if kind == "Kafka"]
    name = kafka["metadata"]["name"]
    # Strimzi 1.0 serves kafka.strimzi.io/v1 only; KRaft with node pools is its only mode
    assert {d["apiVersion"] for (kind, _), d in k8s.items()
            if kind.startswith("Kafka")} == {"kafka.strimzi.io/v1"}
    assert "zookeeper" not in kafka["spec"]
    pools = [d for (kind, _), d in k8s.items() if kind == "KafkaNodePool"]
    assert all(p["metadata"]["labels"]["strimzi.io/cluster"] == name for p in pools)
    assert {"controller", "broker"} <= {r for p in pools for r in p["spec"]["roles"]}
    assert kafka["spec"]["kafka"]["config"]["auto.create.topics.enable"] is False
    plain = next(lst["port"] for lst in kafka["spec"]["kafka"]["listeners"] if not lst["tls"])
    bootstrap = f"{name}-kafka-bootstrap:{plain}"

    gc = global_config(k8s[("ConfigMap", "persia-config")]["data"]["global_config.yml"])
    topics = {d["spec"]["topicName"]: d for (kind, _), d in k8s.items() if kind == "KafkaTopic"}
    updates = f"{gc.kafka.job_name}.model.updates"
    assert set(topics) == {gc.kafka.samples_topic, gc.kafka.dlq_topic, updates,
                           f"{updates}.dlq"}
    assert all(t["metadata"]["labels"]["strimzi.io/cluster"] == name for t in topics.values())

    roles = k8s_roles(k8s)
    workers = roles["embedding-worker"]
    assert topics[gc.kafka.samples_topic]["spec"]["partitions"] >= len(workers)
    for role in ("embedding-worker", "data-loader", "embedding-server"):
        assert {env["KAFKA_BOOTSTRAP_SERVERS"] for _, env, _, _ in roles[role]} == {bootstrap}
    serving = [env for ns, env, _, _ in roles["api"] if ns.embeddings == "replica"]
    assert serving and {env["KAFKA_BOOTSTRAP_SERVERS"] for env in serving} == {bootstrap}


def test_k8s_configmap_is_the_topologys_configs_and_is_mounted(k8s):
    data = k8s[("ConfigMap", "persia-config")]["data"]
    assert data == {name: (TOPOLOGY / name).read_text()
                    for name in ("embedding_config.yml", "global_config.yml")}, \
        "deploy/k8s/configmap.yaml drifted from topologies/synthetic_ctr: copy the files in"
    for role, reps in k8s_roles(k8s).items():
        ns, env, c, doc = reps[0]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
        (vol,) = [v for v in pod_spec(doc)["volumes"] if v["name"] == "config"]
        assert vol["configMap"]["name"] == "persia-config"
        for var in ("PERSIA_EMBEDDING_CONFIG", "PERSIA_GLOBAL_CONFIG"):
            folder, _, key = env[var].rpartition("/")
            assert folder == mount["mountPath"] and key in data, (role, var)


def test_k8s_api_probes_service_and_token(k8s):
    ((ns, env, c, dep),) = [r for r in k8s_roles(k8s)["api"] if r[0].embeddings != "replica"]
    assert dep["kind"] == "Deployment" and ns.host == "0.0.0.0"
    cports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cports["http"] == ns.port
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    svc = k8s[("Service", "persia-api")]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()

    secret = k8s[("Secret", "persia-api-token")]
    (vol,) = [v for v in pod_spec(dep)["volumes"]
              if v.get("secret", {}).get("secretName") == "persia-api-token"]
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    (item,) = vol["secret"]["items"]
    assert item["key"] in secret["stringData"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
    assert env["PERSIA_API_TOKEN_FILE"] == f"{mount['mountPath']}/{item['path']}"
    assert "PERSIA_API_TOKEN" not in env, "the token stays out of the pod's environment"


def test_k8s_serving_replicas_follow_the_update_topic_behind_one_service(k8s):
    """Two serving replicas behind their own Service (not the control plane's), reading
    the checkpoints read-only; the update topic has a partition per server plus one."""
    dep = k8s[("Deployment", "persia-serving")]
    assert dep["spec"]["replicas"] == 2
    ns = build_parser().parse_args(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert ns.embeddings == "replica" and ns.role == "api"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    svc = k8s[("Service", "persia-serving")]
    assert svc["spec"]["selector"].items() <= labels.items()
    control = k8s[("Deployment", "persia-api")]["spec"]["template"]["metadata"]["labels"]
    assert not svc["spec"]["selector"].items() <= control.items()
    mounts = {m["name"]: m for m in
              dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["data"].get("readOnly") is True
    servers = replicas(k8s[("StatefulSet", "persia-embedding-server")])
    topic = k8s[("KafkaTopic", "synthetic-ctr-model-updates")]["spec"]
    gc = global_config((TOPOLOGY / "global_config.yml").read_text())
    assert topic["topicName"] == f"{gc.kafka.job_name}.model.updates"
    assert topic["partitions"] == servers + 1


def test_k8s_mounts_the_role_secret_in_every_pod_and_confines_checkpoints(k8s, tmp_path):
    """The role secret is a Secret mounted as a file in every pod (never inline in the
    environment); servers and workers listen on 0.0.0.0 only with it."""
    secret = k8s[("Secret", "persia-role-secret")]
    assert set(secret["stringData"]) == {"secret"}
    sample = tmp_path / "secret"
    sample.write_text(SAMPLES["PERSIA_ROLE_SECRET"])
    pods = []
    for role, reps in k8s_roles(k8s).items():
        for ns, env, c, doc in reps:
            assert SECRET_ENV not in env, f"{role}: the secret stays out of the environment"
            (vol,) = [v for v in pod_spec(doc)["volumes"]
                      if v.get("secret", {}).get("secretName") == "persia-role-secret"]
            (item,) = vol["secret"]["items"]
            assert item["key"] == "secret"
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
            assert mount["readOnly"] is True
            assert env[SECRET_FILE_ENV] == f"{mount['mountPath']}/{item['path']}", role
            pods.append((ns, env))
    assert {ns.role for ns, _ in pods} == ROLES
    check_role_security(pods, sample, "k8s")


def test_k8s_pods_resources_grace_metrics_and_shared_storage(k8s):
    data_mounts = set()
    for role, reps in k8s_roles(k8s).items():
        ns, env, c, doc = reps[0]
        spec, meta = pod_spec(doc), doc["spec"]["template"]["metadata"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (role, kind)
        assert spec["terminationGracePeriodSeconds"] >= 30, role
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == UID, role
        scrape_port = ns.port if role == "api" else getattr(ns, "metrics_port", None)
        if scrape_port is not None:
            ann = meta["annotations"]
            assert ann["prometheus.io/scrape"] == "true", role
            assert ann["prometheus.io/port"] == str(scrape_port), role
            assert scrape_port in [p["containerPort"] for p in c["ports"]], role
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in spec["volumes"] if "persistentVolumeClaim" in v}
        for m in c["volumeMounts"]:
            if m["name"] in claims:
                assert ("PersistentVolumeClaim", claims[m["name"]]) in k8s
                data_mounts.add((role, m["mountPath"]))
                for var in ("PERSIA_CHECKPOINT_DIR", "PERSIA_CKPT_DIR", "PERSIA_OUTPUT_DIR"):
                    if var in env:
                        assert env[var].startswith(m["mountPath"] + "/"), (role, var)
    assert {r for r, _ in data_mounts} == {"embedding-server", "api", "nn-worker"}
    assert len({p for _, p in data_mounts}) == 1, "checkpoint paths are sent between roles"


# ------------------------------------------------------------------------- Procfile
def honcho_env() -> dict[str, str]:
    """deploy/honcho.env as honcho reads it: KEY=value lines, nothing expanded."""
    env = {}
    for line in (DEPLOY / "honcho.env").read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z_0-9]+)=(.*)", line)
        if m:
            env[m.group(1)] = m.group(2)
    return env


def test_procfile_runs_every_role_broker_less_on_distinct_local_ports():
    env = honcho_env()
    procs = {}
    for line in (DEPLOY / "Procfile").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, _, cmd = line.partition(":")
        lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        argv = tokens[1:next((i for i, t in enumerate(tokens) if t in ("&&", ";", "||", "|")),
                             len(tokens))]
        assert tokens[0] == "stream-persia", name
        procs[name] = parse_cli(argv, env)
        assert name.startswith(procs[name].role), name

    assert {ns.role for ns in procs.values()} == ROLES
    assert env["KAFKA_BOOTSTRAP_SERVERS"] == ""
    assert all(getattr(ns, "kafka", None) is None for ns in procs.values())
    ports = [p for ns in procs.values()
             for p in (getattr(ns, "port", None), getattr(ns, "metrics_port", None),
                       getattr(ns, "master_port", None)) if p]
    assert len(ports) == len(set(ports)) == 10, "every listener needs its own port"
    for role, var in (("embedding-server", "PERSIA_EMBEDDING_SERVERS"),
                      ("embedding-worker", "PERSIA_EMBEDDING_WORKERS")):
        reps = _replicas({n: (ns, {}, None) for n, ns in procs.items()}, role)
        assert addresses(env[var]) == [f"{ns.host}:{ns.port}" for _, ns, _ in reps]
    for ns in procs.values():
        if ns.role in ("nn-worker", "data-loader"):
            assert repo_path(ns.entry).is_file()
        if ns.role == "api":
            assert ns.host == "127.0.0.1" and "PERSIA_API_TOKEN" not in env
    for var in ("PERSIA_EMBEDDING_CONFIG", "PERSIA_GLOBAL_CONFIG"):
        assert repo_path(env[var]).parent == TOPOLOGY and repo_path(env[var]).is_file()


def test_procfile_roles_share_a_role_secret_file_and_a_checkpoint_root(tmp_path,
                                                                       monkeypatch):
    """Loopback and the same-host Unix sockets are open to every local user: the Procfile
    job holds a role secret too, from a file made once (its path relative to the repo)."""
    env = honcho_env()
    assert env[SECRET_FILE_ENV].startswith("runs/") and SECRET_ENV not in env
    monkeypatch.chdir(REPO)      # honcho runs from the repository root
    procs = []
    for line in (DEPLOY / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            argv = shlex.split(line.partition(":")[2].split("&&")[0])[1:]
            procs.append((parse_cli(argv, env), env))
    sample = tmp_path / "secret"
    sample.write_text(SAMPLES["PERSIA_ROLE_SECRET"])
    check_role_security(procs, sample, "Procfile")
    text = (DEPLOY / "Procfile").read_text() + (DEPLOY / "honcho.env").read_text()
    assert f"openssl rand -hex 32 > {env[SECRET_FILE_ENV]}" in text


# ------------------------------------------------------------------------- image
def test_dockerfile_installs_cpu_torch_first_and_runs_as_a_user():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in lines
    assert "ARG TORCH_VERSION=2.13.0" in lines
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in lines
    runtime = lines[max(i for i, ln in enumerate(lines) if ln.startswith("FROM ")):]
    installs = [ln for ln in runtime if ln.startswith("RUN pip install")]
    assert "torch==${TORCH_VERSION}" in installs[0] and "${TORCH_INDEX}" in installs[0]
    assert "/wheels/" in installs[1]
    assert f"USER {UID}" in runtime and f"--uid {UID}" in text
    assert runtime[-2:] == ['ENTRYPOINT ["stream-persia"]', 'CMD ["--help"]']

    ignored = [p for p in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    copied = [src for ln in lines if ln.startswith("COPY ") and "--from" not in ln
              for src in ln.split()[1:-1]]
    assert "topologies" in copied
    for src in copied:
        assert (REPO / src).exists(), src
        assert src not in ignored, f"{src} is copied but excluded from the build context"
