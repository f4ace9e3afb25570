"""gateway/metrics.py `Children`: a family's labelled children, cached and bounded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.metrics import MAX_CHILDREN, Children, LoopValue, Metrics


def _counter() -> Counter:
    return Counter("c", "A counter.", ["model", "tier", "code"], registry=CollectorRegistry())


def test_a_child_is_the_familys_own_and_looked_up_once() -> None:
    family = _counter()
    children = Children(family)
    child = children("m", "default", "200")
    assert child is family.labels("m", "default", "200")
    assert children("m", "default", "200") is child
    child.inc()
    children("m", "default", "200").inc(2)
    assert family.labels("m", "default", "200")._value.get() == 3


def test_the_cache_is_bounded_and_no_count_is_lost_past_it() -> None:
    family = _counter()
    children = Children(family, limit=4)
    for i in range(10):
        children("m", "t", str(i)).inc()
        assert len(children) <= 4
    children("m", "t", "0").inc()  # dropped from the cache: the family still holds it
    assert family.labels("m", "t", "0")._value.get() == 2
    assert sum(family.labels("m", "t", str(i))._value.get() for i in range(10)) == 11


def test_histogram_children_observe_into_the_family() -> None:
    family = Histogram("h", "A histogram.", ["model", "tier"], registry=CollectorRegistry())
    children = Children(family)
    children("m", "t").observe(0.5)
    assert family.labels("m", "t")._sum.get() == 0.5


def test_the_hot_families_have_caches_of_the_default_bound() -> None:
    metrics = Metrics()
    metrics.requests_of("m", "default", "200").inc()
    metrics.duration_of("m", "default").observe(0.1)
    metrics.ttft_of("m", "default").observe(0.1)
    metrics.tokens_of("m", "default", "prompt").inc(3)
    text = metrics.render().decode()
    assert 'gateway_requests_total{code="200",model="m",tier="default"} 1.0' in text
    assert 'gateway_tokens_total{kind="prompt",model="m",tier="default"} 3.0' in text
    assert MAX_CHILDREN >= 1000


def test_a_single_process_counts_without_a_lock_and_exactly() -> None:
    """Outside `serve --workers`, values are the loop's own (no lock per change): the
    gateway changes metrics on its event loop's thread only."""
    metrics = Metrics()
    child = metrics.requests_of("m", "default", "200")
    assert isinstance(child._value, LoopValue)
    for _ in range(1000):
        child.inc()
    metrics.duration_of("m", "default").observe(0.02)
    text = metrics.render().decode()
    assert 'gateway_requests_total{code="200",model="m",tier="default"} 1000.0' in text
    bucket = 'gateway_request_duration_seconds_bucket{le="0.025",model="m",tier="default"} 1.0'
    assert bucket in text


def test_an_answered_request_counts_as_the_families_would() -> None:
    """`Metrics.served`: one lookup per model and tier; a time to first byte and tokens
    make their series only once there is one to count."""
    metrics = Metrics()
    served = metrics.served("m", "flex")
    assert metrics.served("m", "flex") is served
    served.answered(502, 0.2, None)
    text = metrics.render().decode()
    assert 'gateway_requests_total{code="502",model="m",tier="flex"} 1.0' in text
    assert 'gateway_request_duration_seconds_count{model="m",tier="flex"} 1.0' in text
    assert "gateway_time_to_first_token_seconds_count{" not in text
    assert "gateway_tokens_total{" not in text
    served.answered(200, 0.3, 0.01)
    served.answered(200, 0.3, 0.02)
    served.tokens(5, 7)
    text = metrics.render().decode()
    assert 'gateway_requests_total{code="200",model="m",tier="flex"} 2.0' in text
    assert 'gateway_time_to_first_token_seconds_count{model="m",tier="flex"} 2.0' in text
    assert 'gateway_tokens_total{kind="prompt",model="m",tier="flex"} 5.0' in text
    assert 'gateway_tokens_total{kind="completion",model="m",tier="flex"} 7.0' in text
