"""The route table: static paths, path parameters, 404 and 405."""

from __future__ import annotations

import pytest

from backends.errors import MethodNotAllowed, NotFound
from frontend.routes import RouteTable


def table() -> RouteTable[str]:
    routes: RouteTable[str] = RouteTable()
    routes.add("POST", "/v1/jobs", "create")
    routes.add("GET", "/v1/jobs", "list")
    routes.add("GET", "/v1/jobs/{id}", "get")
    routes.add("DELETE", "/v1/jobs/{id}", "cancel")
    routes.add("GET", "/v1/files/{file_id}/content", "content")
    routes.add("GET", "/v1/models.json", "dot")
    return routes


def test_static_and_templated_paths_resolve_with_their_parameters() -> None:
    routes = table()
    assert routes.resolve("GET", "/v1/jobs").handler == "list"
    found = routes.resolve("GET", "/v1/jobs/job-123")
    assert (found.handler, found.params, found.template) == ("get", {"id": "job-123"}, "/v1/jobs/{id}")
    found = routes.resolve("GET", "/v1/files/file-9/content")
    assert (found.handler, found.params) == ("content", {"file_id": "file-9"})
    assert routes.resolve("DELETE", "/v1/jobs/x").handler == "cancel"


def test_a_parameter_is_one_segment_and_template_characters_are_literal() -> None:
    routes = table()
    with pytest.raises(NotFound):
        routes.resolve("GET", "/v1/jobs/a/b")
    with pytest.raises(NotFound):
        routes.resolve("GET", "/v1/jobs/")
    with pytest.raises(NotFound):
        routes.resolve("GET", "/v1/modelsXjson")  # the dot is not a wildcard
    assert routes.resolve("GET", "/v1/models.json").handler == "dot"


def test_a_known_path_with_another_method_is_405_naming_the_methods() -> None:
    routes = table()
    with pytest.raises(MethodNotAllowed, match="DELETE, GET"):
        routes.resolve("PUT", "/v1/jobs/abc")
    with pytest.raises(MethodNotAllowed, match="GET, POST"):
        routes.resolve("PATCH", "/v1/jobs")


def test_metrics_label_by_template_and_later_routes_replace_earlier_ones() -> None:
    routes = table()
    assert routes.template("GET", "/v1/jobs/anything") == "/v1/jobs/{id}"
    assert routes.template("GET", "/nope") == "other"
    routes.add("GET", "/v1/jobs/{id}", "replaced")
    assert routes.resolve("GET", "/v1/jobs/1").handler == "replaced"
    assert ("GET", "/v1/jobs/{id}") in routes and ("GET", "/v1/jobs/1") not in routes
