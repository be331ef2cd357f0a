"""The OpenAPI document and the API docs pages.

Litestar documents what it sees in a handler's signature; what the gateway decides elsewhere
(the guards, the error envelope of gateway.errors, bodiless 204s) it cannot see. So the
document is finished here, once per app, from each route's declared errors and from what
follows from the route itself; a new route gets truthful error docs without repeating them:

- a guard: 401 unauthenticated, 403 forbidden, and the guard's security requirement; no guard:
  no security requirement (a public route);
- a guard (it reads the token table) or an injected dependency (the database, Temporal,
  Vault): 503 database_unavailable / temporal_unavailable / secret_store_unavailable;
- a request body: 400 invalid_request (failed validation), malformed_json, json_too_deep,
  413, and 422 invalid_text (a control character in a string: gateway.request_decoding);
- a path, query or header parameter: 400 (failed validation); a query or header one, or a text
  path one (not a UUID), also 422: invalid_text for a control character in its value, and
  unknown_<name> for a filter outside its enum (`gateway.errors.unknown_query_value`);
- every parameter as the gateway reads it (gateway.request_decoding.check_parameters): a query
  or header parameter is never `null` (it is absent or a string), a text one has the Text
  pattern and at most MAX_PARAMETER_CHARS characters (maxLength), a list at most
  MAX_PARAMETER_ITEMS values (maxItems); a declared `QueryParameter(schema_extra=one_of(...))`
  its enum;
- a request body struct (and any struct in it) that refuses unknown fields (msgspec
  `forbid_unknown_fields`, as gateway.schemas.Request): `additionalProperties: false`;
- a path parameter: 404 (a value that does not parse matches no route, and an id that does
  not exist is not found);
- every error status: the `{"error": {"code", "message", "details"}}` envelope
  (gateway.errors), never the framework's default 400 body;
- a 204: no body.

What a route raises itself beyond that (402, 404 without a path parameter, 409, 410, 422,
502), it declares: `responses=errors(409, 422)`.

The Swagger UI page loads its scripts and styles from the gateway (the files of the pinned
`swagger-ui-py` package), never from a CDN: GPU sites are often air-gapped.
"""

from __future__ import annotations

import copy
import importlib.util
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import msgspec
from litestar import Litestar, Request, get
from litestar.handlers import HTTPRouteHandler
from litestar.openapi.config import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import FromPath
from litestar.response import File
from litestar.routes import HTTPRoute

from gateway import codec_session
from gateway.auth import codec_guard
from gateway.errors import NotFound
from gateway.schemas import (
    MAX_PARAMETER_CHARS,
    MAX_PARAMETER_ITEMS,
    TEXT_PATTERN,
    ErrorResponse,
)

DOCS_PATH: Final = "/schema"
ASSETS_PATH: Final = f"{DOCS_PATH}/assets"

# What each error status means on this API; a route's declared status uses its own
# description where it gives one.
ERROR_DESCRIPTIONS: Final[Mapping[int, str]] = {
    400: "invalid_request: malformed JSON, wrong types, failed validation",
    401: "unauthenticated: missing, invalid or revoked bearer token",
    402: "balance_depleted: add credit to the project before allocating",
    403: "forbidden (admin route, tenant token) or tenant_only (tenant route, admin token)",
    404: "not_found (also for another project's resources)",
    409: "conflict (see the code)",
    410: "gone: the resource was deleted for good (see the code)",
    413: "payload_too_large",
    422: "unprocessable (see the code)",
    502: "an upstream (MAAS, the payment provider) or a workflow failed (see the code)",
    503: "database_unavailable, temporal_unavailable or secret_store_unavailable; retry",
}

_ERROR_HEADERS: Final[Mapping[int, dict[str, Any]]] = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer realm"}},
    503: {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}},
}

BEARER: Final = "bearer"
CODEC_COOKIE: Final = "codecSession"
CONSOLE_COOKIE: Final = "consoleSession"


def errors(*statuses: int) -> dict[int, ResponseSpec]:
    """A route's `responses=`: the error statuses it raises itself (the module docstring says
    which follow from the route and need no declaring)."""
    return {
        status: ResponseSpec(
            data_container=ErrorResponse,
            description=ERROR_DESCRIPTIONS[status],
            generate_examples=False,
        )
        for status in sorted(set(statuses))
    }


def one_of(values: Iterable[str]) -> dict[str, Any]:
    """`QueryParameter(schema_extra=one_of(...))`: document the values a filter accepts (the
    route refuses any other with 422 unknown_<name>)."""
    return {"enum": [str(value) for value in values]}


# --- finishing the document ---


def _operations(app: Litestar) -> Iterator[tuple[str, str, HTTPRouteHandler]]:
    """(path as the document spells it, lower-case method, handler) for documented routes."""
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for method, (handler, _) in route.route_handler_map.items():
            if handler.resolve_include_in_schema():
                yield route.path_format or "/", method.lower(), handler


def _derived_errors(handler: HTTPRouteHandler, operation: Mapping[str, Any]) -> set[int]:
    statuses: set[int] = set()
    guarded = bool(handler.resolve_guards())
    if guarded:
        statuses |= {401, 403}
    injected = set(handler.parsed_fn_signature.parameters) & set(handler.resolve_dependencies())
    if guarded or injected:
        statuses.add(503)
    parameters = operation.get("parameters") or []
    if "requestBody" in operation:
        # 400 invalid_request / malformed_json / json_too_deep, 413, and 422 invalid_text
        # (gateway.request_decoding).
        statuses |= {400, 413, 422}
    if parameters:
        statuses.add(400)
    if any(p.get("in") in ("query", "header") or _is_text(p.get("schema", {})) for p in parameters):
        statuses.add(422)  # invalid_text (any query or header value), unknown_<name>
    if any(p.get("in") == "path" for p in parameters):
        statuses.add(404)
    return statuses


def _is_text(schema: Mapping[str, Any]) -> bool:
    """A string that is not a UUID or a date (gateway.request_decoding checks its text)."""
    if schema.get("type") == "array":
        return _is_text(schema.get("items", {}))
    return schema.get("type") == "string" and "format" not in schema


def _parameter_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema as the gateway reads the parameter (the module docstring)."""
    options = schema.get("oneOf")
    if isinstance(options, list):
        present = [o for o in options if o != {"type": "null"}]
        if len(present) == 1:  # `X | None`: absent, never null
            rest = {k: v for k, v in schema.items() if k != "oneOf"}
            schema = {**present[0], **rest}
    if schema.get("type") == "array":
        schema["maxItems"] = min(schema.get("maxItems", MAX_PARAMETER_ITEMS), MAX_PARAMETER_ITEMS)
        if isinstance(schema.get("items"), dict) and "$ref" not in schema["items"]:
            schema["items"] = _parameter_schema(dict(schema["items"]))
        return schema
    if _is_text(schema) and "enum" not in schema:
        schema["maxLength"] = min(schema.get("maxLength", MAX_PARAMETER_CHARS), MAX_PARAMETER_CHARS)
        schema.setdefault("pattern", TEXT_PATTERN)
    return schema


def _finish_parameters(operation: dict[str, Any]) -> None:
    for parameter in operation.get("parameters") or []:
        if isinstance(parameter.get("schema"), dict):
            parameter["schema"] = _parameter_schema(dict(parameter["schema"]))


def _strict_structs(annotation: Any, found: set[type[msgspec.Struct]]) -> None:
    """The msgspec structs in `annotation` (recursively) that refuse unknown fields."""
    origin = typing.get_origin(annotation)
    if origin is not None:
        for arg in typing.get_args(annotation):
            _strict_structs(arg, found)
        return
    if not (isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)):
        return
    if annotation in found:
        return
    if annotation.__struct_config__.forbid_unknown_fields:
        found.add(annotation)
    for field in msgspec.structs.fields(annotation):
        _strict_structs(field.type, found)


def _refuse_unknown_fields(app: Litestar, schemas: dict[str, Any]) -> None:
    """`additionalProperties: false` on every request body struct that refuses unknown fields."""
    found: set[type[msgspec.Struct]] = set()
    for _, _, handler in _operations(app):
        parameter = handler.parsed_fn_signature.parameters.get("data")
        if parameter is not None:
            _strict_structs(parameter.annotation, found)
    for struct in found:
        schema = schemas.get(struct.__name__)
        if isinstance(schema, dict) and schema.get("type") == "object":
            schema["additionalProperties"] = False


def _security(handler: HTTPRouteHandler) -> list[dict[str, list[str]]] | None:
    guards = handler.resolve_guards()
    if not guards:
        return None
    if codec_guard in guards:  # Temporal Web in a browser sends a cookie, not a token
        return [{BEARER: []}, {CODEC_COOKIE: []}, {CONSOLE_COOKIE: []}]
    return [{BEARER: []}]


def _error_response(status: int, description: str) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    if status in _ERROR_HEADERS:
        response["headers"] = copy.deepcopy(_ERROR_HEADERS[status])
    return response


# A route's `opt` key naming the other media types its 200 answer can have (say "text/csv"
# beside JSON), documented as strings so response-conformance checks know them.
ALSO_SERVES = "also_serves"


def _finish_operation(operation: dict[str, Any], handler: HTTPRouteHandler) -> None:
    _finish_parameters(operation)
    for media_type in handler.opt.get(ALSO_SERVES, ()):
        ok = operation.setdefault("responses", {}).get("200")
        if ok is not None:
            ok.setdefault("content", {})[media_type] = {"schema": {"type": "string"}}
    declared = {s: spec for s, spec in (handler.responses or {}).items() if s >= 400}
    responses: dict[str, Any] = operation.setdefault("responses", {})
    for code in [c for c in responses if c.isdigit() and int(c) >= 400]:
        del responses[code]  # the framework's guesses; ours follow
    for status in sorted(set(declared) | _derived_errors(handler, operation)):
        spec = declared.get(status)
        description = spec.description if spec and spec.description else None
        responses[str(status)] = _error_response(
            status, description or ERROR_DESCRIPTIONS.get(status, f"HTTP {status}")
        )
    if "204" in responses:  # Litestar gives Response[None] a JSON `null` body; 204 has none
        responses["204"].pop("content", None)
    security = _security(handler)
    if security is None:
        operation.pop("security", None)
    else:
        operation["security"] = security


def _error_schemas() -> dict[str, Any]:
    """ErrorResponse and what it references, as msgspec describes the structs the errors are
    documented with (no generated examples)."""
    _, components = msgspec.json.schema_components(
        [ErrorResponse], ref_template="#/components/schemas/{name}"
    )
    return components


def finish_document(app: Litestar, generated: Mapping[str, Any]) -> dict[str, Any]:
    """The document Litestar generated, with every route's errors and security as the module
    docstring says."""
    document = copy.deepcopy(dict(generated))
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(_error_schemas())
    _refuse_unknown_fields(app, schemas)
    paths = document.get("paths", {})
    for path, method, handler in _operations(app):
        operation = paths.get(path, {}).get(method)
        if operation is not None:
            _finish_operation(operation, handler)
    return document


class _Published:
    """The finished document of one app, built on the first request for it."""

    def __init__(self) -> None:
        self._document: dict[str, Any] | None = None

    def document(self, app: Litestar, generated: Mapping[str, Any]) -> dict[str, Any]:
        if self._document is None:
            self._document = finish_document(app, generated)
        return self._document


class _SwaggerPage(SwaggerRenderPlugin):
    def __init__(self, published: _Published) -> None:
        super().__init__(
            path="/swagger",
            js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            css_url=f"{ASSETS_PATH}/swagger-ui.css",
            standalone_preset_js_url=f"{ASSETS_PATH}/swagger-ui-standalone-preset.js",
            favicon=f"<link rel='icon' type='image/png' href='{ASSETS_PATH}/favicon-32x32.png'>",
        )
        self._published = published

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        return super().render(request, self._published.document(request.app, openapi_schema))


class _JsonDocument(JsonRenderPlugin):
    def __init__(self, published: _Published) -> None:
        super().__init__()
        self._published = published

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        return super().render(request, self._published.document(request.app, openapi_schema))


def openapi_config(*, title: str, version: str) -> OpenAPIConfig:
    """The docs at /schema/swagger and the document at /schema/openapi.json; no security
    requirement at the top: each guarded operation names its own (public routes none)."""
    published = _Published()
    return OpenAPIConfig(
        title=title,
        version=version,
        path=DOCS_PATH,
        render_plugins=[_SwaggerPage(published), _JsonDocument(published)],
        components=Components(
            security_schemes={
                BEARER: SecurityScheme(
                    type="http", scheme="bearer", description="gpc_... API token"
                ),
                CODEC_COOKIE: SecurityScheme(
                    type="apiKey",
                    security_scheme_in="cookie",
                    name=codec_session.COOKIE_NAME,
                    description="set by POST /api/v1/admin/codec/session (for Temporal Web)",
                ),
                CONSOLE_COOKIE: SecurityScheme(
                    type="apiKey",
                    security_scheme_in="cookie",
                    name=codec_session.CONSOLE_COOKIE_NAME,
                    description="set by the operator console's sign-in (/console/sign-in)",
                ),
            }
        ),
    )


# --- Swagger UI's files ---

# Only what the page loads: the package also ships Swagger Editor, which nothing here uses.
SWAGGER_UI_FILES: Final = frozenset(
    {
        "swagger-ui-bundle.js",
        "swagger-ui-standalone-preset.js",
        "swagger-ui.css",
        "favicon-32x32.png",
    }
)


def swagger_ui_directory() -> Path:
    """Where the installed swagger-ui-py keeps Swagger UI's files (without importing it: its
    own Python code is for other frameworks)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("swagger-ui-py is not installed (pyproject.toml lists it)")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


@get(f"{ASSETS_PATH}/{{name:str}}", include_in_schema=False, sync_to_thread=False)
def swagger_ui_asset(name: FromPath[str]) -> File:
    if name not in SWAGGER_UI_FILES:
        raise NotFound()
    # The name gives the media type (text/javascript, text/css): browsers refuse a script or a
    # stylesheet served as application/octet-stream.
    return File(
        path=swagger_ui_directory() / name, filename=name, content_disposition_type="inline"
    )
