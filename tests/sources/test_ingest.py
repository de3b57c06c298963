"""``POST /topics/{topic}/entries`` against a real server: added once per Idempotency-Key.

A retry with the same key adds nothing and says how many were there; entries without a key are
spread by their place, the same on a retry; the bearer token is needed as for every write; bad
bodies and a missing key are refused with one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from litestar.testing import TestClient

from pspf.admin_api import create_app
from pspf.service import IngestEntry, Service
from tests.sources.support import topic_entries

pytestmark = pytest.mark.integration

TOKEN = "ingest-token-51c7"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PARTITIONS = 3


@pytest.fixture
def api(service: Service) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(service, token=TOKEN)) as client:
        yield client


def post(api: TestClient[Any], topic: str, body: Any, key: str | None = "req-1", auth: bool = True) -> Any:
    headers = {**(AUTH if auth else {}), **({"Idempotency-Key": key} if key is not None else {})}
    return api.post(f"/topics/{topic}/entries", json=body, headers=headers)


def test_a_retry_with_the_same_key_adds_nothing_and_another_key_adds_again(
    api: TestClient[Any], make_topic: Callable[[int], str], rclient: redis.Redis
) -> None:
    topic = make_topic(PARTITIONS)
    body = [{"key": f"k{n % 5}", "value": {"n": n}, "headers": {"via": "http"}} for n in range(20)]
    body += [{"value": {"n": n}} for n in range(20, 26)] + [{"key": None, "value": [1, "two"]}]

    first = post(api, topic, body)
    assert first.status_code == 200, first.text
    assert first.json() == {"topic": topic, "idempotency_key": "req-1", "added": 27, "already": 0}
    entries = topic_entries(rclient, topic, PARTITIONS)  # keyed ones checked in their key's partition
    assert sorted(str(value) for _, _, value in entries) == sorted(str(e["value"]) for e in body)
    unkeyed = {str(value): partition for partition, key, value in entries if key is None}
    for index, entry in enumerate(body):  # spread by their place: the same on every retry
        if entry.get("key") is None:
            assert unkeyed[str(entry["value"])] == index % PARTITIONS
    headers = {
        fields.get(b"headers")
        for p in range(PARTITIONS)
        for _, fields in rclient.xrange(f"pspf:{{{topic}:{p}}}")
    }
    assert headers == {b'{"via":"http"}', None}

    retry = post(api, topic, body)
    assert retry.status_code == 200
    assert (retry.json()["added"], retry.json()["already"]) == (0, 27)
    assert len(topic_entries(rclient, topic, PARTITIONS)) == 27

    longer = post(api, topic, [*body, {"key": "k9", "value": "late"}])  # the same request, one more entry
    assert (longer.json()["added"], longer.json()["already"]) == (1, 27)
    other = post(api, topic, body[:2], key="req-2")
    assert (other.json()["added"], other.json()["already"]) == (2, 0)
    assert len(topic_entries(rclient, topic, PARTITIONS)) == 30


def test_the_route_needs_the_token_like_every_write(
    api: TestClient[Any], service: Service, make_topic: Callable[[int], str], rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    body = [{"key": "a", "value": 1}]
    missing = post(api, topic, body, auth=False)
    assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]
    wrong = api.post(
        f"/topics/{topic}/entries",
        json=body,
        headers={"Authorization": "Bearer nope", "Idempotency-Key": "x"},
    )
    assert wrong.status_code == 403
    with TestClient(create_app(service, token=None)) as read_only:
        assert read_only.post(f"/topics/{topic}/entries", json=body, headers=AUTH).status_code == 403
    assert topic_entries(rclient, topic, 1) == []


@pytest.mark.parametrize(
    ("body", "key", "says"),
    [
        ({"key": "a", "value": 1}, "r", "invalid request"),  # not an array
        ([{"key": "a"}], "r", "value"),  # no value
        ([{"key": "a", "value": 1, "colour": "red"}], "r", "colour"),  # unknown field
        ([{"key": 7, "value": 1}], "r", "str | null"),  # a key must be text
        ([{"key": "a", "value": 1}], None, "idempotency"),  # no idempotency key
        ([{"key": "a", "value": 1}], "has space", "idempotency"),
    ],
)
def test_bad_requests_are_refused_with_one_line_and_add_nothing(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    body: Any,
    key: str | None,
    says: str,
) -> None:
    topic = make_topic(1)
    response = post(api, topic, body, key=key)
    assert response.status_code == 422, response.text
    message = response.json()["error"]
    assert says in message.lower() and "\n" not in message
    assert topic_entries(rclient, topic, 1) == []


def test_a_missing_topic_is_404(api: TestClient[Any]) -> None:
    response = post(api, "no-such-topic", [{"value": 1}])
    assert response.status_code == 404 and "no-such-topic" in response.json()["error"]


def test_the_service_operation_is_the_same_once_per_key(
    service: Service, make_topic: Callable[[int], str]
) -> None:
    topic = make_topic(2)
    entries = [IngestEntry(key=f"k{n}", value={"n": n}) for n in range(5)]
    assert service.ingest.ingest(topic, entries, "svc-1").added == 5
    again = service.ingest.ingest(topic, entries, "svc-1")
    assert (again.added, again.already) == (0, 5)
