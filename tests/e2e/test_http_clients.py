"""What real HTTP clients send, on raw sockets and as curl sends it: an `Upgrade: h2c` beside
a body (curl --http2, Java's HttpClient), HTTP/1.0 streams, wrong methods (405 with
`Allow`), compressed request bodies (gzip, deflate; others 415, bombs 413)."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import subprocess
import zlib
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import KEY, Fleet

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 3}
# What curl --http2 adds to an http:// request.
H2C = (
    b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)


def head(method: str, path: str, body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (
        b"%s %s HTTP/%s\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
    ) % (method.encode(), path.encode(), version, KEY.encode(), len(body), extra)


def exchange(port: int, *parts: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """Send `parts` (each its own write), read until the server closes: status line,
    headers (lower-case names), body as sent on the wire."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for part in parts:
            sock.sendall(part)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = raw_head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines)}
    return status, headers, body


def port_of(fleet: Fleet) -> int:
    return fleet.gateway.port


# --- Upgrade: h2c ----------------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
def test_an_h2c_upgrade_is_ignored_and_the_body_kept(fleet: Fleet, split: bool) -> None:
    body = json.dumps(CHAT).encode()
    request = head("POST", "/v1/chat/completions", body, H2C)
    parts = (request, body[:10], body[10:]) if split else (request + body,)
    status, headers, answer = exchange(port_of(fleet), *parts)
    assert status == b"HTTP/1.1 200 OK", answer
    assert b"upgrade" not in headers  # no 101: the answer is HTTP/1.1
    assert json.loads(answer)["choices"][0]["message"]["content"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_http2_gets_its_answer(fleet: Fleet) -> None:
    done = subprocess.run(
        ["curl", "-sS", "--http2", "--max-time", "20", f"{fleet.base_url}/chat/completions",
         "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
         "-d", json.dumps(CHAT)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["usage"]["completion_tokens"] == 3


# --- HTTP/1.0 --------------------------------------------------------------------------------


def test_an_http10_stream_is_close_delimited(fleet: Fleet) -> None:
    body = json.dumps({**CHAT, "stream": True}).encode()
    status, headers, answer = exchange(
        port_of(fleet), head("POST", "/v1/chat/completions", body, version=b"1.0") + body
    )
    assert status.endswith(b" 200 OK")
    assert b"transfer-encoding" not in headers and b"content-length" not in headers
    assert headers[b"connection"] == b"close"
    events = [e for e in answer.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events)  # no chunk sizes in the body


def test_an_http10_answer_has_its_length(fleet: Fleet) -> None:
    body = json.dumps(CHAT).encode()
    _, headers, answer = exchange(
        port_of(fleet), head("POST", "/v1/chat/completions", body, version=b"1.0") + body
    )
    assert int(headers[b"content-length"]) == len(answer)
    assert json.loads(answer)["object"] == "chat.completion"


# --- 405 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/chat/completions", "POST"), ("PATCH", "/v1/completions", "POST"),
     ("OPTIONS", "/v1/completions", "POST"), ("POST", "/v1/models", "GET, HEAD"),
     ("DELETE", "/healthz", "GET, HEAD")],
)  # fmt: skip
def test_a_wrong_method_is_405_saying_what_is_allowed(
    fleet: Fleet, method: str, path: str, allow: str
) -> None:
    resp = httpx.request(method, fleet.gateway.url + path, timeout=10)
    assert resp.status_code == 405
    assert set(resp.headers["allow"].split(", ")) == set(allow.split(", "))
    assert resp.json()["error"]["code"] == "method_not_allowed"


# --- Content-Encoding ------------------------------------------------------------------------


def post_encoded(fleet: Fleet, body: bytes, encoding: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
               "Content-Encoding": encoding}  # fmt: skip
    return httpx.post(f"{fleet.base_url}/chat/completions", content=body, headers=headers,
                      timeout=20)  # fmt: skip


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("identity", bytes),
     ("gzip, deflate", lambda b: zlib.compress(gzip.compress(b)))],
)  # fmt: skip
def test_a_compressed_body_is_decoded(fleet: Fleet, encoding: str, encode: Any) -> None:
    resp = post_encoded(fleet, encode(json.dumps(CHAT).encode()), encoding)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


def test_a_coding_not_decoded_is_415_naming_the_header(fleet: Fleet) -> None:
    resp = post_encoded(fleet, b"\x1b\x00\x00", "br")
    assert resp.status_code == 415
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("content-encoding", "unsupported_content_encoding")
    assert "'br'" in error["message"]


def test_a_gzip_bomb_is_413_and_a_broken_one_400(fleet: Fleet) -> None:
    # The fleet's limits.max_body_bytes is 64 KiB: 70 KiB compress to a few hundred bytes.
    bomb = gzip.compress(json.dumps({**CHAT, "pad": " " * 70_000}).encode())
    assert len(bomb) < 1024
    assert post_encoded(fleet, bomb, "gzip").status_code == 413
    broken = post_encoded(fleet, gzip.compress(json.dumps(CHAT).encode())[:-6], "gzip")
    assert broken.status_code == 400
    assert broken.json()["error"]["param"] == "content-encoding"


def test_an_h2c_upgrade_with_a_chunked_body_is_400(fleet: Fleet) -> None:
    body = json.dumps(CHAT).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
        b"Transfer-Encoding: chunked\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
    ) % (KEY.encode(), H2C, len(body), body)
    status, _, answer = exchange(port_of(fleet), request)
    assert status.startswith(b"HTTP/1.1 400"), answer
