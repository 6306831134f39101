"""The API token and the role secret, followed from where a user creates them to the code
that reads them, in deploy/'s compose file and Kubernetes manifests.

The checkers do what Docker and the kubelet would do with the files, then call the code:

- the secrets are the ones ``deploy/README.md`` tells the user to create (``kubectl create
  secret generic NAME --from-literal=KEY=...``; ``echo "VAR=..." >> deploy/.env`` for
  compose), each given a distinct sample value;
- compose interpolates ``${VAR:?...}`` / ``${VAR:-default}`` and mounts ``secrets:`` at
  ``/run/secrets/<name>``; the kubelet resolves ``secretKeyRef`` and projects a Secret
  volume's ``items`` (every key without them) as files under the ``mountPath``. Those files
  are written under a temporary folder and the environment's paths pointed at them;
- each role's environment then goes through :meth:`RoleSecret.from_env` (every role) and
  :meth:`ApiSettings.from_env` (the API), the functions the processes call at start, so
  the variable names are the code's, not a list kept here.

Each checker returns the problems it found (an empty list when the wiring holds), so a test
can also run it on a broken copy and see the typo named.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from stream_persia.api.settings import ApiSettings

from stream_persia.errors import ConfigError
from stream_persia.rpc.auth import RoleSecret

IMAGE = "stream-persia"
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")
#: an environment variable or config key that holds a secret itself (``*_FILE`` names a file)
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY)$", re.IGNORECASE)


@dataclass
class Pod:
    """One stream-persia process as it would start: where it is declared, its arguments,
    and its environment with secret files already on this machine."""

    where: str
    argv: list[str]
    env: dict[str, str]

    @property
    def role(self) -> str:
        return self.argv[1] if self.argv[:1] == ["launch"] and len(self.argv) > 1 else "?"

    @property
    def host(self) -> str | None:
        return self.argv[self.argv.index("--host") + 1] if "--host" in self.argv else None


def sample(*names: str) -> str:
    """A sample secret value, distinct per secret (and long enough for a role secret)."""
    return "sample-" + "-".join(names) + "-0123456789abcdef"


def readme_k8s_secrets(readme: str) -> dict[str, set[str]]:
    """Secret name -> keys, from the README's ``kubectl create secret generic`` commands."""
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"create secret generic ([\w.-]+)((?: --from-literal=[\w.-]+=\S+)+)",
                         readme):
        keys = re.findall(r"--from-literal=([\w.-]+)=", m.group(2))
        out.setdefault(m.group(1), set()).update(keys)
    return out


def readme_compose_env(readme: str) -> set[str]:
    """The variables the README writes into ``deploy/.env`` for compose."""
    return set(re.findall(r"echo \"(\w+)=[^\"]*\" >>? deploy/\.env", readme))


def _literal_secrets(where: str, env: dict[str, Any]) -> Iterator[str]:
    for name, value in env.items():
        if SECRET_NAME.search(name) and value not in (None, ""):
            yield f"{where}: {name} carries a literal value; mount the secret or interpolate it"


def _config_secrets(where: str, node: Any, path: str = "") -> Iterator[str]:
    """Keys of a config file (YAML) that hold a secret inline."""
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}.{key}" if path else str(key)
            if SECRET_NAME.search(str(key)) and isinstance(value, str | int) and value != "":
                yield f"{where}: {sub} holds a secret inline; use its *_file key"
            yield from _config_secrets(where, value, sub)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _config_secrets(where, value, f"{path}[{i}]")


def check_pods(pods: list[Pod], where: str) -> list[str]:
    """Every role resolves the job's one role secret; every API its token, not the same."""
    problems: list[str] = []
    role_secrets: dict[str, str] = {}
    tokens: dict[str, str] = {}
    for pod in pods:
        try:
            secret = RoleSecret.from_env(pod.env)
        except ConfigError as exc:
            problems.append(f"{pod.where}: {exc}")
        else:
            if secret is None:
                problems.append(f"{pod.where}: no role secret reaches the {pod.role} "
                                "(neither PERSIA_ROLE_SECRET nor PERSIA_ROLE_SECRET_FILE)")
            else:
                role_secrets[pod.where] = secret.value
        if pod.role != "api":
            continue
        try:
            with mock.patch.dict(os.environ, pod.env, clear=True):
                settings = ApiSettings.from_env(host=pod.host)
                settings.check_bind()
        except ConfigError as exc:
            problems.append(f"{pod.where}: {exc}")
            continue
        if settings.token is None:
            problems.append(f"{pod.where}: no API token reaches the API")
        else:
            tokens[pod.where] = settings.token
    if not pods:
        problems.append(f"{where}: no stream-persia process found")
    if len(set(role_secrets.values())) > 1:
        problems.append(f"{where}: the roles hold different role secrets "
                        f"({_by_value(role_secrets)})")
    if not tokens and not any(p.role == "api" for p in pods):
        problems.append(f"{where}: no API process found")
    if len(set(tokens.values())) > 1:
        problems.append(f"{where}: the API processes hold different tokens "
                        f"({_by_value(tokens)})")
    if set(tokens.values()) & set(role_secrets.values()):
        problems.append(f"{where}: the API token and the role secret are the same secret")
    return problems


def _by_value(found: dict[str, str]) -> str:
    groups: dict[str, list[str]] = {}
    for who, value in found.items():
        groups.setdefault(value, []).append(who)
    return "; ".join(", ".join(g) for g in groups.values())


# ------------------------------------------------------------------------- Kubernetes
def kustomized_docs(k8s_dir: Path) -> list[tuple[str, dict]]:
    """(file, document) of every resource the kustomization applies."""
    kust = yaml.safe_load((k8s_dir / "kustomization.yaml").read_text())
    return [(name, d) for name in kust["resources"]
            for d in yaml.safe_load_all((k8s_dir / name).read_text()) if d]


def k8s_secret_problems(k8s_dir: Path, readme: str, files: Path) -> list[str]:
    """Problems of the API token's and the role secret's wiring in ``k8s_dir``.

    ``files`` is an empty folder where the projected secret files are written.
    """
    problems: list[str] = []
    created = readme_k8s_secrets(readme)
    if not created:
        problems.append("deploy/README.md: no `kubectl create secret generic` command")
    example = {d["metadata"]["name"]: d for d in
               yaml.safe_load_all((k8s_dir / "secret.example.yaml").read_text()) if d}
    for name, d in example.items():
        data = {**d.get("stringData", {}), **d.get("data", {})}
        if set(data) != created.get(name):
            problems.append(f"secret.example.yaml: Secret {name} has keys {sorted(data)}, "
                            f"the README creates {sorted(created.get(name, ()))}")
        problems += [f"secret.example.yaml: {name}.{k} is not a placeholder"
                     for k, v in data.items() if "REPLACE" not in str(v)]
    if set(example) != set(created):
        problems.append(f"secret.example.yaml templates {sorted(example)}, the README "
                        f"creates {sorted(created)}")

    pods = []
    docs = kustomized_docs(k8s_dir)
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for _, d in docs
                   if d["kind"] == "ConfigMap"}
    for file, doc in docs:
        where = f"{file}: {doc['kind']} {doc['metadata']['name']}"
        if doc["kind"] == "Secret":
            problems.append(f"{where}: a Secret applied from the repository is no secret")
        if doc["kind"] == "ConfigMap":
            for key, text in doc.get("data", {}).items():
                if key.endswith((".yml", ".yaml")):
                    problems += _config_secrets(f"{where} {key}", yaml.safe_load(text))
        if doc["kind"] not in WORKLOADS:
            continue
        spec = doc["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            pod = _k8s_pod(f"{where} container {c['name']}", c, spec, created, config_maps,
                           files, problems)
            if pod is not None:
                pods.append(pod)
    return problems + check_pods(pods, "k8s")


def _k8s_pod(where: str, c: dict, spec: dict, created: dict[str, set[str]],
             config_maps: dict[str, dict[str, str]], files: Path,
             problems: list[str]) -> Pod | None:
    """The container's environment as the kubelet would give it, mounted secrets and
    config maps as local files."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounted: dict[str, str] = {}          # path in the pod -> a file here
    for m in c.get("volumeMounts", []):
        vol = volumes.get(m["name"])
        if vol is None:
            problems.append(f"{where}: mounts volume {m['name']!r}, which the pod lacks")
            continue
        if "configMap" in vol:
            for key, text in config_maps.get(vol["configMap"]["name"], {}).items():
                local = files / f"{len(list(files.iterdir()))}-{key}"
                local.write_text(text)
                mounted[f"{m['mountPath'].rstrip('/')}/{key}"] = str(local)
        if "secret" not in vol:
            continue
        name = vol["secret"].get("secretName")
        if name not in created:
            problems.append(f"{where}: volume {vol['name']!r} is Secret {name!r}, which the "
                            f"README does not create ({sorted(created)})")
            continue
        if m.get("readOnly") is not True:
            problems.append(f"{where}: Secret {name} is mounted writable")
        items = vol["secret"].get("items") or [{"key": k, "path": k} for k in sorted(created[name])]
        for item in items:
            if item["key"] not in created[name]:
                problems.append(f"{where}: volume {vol['name']!r} projects key "
                                f"{item['key']!r} of Secret {name}, which has "
                                f"{sorted(created[name])}")
                continue
            local = files / f"{len(list(files.iterdir()))}-{name}-{item['key']}"
            local.write_text(sample(name, item["key"]) + "\n")
            mounted[f"{m['mountPath'].rstrip('/')}/{item['path']}"] = str(local)

    env: dict[str, str] = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            if not e["name"].endswith("_FILE"):
                problems += _literal_secrets(where, {e["name"]: e["value"]})
            env[e["name"]] = str(e["value"])
        elif "secretKeyRef" in ref:
            name, key = ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
            if key not in created.get(name, ()):
                problems.append(f"{where}: {e['name']} reads key {key!r} of Secret {name!r}, "
                                f"which the README does not create")
            env[e["name"]] = sample(name, key)
        else:
            env[e["name"]] = "0"          # downward API: a replica index
    env = {k: mounted.get(v, v) for k, v in env.items()}
    image = c["image"].split(":")[0]
    if image != IMAGE:
        return None
    return Pod(where, [str(a) for a in c.get("command", [])[1:] + c.get("args", [])], env)


# ------------------------------------------------------------------------- compose
_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?+])([^}]*))?\}|\$(\w+)|\$\$")


def compose_interpolate(value: Any, provided: set[str], where: str,
                        problems: list[str]) -> Any:
    """Compose's interpolation with the README's variables set to samples; a required
    ``${VAR:?...}`` that nothing sets is a problem."""
    if isinstance(value, dict):
        return {k: compose_interpolate(v, provided, where, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [compose_interpolate(v, provided, where, problems) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2) or "", m.group(3) or ""
        if name in provided:
            return arg if op.endswith("+") else sample(name)
        if op.endswith("?"):
            problems.append(f"{where}: requires {name}, which the README's deploy/.env "
                            f"does not set ({sorted(provided)})")
            return ""
        return arg if op.endswith("-") else ""
    return _VAR.sub(sub, value)


def compose_secret_problems(compose_file: Path, readme: str, files: Path) -> list[str]:
    """Problems of the API token's and the role secret's wiring in a compose file."""
    problems: list[str] = []
    provided = readme_compose_env(readme)
    if not provided:
        problems.append("deploy/README.md: no `echo \"VAR=...\" >> deploy/.env` line")
    raw = yaml.safe_load(compose_file.read_text())
    doc = compose_interpolate(raw, provided, compose_file.name, problems)
    top_secrets = doc.get("secrets") or {}
    pods = []
    for name, svc in doc["services"].items():
        if not str(svc.get("image", "")).startswith(IMAGE + ":"):
            continue
        where = f"{compose_file.name}: service {name}"
        raw_env = _env_dict(raw["services"][name].get("environment"))
        problems += _literal_secrets(where, {k: v for k, v in raw_env.items()
                                             if "$" not in str(v) and not k.endswith("_FILE")})
        mounted: dict[str, str] = {}
        for s in svc.get("secrets", []):
            source, target = (s, s) if isinstance(s, str) else (s["source"], s.get("target"))
            spec = top_secrets.get(source)
            if spec is None:
                problems.append(f"{where}: uses secret {source!r}, which is not declared")
                continue
            var = spec.get("environment")
            if var is not None and var not in provided:
                problems.append(f"{where}: secret {source!r} comes from {var}, which the "
                                f"README's deploy/.env does not set")
                continue
            local = files / f"{len(list(files.iterdir()))}-{source}"
            local.write_text(sample(var or source) + "\n")
            path = target if target and target.startswith("/") else \
                f"/run/secrets/{target or source}"
            mounted[path] = str(local)
        for cfg in svc.get("configs", []):
            source = cfg if isinstance(cfg, str) else cfg["source"]
            target = f"/{source}" if isinstance(cfg, str) else cfg.get("target", f"/{source}")
            file = (doc.get("configs") or {}).get(source, {}).get("file")
            if file is not None:
                mounted[target] = str((compose_file.parent / file).resolve())
        env = {k: mounted.get(str(v), str(v)) for k, v in _env_dict(svc.get("environment")).items()}
        pods.append(Pod(where, [str(a) for a in svc.get("command", [])], env))
    return problems + check_pods(pods, "compose")


def _env_dict(env: Any) -> dict[str, Any]:
    """Compose's ``environment`` as a mapping (it may also be a list of ``KEY=value``)."""
    if isinstance(env, list):
        return dict(item.partition("=")[::2] for item in env)
    return dict(env or {})
