"""deploy/'s Kubernetes manifests and compose file, validated against their schemas.

What is validated, and against what (all offline: the schemas ship in the test extras'
packages, pinned in pyproject.toml):

- **Kubernetes resources** (every document the kustomization applies, and the Secret
  templates): the OpenAPI schemas of Kubernetes, as JSON schemas, bundled by
  ``kubernetes-validate``, in their *strict* form (an unknown field is an error, as with
  ``kubectl apply --validate=strict``), for the oldest version deploy/README.md supports
  ("Kubernetes ≥ 1.28") and the newest the package bundles. Not validated: what only an API
  server checks (admission, immutable fields, names being free), nor whether a cluster has
  the storage class or Strimzi.
- **Strimzi resources** (Kafka, KafkaNodePool, KafkaTopic of ``kafka.strimzi.io/v1``): their
  CRD schemas are not on a package registry, so :data:`STRIMZI_V1` is a hand-written
  subset of Strimzi's v1 CRDs (0.49 to 1.2 agree on it): the required fields, the enums,
  types and bounds of the fields our manifests set, and every key of the objects we write
  (an unknown key, which the API server would prune silently, is an error here). Not
  validated: fields we do not use, and Strimzi's own checks (listener ports in use, ...).
- **The kustomization**: every resource it lists exists, once, and every manifest in
  deploy/k8s is listed (kustomize itself is not run).
- **The compose file**: the Compose Specification's JSON schema (``compose-spec.json``, the
  schema ``docker compose``'s loader, compose-go, validates every file against), as vendored
  by ``check-jsonschema``; before and after interpolation, as compose does. Then the
  references compose resolves (volumes, configs, secrets, ``depends_on``) are checked to
  point at declared objects. Not run: Docker itself (no engine here).

The command lines in both files are parsed with the real CLI in test_deploy_manifests.py;
the secrets' wiring is test_deploy_secrets.py.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from importlib import resources
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_secrets import compose_interpolate, kustomized_docs, readme_compose_env
from kubernetes_validate.utils import SchemaNotFoundError, all_versions

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
README = (DEPLOY / "README.md").read_text()
STRIMZI_GROUP = "kafka.strimzi.io"


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def readme_min_kubernetes() -> str:
    m = re.search(r"\*\*Kubernetes ≥ (\d+\.\d+)\*\*", README)
    assert m, "deploy/README.md names no minimum Kubernetes version (**Kubernetes ≥ 1.NN**)"
    return m.group(1)


#: the README's minimum and the newest release whose schemas kubernetes-validate bundles
K8S_VERSIONS = sorted({readme_min_kubernetes(), ".".join(all_versions()[-1].split(".")[:2])},
                      key=_minor)


def k8s_docs(k8s_dir: Path = K8S) -> list[tuple[str, dict]]:
    """Every document kubectl would apply, plus the Secret templates."""
    return kustomized_docs(k8s_dir) + [
        ("secret.example.yaml", d)
        for d in yaml.safe_load_all((k8s_dir / "secret.example.yaml").read_text()) if d]


def k8s_schema_errors(docs: list[tuple[str, dict]], version: str) -> list[str]:
    errors = []
    for file, doc in docs:
        if doc["apiVersion"].split("/")[0] == STRIMZI_GROUP:
            continue
        where = f"{file}: {doc['kind']} {doc['metadata']['name']} (Kubernetes {version})"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except SchemaNotFoundError as exc:
            errors.append(f"{where}: {exc.message}")
    return errors


def test_the_readme_versions_are_bundled():
    assert _minor(K8S_VERSIONS[0]) >= (1, 28)
    bundled = {_minor(v) for v in all_versions()}
    assert all(_minor(v) in bundled for v in K8S_VERSIONS), (K8S_VERSIONS, sorted(bundled))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_match_the_kubernetes_openapi_schemas(version):
    docs = k8s_docs()
    kinds = {d["kind"] for _, d in docs if not d["apiVersion"].startswith(STRIMZI_GROUP)}
    assert {"Deployment", "StatefulSet", "Job", "Service", "ConfigMap", "Secret",
            "PersistentVolumeClaim"} <= kinds
    assert k8s_schema_errors(docs, version) == []


#: (file, text, replacement, fragment of the error): what strict validation catches
K8S_TYPOS = [
    pytest.param("api.yaml", "secretName: persia-api-token", "secretname: persia-api-token",
                 "'secretname' was unexpected", id="field name case"),
    pytest.param("embedding-server.yaml", "containerPort: 9000", "containerPort: \"9000\"",
                 "is not of type 'integer'", id="port as a string"),
    pytest.param("api.yaml", "    - name: http\n      port: 8080\n      targetPort: http",
                 "    - name: http\n      targetPort: http", "'port' is a required property",
                 id="required field"),
    pytest.param("storage.yaml", "accessModes:", "accesModes:", "'accesModes' was unexpected",
                 id="misspelt field"),
]


@pytest.mark.parametrize(("file", "old", "new", "named"), K8S_TYPOS)
def test_k8s_schema_validation_names_a_typo(tmp_path, file, old, new, named):
    copy_dir = tmp_path / "k8s"
    shutil.copytree(K8S, copy_dir)
    text = (copy_dir / file).read_text()
    assert old in text, (file, old)
    (copy_dir / file).write_text(text.replace(old, new, 1))
    errors = k8s_schema_errors([(f, d) for f, d in k8s_docs(copy_dir) if f == file],
                               K8S_VERSIONS[0])
    assert len(errors) == 1 and named in errors[0] and file in errors[0], errors


def test_the_kustomization_lists_every_manifest_once_and_each_exists():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kust) <= {"apiVersion", "kind", "labels", "resources", "images"}, \
        "a kustomization key this test does not know: check it against kustomize's docs"
    listed = kust["resources"]
    assert len(listed) == len(set(listed))
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists {name}, which is missing"
    on_disk = {f.name for f in K8S.iterdir() if f.suffix in (".yaml", ".yml")}
    assert set(listed) == on_disk - {"kustomization.yaml", "secret.example.yaml"}


# ------------------------------------------------------------------------- Strimzi
def _obj(props: dict, required: tuple[str, ...] = ()) -> dict:
    """An object schema that allows exactly ``props`` (Strimzi's names at that level)."""
    return {"type": "object", "properties": props, "required": list(required),
            "additionalProperties": False}


_ANY_OBJ = {"type": "object"}
_META = {"type": "object", "required": ["name"],
         "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}}}
_VOLUME = {"type": "object", "required": ["type"], "additionalProperties": False,
           "properties": {"type": {"enum": ["ephemeral", "persistent-claim"]},
                          "id": {"type": "integer", "minimum": 0},
                          "size": {"type": "string"}, "sizeLimit": {"type": "string"},
                          "class": {"type": "string"}, "deleteClaim": {"type": "boolean"},
                          "kraftMetadata": {"enum": ["shared"]}, "selector": _ANY_OBJ,
                          "volumeAttributesClass": {"type": "string"}}}

#: kind -> a subset of its ``kafka.strimzi.io/v1`` CRD schema (Strimzi 0.49 to 1.2)
STRIMZI_V1: dict[str, dict] = {
    "Kafka": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
              "properties": {"metadata": _META, "spec": _obj({
                  "kafka": _obj({
                      "version": {"type": "string"}, "metadataVersion": {"type": "string"},
                      "image": {"type": "string"},
                      "listeners": {"type": "array", "minItems": 1, "items": _obj({
                          "name": {"type": "string", "pattern": "^[a-z0-9]{1,11}$"},
                          "port": {"type": "integer", "minimum": 9092},
                          "type": {"enum": ["internal", "route", "tlsroute", "loadbalancer",
                                            "nodeport", "ingress", "cluster-ip"]},
                          "tls": {"type": "boolean"}, "authentication": _ANY_OBJ,
                          "configuration": _ANY_OBJ, "networkPolicyPeers": {"type": "array"},
                      }, ("name", "port", "type", "tls"))},
                      "config": _ANY_OBJ, "authorization": _ANY_OBJ, "rack": _ANY_OBJ,
                      "brokerRackInitImage": {"type": "string"}, "livenessProbe": _ANY_OBJ,
                      "readinessProbe": _ANY_OBJ, "jvmOptions": _ANY_OBJ,
                      "jmxOptions": _ANY_OBJ, "metricsConfig": _ANY_OBJ, "logging": _ANY_OBJ,
                      "template": _ANY_OBJ, "tieredStorage": _ANY_OBJ, "quotas": _ANY_OBJ,
                  }, ("listeners",)),
                  "entityOperator": _obj({"topicOperator": _ANY_OBJ, "userOperator": _ANY_OBJ,
                                          "template": _ANY_OBJ}),
                  "clusterCa": _ANY_OBJ, "clientsCa": _ANY_OBJ, "cruiseControl": _ANY_OBJ,
                  "kafkaExporter": _ANY_OBJ, "maintenanceTimeWindows": {"type": "array"},
              }, ("kafka",))}},
    "KafkaNodePool": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                      "properties": {"metadata": _META, "spec": _obj({
                          "replicas": {"type": "integer", "minimum": 0},
                          "roles": {"type": "array", "minItems": 1,
                                    "items": {"enum": ["controller", "broker"]}},
                          "storage": {**_VOLUME, "properties": {
                              **_VOLUME["properties"],
                              "type": {"enum": ["ephemeral", "persistent-claim", "jbod"]},
                              "volumes": {"type": "array", "items": _VOLUME}}},
                          "resources": _ANY_OBJ, "jvmOptions": _ANY_OBJ, "template": _ANY_OBJ,
                      }, ("replicas", "storage", "roles"))}},
    # partitions and replicas are optional in the CRD (the broker's defaults); ours must
    # set them: auto-creation is off and the workers split the partitions
    "KafkaTopic": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                   "properties": {"metadata": _META, "spec": _obj({
                       "topicName": {"type": "string"},
                       "partitions": {"type": "integer", "minimum": 1},
                       "replicas": {"type": "integer", "minimum": 1, "maximum": 32767},
                       "config": _ANY_OBJ,
                   }, ("topicName", "partitions", "replicas"))}},
}


def strimzi_errors(docs: list[tuple[str, dict]]) -> list[str]:
    errors = []
    for file, doc in docs:
        if doc["apiVersion"].split("/")[0] != STRIMZI_GROUP:
            continue
        where = f"{file}: {doc['kind']} {doc['metadata']['name']}"
        if doc["apiVersion"] != f"{STRIMZI_GROUP}/v1":
            errors.append(f"{where}: {doc['apiVersion']} (Strimzi 1.0 serves only v1)")
        if doc["kind"] not in STRIMZI_V1:
            errors.append(f"{where}: a Strimzi kind this test does not check")
            continue
        for e in jsonschema.Draft202012Validator(STRIMZI_V1[doc["kind"]]).iter_errors(doc):
            errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
    return errors


def test_strimzi_resources_have_the_crds_required_fields_and_known_keys():
    docs = k8s_docs()
    assert {d["kind"] for _, d in docs if d["apiVersion"].startswith(STRIMZI_GROUP)} == \
        set(STRIMZI_V1)
    assert strimzi_errors(docs) == []


@pytest.mark.parametrize(("old", "new", "named"), [
    pytest.param("  partitions: 8\n", "  partitons: 8\n", "'partitons' was unexpected",
                 id="misspelt topic field"),
    pytest.param("roles: [controller, broker]", "roles: [controller, brokers]",
                 "'brokers' is not one of", id="node pool role"),
    pytest.param("        type: internal\n        tls: false\n", "        type: internal\n",
                 "'tls' is a required property", id="listener without tls"),
    pytest.param("apiVersion: kafka.strimzi.io/v1\nkind: Kafka\n",
                 "apiVersion: kafka.strimzi.io/v1beta2\nkind: Kafka\n",
                 "Strimzi 1.0 serves only v1",
                 id="removed API version"),
])
def test_strimzi_checks_name_a_typo(tmp_path, old, new, named):
    copy_dir = tmp_path / "k8s"
    shutil.copytree(K8S, copy_dir)
    text = (copy_dir / "kafka.yaml").read_text()
    assert text.count(old) == 1, old
    (copy_dir / "kafka.yaml").write_text(text.replace(old, new))
    errors = strimzi_errors(k8s_docs(copy_dir))
    assert errors and any(named in e for e in errors), errors


# ------------------------------------------------------------------------- compose
def compose_schema() -> dict:
    text = resources.files("check_jsonschema.builtin_schemas.vendor") \
        .joinpath("compose-spec.json").read_text()
    return json.loads(text)


def compose_errors(path: Path) -> list[str]:
    """Schema errors of the file as written and as interpolated, then dangling references."""
    raw = yaml.safe_load(path.read_text())
    problems: list[str] = []
    interpolated = compose_interpolate(copy.deepcopy(raw), readme_compose_env(README),
                                       path.name, problems)
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(
        schema, format_checker=jsonschema.FormatChecker())
    for label, doc in (("as written", raw), ("interpolated", interpolated)):
        for e in validator.iter_errors(doc):
            problems.append(f"{label}: {'.'.join(map(str, e.path))}: {e.message}")
    declared = {kind: set(raw.get(kind) or {}) for kind in ("volumes", "configs", "secrets")}
    for name, svc in interpolated["services"].items():
        for v in svc.get("volumes", []):
            source = v.split(":")[0] if isinstance(v, str) else v.get("source", "")
            if source and not source.startswith((".", "/", "~")) and \
                    source not in declared["volumes"]:
                problems.append(f"services.{name}.volumes: {source!r} is not declared")
        for kind in ("configs", "secrets"):
            for ref in svc.get(kind, []):
                source = ref if isinstance(ref, str) else ref["source"]
                if source not in declared[kind]:
                    problems.append(f"services.{name}.{kind}: {source!r} is not declared")
        deps = svc.get("depends_on", [])
        problems += [f"services.{name}.depends_on: no service {dep!r}" for dep in deps
                     if dep not in interpolated["services"]]
    for name, cfg in (raw.get("configs") or {}).items():
        if "file" in cfg and not (path.parent / cfg["file"]).is_file():
            problems.append(f"configs.{name}: {cfg['file']} does not exist")
    return problems


def test_compose_file_matches_the_compose_specification():
    schema = compose_schema()
    assert schema["title"] == "Compose Specification"
    assert compose_errors(DEPLOY / "docker-compose.yml") == []


@pytest.mark.parametrize(("old", "new", "named"), [
    pytest.param("  stop_grace_period: 60s ", "  stop_grace_periode: 60s ",
                 "'stop_grace_periode' was unexpected", id="misspelt service key"),
    pytest.param("kafka-init: {condition: service_completed_successfully}\n"
                 "      embedding-server-0",
                 "kafka-init: {condition: service_completed}\n      embedding-server-0",
                 "depends_on", id="depends_on condition"),
    pytest.param("      retries: 30\n    restart: unless-stopped",
                 "      retry: 30\n    restart: unless-stopped", "'retry' does not match",
                 id="healthcheck key"),
    pytest.param("volumes: [persia-data:/var/lib/persia]\n    shm_size",
                 "volumes: [persia-dat:/var/lib/persia]\n    shm_size",
                 "'persia-dat' is not declared", id="undeclared volume"),
    pytest.param("      embedding-worker-1: {condition: service_healthy}\n    restart: \"no\"\n\n"
                 "  # Produces", "      embedding-worker-2: {condition: service_healthy}\n"
                 "    restart: \"no\"\n\n  # Produces", "no service 'embedding-worker-2'",
                 id="depends on a missing service"),
])
def test_compose_checks_name_a_typo(tmp_path, old, new, named):
    (tmp_path / "deploy").mkdir()
    (tmp_path / "topologies").symlink_to(REPO / "topologies")   # the configs' ../ paths
    path = tmp_path / "deploy" / "docker-compose.yml"
    text = (DEPLOY / "docker-compose.yml").read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    errors = compose_errors(path)
    assert errors and any(named in e for e in errors), errors
