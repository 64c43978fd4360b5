"""Opening the HTTP client a benchmark drives, and finding what it talks to.

The router speaks HTTP/2 on cleartext with prior knowledge (hypercorn reads
the h2 preface), which is what a benchmark of it should use: one connection,
many streams. Many OpenAI servers (uvicorn) speak only HTTP/1.1 on cleartext,
so ``auto`` probes with h2 first and falls back; ``https://`` negotiates with
ALPN. The probe is ``GET /v1/models``, which also names the default model.
"""

from __future__ import annotations

import ssl
from typing import Literal
from urllib.parse import urlsplit

import httpx
import msgspec

from backends.errors import BackendUnavailable, BadRequest
from backends.h2client import H2Pool

__all__ = ["HttpVersion", "Target", "discover", "make_client", "make_pool"]

HttpVersion = Literal["auto", "2", "1.1"]
FALLBACK_MODEL = "default"


class Target(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    http: Literal["2", "1.1"]  # what the client will speak
    http_version: str  # what the probe answer actually came over ("HTTP/2", "HTTP/1.1")
    models: tuple[str, ...]


def make_client(url: str, http: Literal["2", "1.1", "alpn"], *, max_connections: int,
                api_key: str | None, timeout: float) -> httpx.AsyncClient:
    """An AsyncClient for ``url``; ``alpn`` offers both versions (TLS only)."""
    if not url.startswith(("http://", "https://")):
        raise BadRequest(f"target must be an http:// or https:// URL, got {url!r}", param="target")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=url.rstrip("/"),
        http1=http != "2",
        http2=http != "1.1",
        headers=headers,
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        limits=httpx.Limits(max_connections=max_connections,
                            max_keepalive_connections=max_connections),
        trust_env=False,
    )


def make_pool(url: str, *, max_connections: int, api_key: str | None,
              timeout: float) -> H2Pool:
    """The lean HTTP/2 client (``backends.h2client``) for ``url``: prior
    knowledge on http://, ALPN on https://."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"target must be an http:// or https:// URL, got {url!r}", param="target")
    context = ssl.create_default_context() if parts.scheme == "https" else None
    port = parts.port or (443 if context else 80)
    headers = [("authorization", f"Bearer {api_key}")] if api_key else []
    return H2Pool(parts.hostname, port, ssl_context=context, headers=headers,
                  connect_timeout=min(timeout, 10.0), pool_timeout=timeout,
                  max_connections=max_connections)


def _model_ids(response: httpx.Response) -> tuple[str, ...]:
    if response.status_code != 200:
        return ()
    try:
        data = msgspec.json.decode(response.content).get("data") or []
        return tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
    except (msgspec.DecodeError, AttributeError, TypeError):
        return ()


async def _probe(url: str, http: Literal["2", "1.1", "alpn"],
                 api_key: str | None) -> httpx.Response:
    async with make_client(url, http, max_connections=1, api_key=api_key, timeout=10.0) as c:
        return await c.get("/v1/models")


async def discover(url: str, http: HttpVersion, api_key: str | None) -> Target:
    """Pick the HTTP version (see module docstring) and list the served models.

    Raises :class:`BackendUnavailable` when the target cannot be reached at all."""
    if http == "auto":
        tries: list[Literal["2", "1.1", "alpn"]] = (
            ["alpn"] if url.startswith("https://") else ["2", "1.1"])
    else:
        tries = [http]
    last: httpx.HTTPError | None = None
    for attempt in tries:
        try:
            response = await _probe(url, attempt, api_key)
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            last = exc  # most likely an HTTP/1.1-only server refusing the h2 preface
            continue
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
        used: Literal["2", "1.1"] = "2" if response.http_version == "HTTP/2" else "1.1"
        return Target(url=url, http=used, http_version=response.http_version,
                      models=_model_ids(response))
    raise BackendUnavailable(f"cannot speak to {url} over HTTP ({tries}): {last}")
