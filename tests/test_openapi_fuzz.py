"""The fuzz tier (issue 38): schemathesis, as its CLI in a process of its own, against the gateway
served over HTTP with the whole control plane behind it (as test_openapi_conformance), over the
tenant and admin APIs, with a hostile-value strategy on top of schemathesis' own: NUL and other
control characters, lone surrogates, 10,000-character strings, deep nesting, wrong types and
huge numbers, put into generated bodies and query strings (this module is its hooks module:
SCHEMATHESIS_HOOKS). Seeded and bounded (a couple of minutes on a 2-core machine).

It fails on any 5xx, any 4xx without a machine-readable `error.code`, and any mismatch with the
document (status code, content type, body schema). Its stateful phase follows whatever links
schemathesis finds or infers in the document. Afterwards every allocation and group the run
made for the tenant is released through the API and must end released.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
from temporalio.client import Client

from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.gateway_fixtures import TEMPORAL_UI_ORIGIN, served_over_http
from tests.lifecycle_support import eventually
from tests.stripe_fixtures import PaymentsFactory
from tests.test_openapi_conformance import ADMIN_PATHS, EXCLUDED, TENANT_PATHS, _operation_ids

HOOKS_FLAG = "GPUCLOUD_FUZZ_HOOKS"
MAX_EXAMPLES = 8
RUN_TIMEOUT_SECONDS = 200
SEED = "38"
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "error_has_a_code",
    ]
)
DONE = {"released", "failed"}
ROOT = str(Path(__file__).resolve().parent.parent)


def _register_hooks() -> None:
    """The hostile strategy and the error-code check, in schemathesis' process only."""
    import schemathesis
    from hypothesis import strategies as st

    def nested(levels: int) -> Any:
        value: Any = 1
        for _ in range(levels):
            value = {"a": value}
        return value

    hostile_text = st.sampled_from(
        ["\x00", "a\x00b", "bell\x07", "\x7f", "\ud800", "x\udfffy", "x" * 10_000]
    )
    hostile_json = st.one_of(
        hostile_text,
        st.sampled_from([10**30, -(10**30), 1e308, True, "1", [], {}, None, nested(40)]),
    )
    # Query strings are URL-encoded as UTF-8: no lone surrogates there.
    hostile_query = st.sampled_from(
        ["\x00", "a\x00b", "bell\x07", "x" * 10_000, "1e1", "5.0", str(10**30), "-1"]
    )

    def spoil(value: Any, replacement: Any, key: Any) -> Any:
        if isinstance(value, dict) and value:
            keys = sorted(value, key=str)
            chosen = keys[key % len(keys)]
            return {**value, chosen: replacement}
        if isinstance(value, list) and value:
            return [replacement, *value[1:]]
        return replacement

    @schemathesis.hook  # type: ignore[misc]
    def flatmap_body(context: Any, body: Any) -> Any:
        return st.one_of(
            st.just(body),
            st.builds(spoil, st.just(body), hostile_json, st.integers(0, 50)),
        )

    @schemathesis.hook  # type: ignore[misc]
    def flatmap_query(context: Any, query: Any) -> Any:
        if not query:
            return st.just(query)
        return st.one_of(
            st.just(query),
            st.builds(spoil, st.just(query), hostile_query, st.integers(0, 50)),
        )

    @schemathesis.check  # type: ignore[misc]
    def error_has_a_code(ctx: Any, response: Any, case: Any) -> None:
        if not 400 <= response.status_code < 500:
            return
        try:
            code = response.json()["error"]["code"]
        except Exception:
            code = None
        message = f"{response.status_code} without a machine-readable error.code"
        assert isinstance(code, str), message
        assert code, message


if os.environ.get(HOOKS_FLAG):
    _register_hooks()


async def _schemathesis(
    base_url: str, token: str, include_paths: str, excluded_ids: list[str], workdir: Path
) -> tuple[int, str]:
    argv = [
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/schema/openapi.json",
        "--url",
        base_url,
        "--header",
        f"Authorization: Bearer {token}",
        "--include-path-regex",
        include_paths,
        "--checks",
        CHECKS,
        "--phases",
        "fuzzing,stateful",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        SEED,
        "--workers",
        "1",  # see test_openapi_conformance
        "--request-timeout",
        "30",
        "--no-shrink",
        "--output-sanitize",
        "true",
        "--warnings",
        "off",
    ]
    for operation_id in excluded_ids:
        argv += ["--exclude-operation-id", operation_id]
    env = {
        **os.environ,
        "NO_COLOR": "1",
        HOOKS_FLAG: "1",
        "SCHEMATHESIS_HOOKS": "tests.test_openapi_fuzz",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        cwd=workdir,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT_SECONDS)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode or 0, output.decode(errors="replace")


async def _release_everything(http: httpx.AsyncClient, token: str) -> None:
    """Release every allocation and group of the tenant's project; each must end released."""
    auth = {"Authorization": f"Bearer {token}"}
    for listing, key, release in [
        (
            "/api/v1/allocation-groups",
            "allocation_group_id",
            "/api/v1/allocation-groups/{}/release",
        ),
        ("/api/v1/allocations", "allocation_id", "/api/v1/allocations/{}/release"),
    ]:
        listed = await http.get(listing, params={"limit": 200}, headers=auth)
        assert listed.status_code == 200, listed.text
        items = listed.json()["items"]
        for item in items:
            if item["status"] not in DONE:
                answer = await http.post(release.format(item[key]), headers=auth)
                assert answer.status_code in (200, 202, 409), answer.text

        async def all_done(listing: str = listing) -> bool:
            listed = await http.get(listing, params={"limit": 200}, headers=auth)
            return all(item["status"] in DONE for item in listed.json()["items"])

        await eventually(all_done, timeout=120, interval=0.2)


async def test_hostile_fuzzing_finds_no_5xx_no_codeless_4xx_and_no_mismatch(
    payments: PaymentsFactory,
    make_project: Any,
    make_token: Any,
    temporal_client: Client,
    tmp_path: Path,
) -> None:
    project = await make_project()
    plane = await payments(project=project)
    tenant_token = await make_token("tenant", project)
    admin_token = await make_token("admin")
    app = create_app(
        plane.settings,
        temporal_client=temporal_client,
        config=GatewayConfig(temporal_ui_origin=TEMPORAL_UI_ORIGIN),
    )
    async with (
        served_over_http(app) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as http,
    ):
        document = (await http.get("/schema/openapi.json")).json()
        excluded = _operation_ids(document, EXCLUDED)
        failures = []
        for who, token, paths in [
            ("tenant", tenant_token, TENANT_PATHS),
            ("admin", admin_token, ADMIN_PATHS),
        ]:
            code, output = await _schemathesis(base_url, token, paths, excluded, tmp_path)
            assert token not in output
            if code != 0:
                failures.append(f"--- {who} run (exit {code}) ---\n{output[-12000:]}")
        assert not failures, "\n".join(failures)
        # A fresh token: the admin run may well have revoked the tenant's (its stateful phase
        # follows the tokens list into revocations).
        await _release_everything(http, await make_token("tenant", project))


# --- invalid UTF-8: every route, by hand (schemathesis sends text, always valid UTF-8) ---

# A lone continuation byte, a lead byte without its continuation, a UTF-8-encoded lone surrogate,
# and a code point past U+10FFFF: all percent-encoded, as a client puts bytes into a URL.
BAD_URL_BYTES = ["%FF", "%C3%28", "%ED%A0%80", "%F4%90%80%80"]
BAD_BODIES = [b"\xff\xfe", b'{"a": "\xc3\x28"}', b'{"\xed\xa0\x80": 1}', b'["\xf4\x90\x80\x80"]']
HTTP_METHODS = ("get", "post", "put", "patch", "delete")


def _concrete(path: str, parameters: list[dict[str, Any]], spoiled: dict[str, str]) -> str:
    """The path with each parameter filled in: a well-formed value, or a spoiled one."""
    for parameter in parameters:
        name = parameter["name"]
        schema = parameter.get("schema", {})
        value = "1" if schema.get("type") == "integer" else "x"
        if schema.get("format") == "uuid":
            value = str(uuid.uuid4())
        path = path.replace(f"{{{name}}}", spoiled.get(name, value))
    return path


def _invalid_utf8_cases(document: dict[str, Any]) -> list[tuple[str, str, str, bytes | None]]:
    """(method, url, where, body) for every operation of the document: invalid UTF-8 in each
    query parameter it declares and in one it does not, in a query key, in each path
    parameter, and in the body of each operation that takes one."""
    cases: list[tuple[str, str, str, bytes | None]] = []
    for path, item in document["paths"].items():
        for method in HTTP_METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            parameters = [*item.get("parameters", []), *operation.get("parameters", [])]
            in_path = [p for p in parameters if p["in"] == "path"]
            url = _concrete(path, in_path, {})
            queried = [p["name"] for p in parameters if p["in"] == "query"] + ["undeclared"]
            for name in queried:
                cases += [(method, f"{url}?{name}={bad}", f"query {name}", None)
                          for bad in BAD_URL_BYTES]  # fmt: skip
            cases.append((method, f"{url}?%FF=1", "query key", None))
            for parameter in in_path:
                cases += [
                    (method, _concrete(path, in_path, {parameter["name"]: bad}), "path", None)
                    for bad in BAD_URL_BYTES
                ]
            if "requestBody" in operation or path.startswith("/api/v1/webhooks/"):
                cases += [(method, url, "body", body) for body in BAD_BODIES]
    return cases


async def test_invalid_utf8_in_any_body_query_or_path_is_a_4xx_with_a_code(
    payments: PaymentsFactory,
    make_project: Any,
    make_token: Any,
    temporal_client: Client,
    caplog: Any,
) -> None:
    """Every documented operation, as the tenant (tenant routes) or an admin (the others):
    refused with a 4xx and a machine-readable error.code, never a 5xx, never a traceback."""
    caplog.set_level(logging.INFO, logger="gateway.errors")
    project = await make_project()
    plane = await payments(project=project)
    tokens = {
        "tenant": await make_token("tenant", project),
        "admin": await make_token("admin"),
    }
    app = create_app(
        plane.settings,
        temporal_client=temporal_client,
        config=GatewayConfig(temporal_ui_origin=TEMPORAL_UI_ORIGIN),
    )
    async with (
        served_over_http(app) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as http,
    ):
        document = (await http.get("/schema/openapi.json")).json()
        cases = _invalid_utf8_cases(document)
        assert len({(m, u.split("?")[0]) for m, u, _, _ in cases}) > 50  # every route, really
        wrong = []
        for method, url, where, body in cases:
            who = "tenant" if re.match(TENANT_PATHS, url) else "admin"
            headers = {"Authorization": f"Bearer {tokens[who]}"}
            if body is not None:
                headers["Content-Type"] = "application/json"
            response = await http.request(method.upper(), url, content=body, headers=headers)
            try:
                code = response.json()["error"]["code"]
            except Exception:
                code = None
            if not 400 <= response.status_code < 500 or not code:
                wrong.append(f"{method.upper()} {url} ({where}): {response.status_code} {code}")
        assert not wrong, "\n".join(wrong)
    assert "Traceback" not in caplog.text
