"""status.admission without services: window sums, p95, saturation, and the write threshold."""

from __future__ import annotations

import pytest

from slotserve.admission_stats import (
    MAX_TENANTS_IN_STATUS,
    WAIT_BUCKETS_S,
    WindowCounts,
    quantile,
    summarize,
    wait_bucket,
    windows_to_read,
)
from slotserve.operator.admission import (
    AdmissionReading,
    admission_status,
    saturated_condition,
    saturation_of,
    unavailable,
    worth_writing,
)
from slotserve.operator.models import AdmissionStatus


def reading(queued=0, in_flight=0, admitted=0, rejected=None, p95=None) -> AdmissionReading:
    from slotserve.admission_stats import WindowSummary

    return AdmissionReading(queued, in_flight, WindowSummary(admitted, rejected or {}, p95))


def test_counts_sum_over_replicas_and_scale_to_a_minute():
    a, b = WindowCounts(), WindowCounts()
    for _ in range(30):
        a.admitted("m", 0.02)
    for _ in range(10):
        b.admitted("m", 3.0)
        b.rejected("m", "queue_full")
    windows = [{k: str(v) for k, v in c.take()["m"].items()} for c in (a, b)]
    summary = summarize(windows, covered_s=30.0)  # half a minute read: counts double
    assert summary.admitted_per_minute == 80
    assert summary.rejected_per_minute == {"queue_full": 20}
    # 40 waits: 30 in (0.01, 0.05], 10 in (2.5, 5]; the 38th is in the slow bucket.
    assert summary.queue_wait_p95_s is not None and 2.5 < summary.queue_wait_p95_s <= 5


def test_tenants_are_summed_over_replicas_and_the_most_admitted_listed():
    a, b = WindowCounts(), WindowCounts()
    for _ in range(20):
        a.admitted("m", 0.02, "team-a")
    for _ in range(5):
        b.admitted("m", 3.0, "team-b")
        b.admitted("m", 0.02, "team-a")
    for number in range(MAX_TENANTS_IN_STATUS):  # more tenants than a status lists
        b.admitted("m", 0.0, f"t{number:02d}")
    windows = [{k: str(v) for k, v in c.take()["m"].items()} for c in (a, b)]
    summary = summarize(windows, covered_s=60.0)
    assert summary.admitted_per_minute == 25 + 5 + MAX_TENANTS_IN_STATUS  # the pool's, whole
    assert len(summary.tenants) == MAX_TENANTS_IN_STATUS
    assert summary.tenants["team-a"].admitted_per_minute == 25
    wait_a, wait_b = (summary.tenants[t].queue_wait_p95_s for t in ("team-a", "team-b"))
    assert wait_a is not None and wait_a <= 0.05
    assert summary.tenants["team-b"].admitted_per_minute == 5
    assert wait_b is not None and 2.5 < wait_b <= 5
    assert "t15" not in summary.tenants  # the least admitted (ties: by name) left out
    status = admission_status(AdmissionReading(0, 0, summary), 4, "t")
    assert status["tenants"]["team-b"]["admittedPerMinute"] == 5
    assert set(status["tenants"]["team-a"]) == {"admittedPerMinute", "queueWaitSecondsP95"}
    AdmissionStatus.model_validate(status)  # the shape the CRD declares
    without = admission_status(reading(admitted=3), 4, "t")
    assert "tenants" not in without
    assert worth_writing(without, status, age_s=1.0, max_age_s=30.0)  # tenants appeared


def test_quantile_interpolates_inside_its_bucket_and_caps_at_the_last_bound():
    counts = [0] * (len(WAIT_BUCKETS_S) + 1)
    assert quantile(counts, 0.95) is None
    counts[wait_bucket(0.7)] = 100  # (0.5, 1]
    assert quantile(counts, 0.5) == pytest.approx(0.75)
    counts = [0] * (len(WAIT_BUCKETS_S) + 1)
    counts[-1] = 5  # longer than every bound
    assert quantile(counts, 0.95) == WAIT_BUCKETS_S[-1]


def test_a_failed_flush_keeps_its_counts():
    counts = WindowCounts()
    counts.admitted("m", 0.0)
    taken = counts.take()
    counts.admitted("m", 0.0)
    counts.put_back(taken)
    assert counts.take()["m"]["admitted"] == 2


def test_windows_cover_the_last_minute_and_the_current_window():
    numbers, covered = windows_to_read(1_000_005.0)
    assert numbers[-1] == 100_000 and len(numbers) == 7
    assert covered == pytest.approx(65.0)


@pytest.mark.parametrize(
    ("r", "slots", "status", "reason"),
    [
        (reading(queued=3, in_flight=4), 4, "True", "SlotsFull"),
        (reading(queued=1), 0, "True", "NoCapacity"),
        (reading(in_flight=2, rejected={"queue_full": 3}), 4, "True", "QueueFull"),
        (reading(queued=0, in_flight=4), 4, "False", "HasCapacity"),
        (reading(queued=1, in_flight=2), 4, "False", "HasCapacity"),  # a slot frees at once
    ],
)
def test_saturation(r, slots, status, reason):
    saturation = saturation_of(r, slots)
    assert (saturation.status, saturation.reason) == (status, reason)


def test_admission_status_fields():
    status = admission_status(
        reading(5, 8, 120, {"queue_timeout": 2}, 0.41234), 8, "2026-01-01T00:00:00Z"
    )
    assert status == {
        "queued": 5,
        "inFlight": 8,
        "slotsTotal": 8,
        "admittedPerMinute": 120,
        "rejectedPerMinute": {"queue_timeout": 2},
        "queueWaitSecondsP95": 0.412,
        "saturated": True,
        "observedTime": "2026-01-01T00:00:00Z",
    }


def _status(**changes):
    base = admission_status(reading(100, 32, 600, {}, 1.0), 32, "t")
    return {**base, **changes}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, False),
        ({"queued": 105}, False),  # within 10%
        ({"queued": 120}, True),
        ({"queued": 0, "saturated": False}, True),
        ({"inFlight": 31}, False),
        ({"admittedPerMinute": 640}, False),
        ({"admittedPerMinute": 700}, True),
        ({"rejectedPerMinute": {"queue_full": 1}}, True),  # a new reason appears
        ({"queueWaitSecondsP95": 1.1}, False),
        ({"queueWaitSecondsP95": 1.5}, True),
        ({"slotsTotal": 64}, True),
        ({"observedTime": "later"}, False),
    ],
)
def test_worth_writing_thresholds(changes, expected):
    assert worth_writing(_status(), _status(**changes), age_s=1, max_age_s=60) is expected


def test_worth_writing_when_old_or_first():
    assert worth_writing(None, _status(), age_s=0, max_age_s=60)
    assert worth_writing(_status(), _status(), age_s=60, max_age_s=60)


def test_small_counts_from_zero_are_always_news():
    zero = admission_status(reading(), 0, "t")
    one = admission_status(reading(queued=1), 0, "t")
    assert worth_writing(zero, one, age_s=0, max_age_s=60)


def test_saturated_condition_keeps_its_transition_time_while_the_status_holds():
    first = saturated_condition(unavailable("refused"), None, "t1")
    assert (first["status"], first["reason"], first["lastTransitionTime"]) == (
        "Unknown",
        "AdmissionUnavailable",
        "t1",
    )
    same = saturated_condition(unavailable("timeout"), first, "t2")
    assert same["lastTransitionTime"] == "t1"
    flipped = saturated_condition(saturation_of(reading(), 4), same, "t3")
    assert flipped["lastTransitionTime"] == "t3"
