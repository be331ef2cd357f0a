"""The API docs: the Swagger page loads only files the gateway serves itself (no CDN), and the
OpenAPI document says what each route answers: our error envelope on every error status, the
guard's 401/403 and security requirement, no body on a 204 (gateway/openapi.py)."""

from __future__ import annotations

import re
import uuid
from html.parser import HTMLParser
from typing import Any

from litestar import Controller, Litestar, delete, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import admin_guard, tenant_guard
from gateway.openapi import finish_document, openapi_config
from gateway.runtime import provide_db
from gateway.schemas import ProjectCreate, ProjectView
from tests.gateway_fixtures import ApiFactory

ERROR_REF = "#/components/schemas/ErrorResponse"


class _AssetLinks(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"script": "src", "link": "href", "img": "src"}.get(tag)
        for name, value in attrs:
            if name == wanted and value:
                self.urls.append(value)


async def test_swagger_page_loads_only_files_the_gateway_serves(api: ApiFactory) -> None:
    client = await api()
    page = await client.get("/schema/swagger")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    links = _AssetLinks()
    links.feed(page.text)
    assert len(links.urls) >= 4, links.urls  # stylesheet, two scripts, icon
    expected_types = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
    for url in links.urls:
        assert url.startswith("/schema/assets/"), f"{url} is not served by the gateway"
        asset = await client.get(url)
        assert asset.status_code == 200, url
        suffix = url[url.rindex(".") :]
        assert asset.headers["content-type"].startswith(expected_types[suffix]), url
        assert len(asset.content) > 1000, url
    # Nothing else on the page reaches out either (the spec is inlined).
    assert not re.search(r"""(src|href)=["']?https?://""", page.text)
    # Swagger UI 5: it renders OpenAPI 3.1 documents, which Litestar writes.
    bundle = await client.get("/schema/assets/swagger-ui-bundle.js")
    assert re.search(rb'PACKAGE_VERSION:"5\.', bundle.content)
    assert (await client.get("/schema/assets/swagger-editor-bundle.js")).status_code == 404


async def test_every_error_status_documents_the_error_envelope(api: ApiFactory) -> None:
    client = await api()
    document = (await client.get("/schema/openapi.json")).json()
    assert "security" not in document  # each guarded operation names its own
    checked = 0
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) < 400:
                    continue
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": ERROR_REF}, (method, path, status)
                checked += 1
    assert checked > 200
    error_info = document["components"]["schemas"]["ErrorInfo"]
    assert set(error_info["required"]) == {"code", "message"}
    assert "examples" not in document["components"]["schemas"]["ErrorResponse"]


async def test_guarded_public_and_bodiless_routes_are_documented_as_they_answer(
    api: ApiFactory,
) -> None:
    client = await api()
    paths = (await client.get("/schema/openapi.json")).json()["paths"]

    # The admin guard of the reconciliation routes: 401 and 403, with the bearer token.
    for path, method in [
        ("/api/v1/admin/reconciliation/status", "get"),
        ("/api/v1/admin/reconciliation/drift", "get"),
        ("/api/v1/admin/reconciliation/run", "post"),
    ]:
        operation = paths[path][method]
        assert {"401", "403", "503"} <= set(operation["responses"]), path
        assert operation["security"] == [{"bearer": []}]

    # The codec: the bearer token, its session cookie or the console's; dropping the cookie is
    # public, 204.
    assert paths["/api/v1/admin/codec/decode"]["post"]["security"] == [
        {"bearer": []},
        {"codecSession": []},
        {"consoleSession": []},
    ]
    drop = paths["/api/v1/admin/codec/session"]["delete"]
    assert set(drop["responses"]) == {"204"}
    assert "content" not in drop["responses"]["204"]
    assert "security" not in drop

    # Public routes need no token and answer no 401 they never send.
    assert set(paths["/healthz"]["get"]["responses"]) == {"200"}
    assert "security" not in paths["/healthz"]["get"]
    webhook = paths["/api/v1/webhooks/stripe"]["post"]
    assert "security" not in webhook
    assert "401" not in webhook["responses"]
    # The agent's enrollment token is its credential: a bad one is 401, without a bearer.
    enroll = paths["/api/v1/internal/agent/enroll"]["post"]
    assert "security" not in enroll
    assert "401" in enroll["responses"]

    # A path parameter that does not parse matches no route: 404, as for an unknown id.
    assert "404" in paths["/api/v1/allocations/{allocation_id}/timeline"]["get"]["responses"]
    bad_id = await client.get("/api/v1/allocations/not-a-uuid/timeline")
    assert bad_id.status_code == 404
    assert bad_id.json()["error"]["code"] == "not_found"


# --- a route added later gets its error docs without declaring them ---


class _NewAdminController(Controller):
    path = "/api/v1/admin/widgets"
    guards = [admin_guard]

    @post("/{widget_id:uuid}", status_code=201)
    async def create(
        self,
        data: JSONBody[ProjectCreate],
        db: NamedDependency[AsyncSession],
        widget_id: FromPath[uuid.UUID],
    ) -> ProjectView:
        raise NotImplementedError

    @delete("/{widget_id:uuid}", status_code=204)
    async def remove(self, widget_id: FromPath[uuid.UUID]) -> None:
        raise NotImplementedError


class _NewTenantController(Controller):
    path = "/api/v1/widgets"
    guards = [tenant_guard]

    @get("/")
    async def list_widgets(self) -> list[str]:
        raise NotImplementedError


def _document(*handlers: Any) -> dict[str, Any]:
    app = Litestar(
        route_handlers=list(handlers),
        dependencies={"db": Provide(provide_db)},
        openapi_config=openapi_config(title="t", version="1"),
    )
    return finish_document(app, app.openapi_schema.to_schema())


def test_a_new_route_gets_error_docs_from_its_guard_body_and_parameters() -> None:
    paths = _document(_NewAdminController, _NewTenantController)["paths"]
    create = paths["/api/v1/admin/widgets/{widget_id}"]["post"]
    assert set(create["responses"]) == {"201", "400", "401", "403", "404", "413", "422", "503"}
    assert create["security"] == [{"bearer": []}]
    assert create["responses"]["401"]["headers"]["WWW-Authenticate"]
    remove = paths["/api/v1/admin/widgets/{widget_id}"]["delete"]
    assert set(remove["responses"]) == {"204", "400", "401", "403", "404", "503"}
    assert "content" not in remove["responses"]["204"]
    # No body, no parameters: no 400 or 413; the guard still answers 401/403 (and 503).
    listed = paths["/api/v1/widgets"]["get"]
    assert set(listed["responses"]) == {"200", "401", "403", "503"}
