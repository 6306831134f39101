"""The OpenAPI document is complete (summaries, examples, error responses), and no request,
valid or not, makes the live API answer 5xx.

Two fuzzers: schemathesis (when installed; the test extra should carry it) checks every
operation against the document (status codes, content types, response schemas), and a
built-in hypothesis fuzzer that always runs posts random JSON, random bytes and
near-valid inference bodies to every route, with no, a wrong and the right token.
"""

from __future__ import annotations

import urllib.parse

import httpx
import pytest
from api_helpers import AUTH, TOKEN, settings_for, threaded_job_and_api
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stream_persia.api import create_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _resolve(spec: dict, schema: dict) -> dict:
    for option in schema.get("anyOf", ()):   # an optional body: the model, or null
        if "$ref" in option:
            schema = option
    ref = schema.get("$ref")
    if ref:
        return spec["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    return schema


def test_openapi_is_complete_with_examples():
    spec = create_app(settings_for()).openapi()
    assert spec["info"]["title"] and spec["info"]["description"]
    security = spec["components"]["securitySchemes"]["bearerAuth"]
    assert security == {"type": "http", "scheme": "bearer",
                        "description": security["description"]}
    ops = [(p, m, op) for p, item in spec["paths"].items() for m, op in item.items()]
    assert len(ops) == 17
    for path, method, op in ops:
        where = f"{method.upper()} {path}"
        assert op.get("summary") and op.get("tags"), where
        body = op.get("requestBody", {}).get("content", {}).get("application/json")
        if body is not None:
            schema = _resolve(spec, body["schema"])
            assert schema.get("examples"), f"{where}: request body without examples"
        for code, resp in op["responses"].items():
            content = resp.get("content", {}).get("application/json")
            if content is None or not code.startswith("2"):
                continue
            schema = _resolve(spec, content["schema"])
            assert schema.get("examples"), f"{where} {code}: response without examples"
        if path.startswith("/v1/") and path not in ("/v1/predict", "/v1/model"):
            assert {"bearerAuth": []} in op.get("security", []), where
            assert {"401", "403"} <= set(op["responses"]), where
        if method == "post" and path == "/v1/predict":
            assert {"application/json", "application/msgpack"} <= set(
                op["requestBody"]["content"])
            assert {"413", "415", "422"} <= set(op["responses"])
    assert _resolve(spec, {"$ref": "#/components/schemas/ErrorBody"})["examples"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with threaded_job_and_api(str(tmp_path_factory.mktemp("fuzz")),
                              max_rows_per_request=64) as (url, job):
        yield url


_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4)
                     | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=16)
_finite = st.floats(allow_nan=False, allow_infinity=False)   # JSON has no NaN/Infinity
_id = st.integers(-3, 2**64 + 3) | _finite | st.text(max_size=2) | st.none()
_ids = st.lists(_id | st.lists(_id, max_size=4), max_size=5) | _scalars
_rows = st.lists(st.lists(_finite | st.integers(-5, 5) | st.text(max_size=1),
                          max_size=4) | _finite, max_size=5) | _scalars
_predict = st.fixed_dictionaries(
    {"id_type_features": st.dictionaries(st.sampled_from(["user", "item", "tags", "usr"]),
                                         _ids, max_size=4)},
    optional={"non_id_type_features": st.dictionaries(st.sampled_from(["dense", "other"]),
                                                      _rows, max_size=2),
              "extra": _json})
_auth = st.sampled_from([{}, {"Authorization": "Bearer wrong"}, AUTH,
                         {"Authorization": TOKEN}])


def _routes() -> list[tuple[str, str]]:
    spec = create_app(settings_for()).openapi()
    return [(m.upper(), p) for p, item in spec["paths"].items() for m in item]


ROUTES = _routes()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=_json | _predict, auth=_auth,
       param=st.text(min_size=1, max_size=12), raw=st.none() | st.binary(max_size=64),
       ctype=st.sampled_from(["application/json", "application/msgpack", "text/plain", ""]))
def test_fuzz_every_route_never_5xx(live, route, body, auth, param, raw, ctype):
    method, path = route
    path = path.replace("{checkpoint_id}", urllib.parse.quote(param, safe=""))
    headers = dict(auth)
    kwargs: dict = {}
    if method == "POST":
        if raw is not None:
            kwargs["content"] = raw
            if ctype:
                headers["content-type"] = ctype
        else:
            kwargs["json"] = body
    r = httpx.request(method, live + path, headers=headers, timeout=30, **kwargs)
    assert r.status_code < 500, (method, path, headers, kwargs, r.status_code, r.text)
    if r.headers.get("content-type", "").startswith("application/json"):
        payload = r.json()
        if r.status_code >= 400:
            assert set(payload["error"]) == {"kind", "type", "message", "field", "hint", "peer"}


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_predict)
def test_fuzz_predict_bodies_never_5xx(live, body):
    r = httpx.post(live + "/v1/predict", json=body, timeout=30)
    assert r.status_code in (200, 413, 422), (body, r.status_code, r.text)
    if r.status_code == 200:
        assert len(r.json()["predictions"]) == r.json()["rows"]


def test_openapi_security_follows_the_settings():
    open_spec = create_app(settings_for()).openapi()
    closed_spec = create_app(settings_for(predict_requires_token=True)).openapi()
    for path, method in (("/v1/predict", "post"), ("/v1/model", "get")):
        op = open_spec["paths"][path][method]
        assert op["security"] == [{"bearerAuth": []}, {}], (path, op["security"])
        assert not {"401", "403"} & set(op["responses"]), path
        op = closed_spec["paths"][path][method]
        assert op["security"] == [{"bearerAuth": []}], (path, op["security"])
        assert {"401", "403"} <= set(op["responses"]), path
    no_token = create_app(settings_for(token=None)).openapi()
    op = no_token["paths"]["/v1/status"]["get"]
    assert op["security"] == [{"bearerAuth": []}, {}] and "401" not in op["responses"]
    assert "x-predict-auth" not in str(open_spec) + str(closed_spec)


def test_contract_findings_stay_fixed(live):
    # 405 lists every method of the path, not only those of the first route matched
    r = httpx.options(live + "/v1/checkpoints", headers=AUTH, timeout=30)
    assert r.status_code == 405
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "POST"}
    # a body that is not UTF-8 is a 422 naming the body, in the API's error shape
    r = httpx.post(live + "/v1/embeddings/configure", content=b"\xff\xfe{", timeout=30,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body", r.text
    # numbers are strict: JSON false is not 0.0, "0.5" is not 0.5; an int is a float
    for bad in (False, "0.5"):
        r = httpx.post(live + "/v1/embeddings/configure", json={"admit_probability": bad},
                       headers=AUTH, timeout=30)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["field"] == "body.admit_probability", r.text
    r = httpx.post(live + "/v1/embeddings/configure", json={"admit_probability": 1},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(live + "/v1/checkpoints/x/restore", json={"reload_model": 1},
                   headers=AUTH, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.reload_model", r.text


# ---------------------------------------------------------------------- schemathesis
schemathesis = None
try:  # optional: the test extra should add "schemathesis>=4.0,<5"
    import schemathesis
except ImportError:
    pass


def _check_case(case, url: str) -> None:
    from schemathesis.specs.openapi import checks

    # Schema-valid bodies may still be refused (an unknown slot is a valid string, a
    # checkpoint id may not exist): "valid data must be accepted" does not hold for this API.
    # Every other check runs (status codes, negative data, Allow headers, auth, schemas).
    excluded = [checks.positive_data_acceptance]
    response = case.call_and_validate(base_url=url, headers=AUTH, excluded_checks=excluded)
    assert response.status_code < 500, (case.method, case.path, response.text)
    op = case.operation
    if case.method.upper() != op.method.upper():    # a probe with another method
        assert response.status_code == 405, (case.method, case.path, response.text)
        return
    documented = set(op.schema.raw_schema["paths"][op.path][op.method.lower()]["responses"])
    assert str(response.status_code) in documented, (
        case.method, case.path, response.status_code, sorted(documented), response.text)


if schemathesis is not None:
    @pytest.fixture(scope="module")
    def live_with_token(tmp_path_factory):
        """The API with PERSIA_API_PREDICT_AUTH=1: inference routes need the token too."""
        with threaded_job_and_api(str(tmp_path_factory.mktemp("schemathesis")),
                                  max_rows_per_request=64, predict_requires_token=True
                                  ) as (url, job):
            yield url

    @pytest.fixture(scope="module")
    def open_schema(live):
        return schemathesis.openapi.from_url(f"{live}/openapi.json")

    @pytest.fixture(scope="module")
    def token_schema(live_with_token):
        return schemathesis.openapi.from_url(f"{live_with_token}/openapi.json")

    @schemathesis.pytest.from_fixture("open_schema").parametrize()
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    def test_schemathesis_default_settings(case, live):
        """Inference open (the default), control and checkpoints behind the token."""
        _check_case(case, live)

    @schemathesis.pytest.from_fixture("token_schema").parametrize()
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    def test_schemathesis_predict_auth(case, live_with_token):
        """Every /v1 route behind the token."""
        _check_case(case, live_with_token)
else:
    def test_schemathesis_no_5xx_and_no_schema_violation():
        pytest.skip("schemathesis is not installed (add schemathesis>=4.0,<5 to the test "
                    "extra); the built-in fuzzers above still ran")
