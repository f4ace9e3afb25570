"""A request body sent compressed (`Content-Encoding`, docs/api.md): gzip and deflate are
decoded here, in order, never to more than `limits.max_body_bytes` (a body that would
inflate past it, a "zip bomb", is 413 before it takes the memory); any other coding is
415 naming the header, and a body that is not what its header says is 400.
"""

from __future__ import annotations

import zlib

from gateway.errors import EncodingUnsupported, HeaderInvalid, PayloadTooLarge

HEADER = "content-encoding"
# zlib's window bits: gzip's header and trailer; deflate as RFC 9110 means it (a zlib
# stream), and as some clients send it (raw).
_GZIP, _ZLIB, _RAW = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS, -zlib.MAX_WBITS
_CODINGS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": _ZLIB}
# Codings applied to one body, at most (each is a pass over it).
MAX_CODINGS = 4


def decoded(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The body as sent before its codings (listed in the order they were applied)."""
    if not content_encoding:
        return body
    codings = [c.strip().lower() for c in content_encoding.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if len(codings) > MAX_CODINGS:
        raise HeaderInvalid(
            f"At most {MAX_CODINGS} content codings per body, not {len(codings)}.", param=HEADER
        )
    for coding in reversed(codings):
        wbits = _CODINGS.get(coding)
        if wbits is None:
            raise EncodingUnsupported(
                f"The content coding {coding[:40]!r} is not supported: send the body as it "
                "is, or gzip or deflate it.",
                param=HEADER,
            )
        body = _inflate(body, wbits, limit, coding)
    return body


def _inflate(body: bytes, wbits: int, limit: int, coding: str) -> bytes:
    try:
        return _members(body, wbits, limit)
    except zlib.error:
        if wbits != _ZLIB:
            raise _undecodable(coding) from None
    try:
        return _members(body, _RAW, limit)
    except zlib.error:
        raise _undecodable(coding) from None


def _members(body: bytes, wbits: int, limit: int) -> bytes:
    """Every member (gzip allows several, one after another), at most `limit` bytes out."""
    out: list[bytes] = []
    size = 0
    data = body
    while True:
        inflater = zlib.decompressobj(wbits)
        while not inflater.eof:
            # At most one byte past the limit out of each step: a bomb never inflates.
            chunk = inflater.decompress(data, limit + 1 - size)
            size += len(chunk)
            out.append(chunk)
            if size > limit:
                raise PayloadTooLarge(
                    f"The request body, decoded, is larger than the limit of {limit} bytes."
                )
            data = inflater.unconsumed_tail
            if not chunk and not data:
                break  # no input left, no output held back: the stream is cut short
        if not inflater.eof:
            raise zlib.error("the body ends before its compressed stream does")
        data = inflater.unused_data
        if not data or wbits != _GZIP:
            if data:
                raise zlib.error("bytes after the compressed stream")
            return b"".join(out)


def _undecodable(coding: str) -> HeaderInvalid:
    return HeaderInvalid(f"The request body is not valid {coding} data.", param=HEADER)
