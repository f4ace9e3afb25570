"""Audit of issue 10 item 5: "the release is never skipped, whatever the record holds".
A record that cannot even be built still lets the slot go, and is counted as lost."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gateway.completions import route
from tests.gateway.app.test_app import make_app
from tests.gateway.completions.test_route import BASE, leases_left, records, send


async def test_a_record_that_cannot_be_built_still_releases_and_is_counted_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise ValueError("a record nobody foresaw")

    app, upstream = make_app()
    monkeypatch.setattr(route, "usage_fields", broken)
    rid = uuid.uuid4().hex
    resp = await send(app, BASE + b"}", rid)
    assert resp.status_code == 200, resp.text  # the caller got its answer
    assert len(upstream.sent) == 1
    assert await leases_left(app) == 0
    assert await records(app, rid) == []
    assert app.state.admission.ledger.spool.lost == 1  # gateway_usage_records_lost_total
