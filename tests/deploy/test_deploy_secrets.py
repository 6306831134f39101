"""The API token and the role secret reach every process that needs them, in compose and on
Kubernetes, under the names the code reads; no manifest carries a secret's value.

:mod:`deploy_secrets` resolves the secrets the README has the user create as Docker and
the kubelet would, then starts each role's settings from the result (``RoleSecret.from_env``
and ``ApiSettings.from_env``). The checker runs on the real files, and on copies with one
typo each, to show that it names the typo (the real files are never edited).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from deploy_secrets import compose_secret_problems, k8s_secret_problems

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
README = (DEPLOY / "README.md").read_text()


def test_k8s_token_and_role_secret_reach_every_pod(tmp_path):
    assert k8s_secret_problems(DEPLOY / "k8s", README, tmp_path) == []


def test_compose_token_and_role_secret_reach_every_service(tmp_path):
    assert compose_secret_problems(DEPLOY / "docker-compose.yml", README, tmp_path) == []


def _mutate(path: Path, old: str, new: str, count: int | None = 1) -> None:
    text = path.read_text()
    assert old in text and (count is None or text.count(old) == count), (path.name, old)
    path.write_text(text.replace(old, new))


#: (file under deploy/k8s, text, replacement, fragment the problem names)
K8S_TYPOS = [
    pytest.param("api.yaml", "items: [{key: token, path: token}]",
                 "items: [{key: tokn, path: token}]", "projects key 'tokn'",
                 id="secret key renamed in a volume"),
    pytest.param("embedding-worker.yaml", "name: PERSIA_ROLE_SECRET_FILE",
                 "name: PERSIA_ROLE_SECRETS_FILE",
                 "no role secret reaches the embedding-worker",
                 id="env var name typo"),
    pytest.param("serving.yaml", "name: PERSIA_API_TOKEN_FILE", "name: PERSIA_API_TOKEN_PATH",
                 "would listen on 0.0.0.0 without a token",
                 id="token env var the code never reads"),
    pytest.param("data-loader.yaml", "mountPath: /var/run/secrets/persia-role",
                 "mountPath: /var/run/secret/persia-role", "cannot read",
                 id="mount path and env path disagree"),
    pytest.param("nn-worker.yaml", "secretName: persia-role-secret",
                 "secretName: persia-role-secrets", "which the README does not create",
                 id="secret name typo"),
    pytest.param("embedding-server.yaml",
                 "secretName: persia-role-secret\n            items: [{key: secret, path: secret}]",
                 "secretName: persia-api-token\n            items: [{key: token, path: secret}]",
                 "different role secrets", id="the token mounted as the role secret"),
    pytest.param("serving.yaml",
                 "- name: PERSIA_API_TOKEN_FILE\n"
                 "              value: /var/run/secrets/persia/token",
                 "- name: PERSIA_API_TOKEN\n              value: 3f6c0d2a9b8e7f1c",
                 "carries a literal value", id="literal token in the environment"),
    pytest.param("kustomization.yaml", "  - configmap.yaml",
                 "  - configmap.yaml\n  - secret.example.yaml",
                 "a Secret applied from the repository", id="secret template applied"),
    pytest.param("configmap.yaml", "    api:\n", "    api:\n      token: 3f6c0d2a9b8e7f1c\n",
                 "api.token holds a secret inline", id="token inline in the config"),
]


@pytest.mark.parametrize(("file", "old", "new", "named"), K8S_TYPOS)
def test_k8s_checker_names_a_wiring_typo(tmp_path, file, old, new, named):
    copy = tmp_path / "k8s"
    shutil.copytree(DEPLOY / "k8s", copy)
    _mutate(copy / file, old, new)
    (tmp_path / "files").mkdir()
    problems = k8s_secret_problems(copy, README, tmp_path / "files")
    assert any(named in p for p in problems), problems


def test_k8s_checker_names_a_readme_that_creates_another_key(tmp_path):
    readme = README.replace("persia-api-token --from-literal=token=",
                            "persia-api-token --from-literal=api-token=")
    assert readme != README
    problems = k8s_secret_problems(DEPLOY / "k8s", readme, tmp_path)
    assert any("projects key 'token' of Secret persia-api-token" in p for p in problems), \
        problems
    assert any("secret.example.yaml: Secret persia-api-token has keys" in p for p in problems)


#: (text in docker-compose.yml, replacement, how many, fragment the problem names)
COMPOSE_TYPOS = [
    pytest.param("  PERSIA_ROLE_SECRET: ${PERSIA_ROLE_SECRET:?",
                 "  PERSIA_ROLE_SECRT: ${PERSIA_ROLE_SECRET:?", 1,
                 "no role secret reaches the embedding-server", id="env var name typo"),
    pytest.param("PERSIA_API_TOKEN: ${PERSIA_API_TOKEN:?",
                 "PERSIA_API_TOKEN: ${PERSIA_API_TOKN:?", 1, "requires PERSIA_API_TOKN",
                 id="interpolated variable typo"),
    pytest.param("PERSIA_API_TOKEN: ${PERSIA_API_TOKEN:?set PERSIA_API_TOKEN (export it, or put "
                 "it in deploy/.env)}", "PERSIA_API_TOKEN: 3f6c0d2a9b8e7f1c", 1,
                 "carries a literal value", id="literal token"),
    pytest.param("PERSIA_API_TOKEN: ${PERSIA_API_TOKEN:?",
                 "PERSIA_API_TOKEN: ${PERSIA_ROLE_SECRET:?", 1,
                 "the API token and the role secret are the same", id="token is the role secret"),
]


@pytest.mark.parametrize(("old", "new", "count", "named"), COMPOSE_TYPOS)
def test_compose_checker_names_a_wiring_typo(tmp_path, old, new, count, named):
    (tmp_path / "deploy").mkdir()
    (tmp_path / "topologies").symlink_to(REPO / "topologies")   # the configs' ../ paths
    copy = tmp_path / "deploy" / "docker-compose.yml"
    shutil.copy(DEPLOY / "docker-compose.yml", copy)
    _mutate(copy, old, new, count)
    (tmp_path / "files").mkdir()
    problems = compose_secret_problems(copy, README, tmp_path / "files")
    assert any(named in p for p in problems), problems


def test_compose_checker_follows_compose_secrets_files(tmp_path):
    """A service may take the role secret as a compose secret (a file under /run/secrets)
    instead of the environment; the checker follows it, and names a wrong target."""
    (tmp_path / "deploy").mkdir()
    (tmp_path / "topologies").symlink_to(REPO / "topologies")
    copy = tmp_path / "deploy" / "docker-compose.yml"
    shutil.copy(DEPLOY / "docker-compose.yml", copy)
    _mutate(copy, "  PERSIA_ROLE_SECRET: ${PERSIA_ROLE_SECRET:?set PERSIA_ROLE_SECRET (export "
                  "it, or put it in deploy/.env)}",
            "  PERSIA_ROLE_SECRET_FILE: /run/secrets/role_secret")
    _mutate(copy, "  stop_grace_period: 60s ",
            "  secrets: [role_secret]\n  stop_grace_period: 60s ")
    text = copy.read_text() + "\nsecrets:\n  role_secret:\n    environment: PERSIA_ROLE_SECRET\n"
    copy.write_text(text)
    (tmp_path / "files").mkdir()
    assert compose_secret_problems(copy, README, tmp_path / "files") == []

    copy.write_text(text.replace("secrets: [role_secret]",
                                 "secrets: [{source: role_secret, target: role-secret}]"))
    (tmp_path / "files2").mkdir()
    problems = compose_secret_problems(copy, README, tmp_path / "files2")
    assert any("/run/secrets/role_secret" in p and "cannot read" in p for p in problems), \
        problems


def test_the_files_the_readme_writes_secrets_into_stay_out_of_git_and_the_image():
    written = set(re.findall(r"openssl rand -hex 32\)\" >>? (\S+)", README))
    assert written == {"deploy/.env"}, written
    ignored_in_context = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for path in written:
        proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", path])
        assert proc.returncode == 0, f"{path} holds secrets but git would commit it"
        assert path.split("/")[0] in ignored_in_context, f"{path} would enter the image"
