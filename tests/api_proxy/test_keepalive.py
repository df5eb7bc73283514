"""Keep-alive and warm limits: pure policies, exact expectations."""

from __future__ import annotations

import pytest

from streambox.api_proxy.keepalive import (
    PAPER_PROXIES_PER_DEVICE,
    Acquire,
    Admission,
    InstancePool,
    WarmProxies,
)


def test_first_request_starts_an_instance_then_reuses_it_warm():
    pool = InstancePool(max_instances=2, keep_alive_s=10)
    assert pool.acquire(0.0) == Acquire("start")
    pool.add("a", 0.0)
    pool.release("a", 1.0)
    assert pool.acquire(2.0) == Acquire("warm", "a")
    assert pool.busy == ["a"]


def test_concurrent_requests_start_up_to_the_limit_then_queue():
    pool = InstancePool(max_instances=2, keep_alive_s=10)
    assert pool.acquire(0.0).action == "start"
    pool.add("a", 0.0)
    assert pool.acquire(0.0).action == "start"
    pool.add("b", 0.0)
    assert pool.acquire(0.0) == Acquire("queue")
    with pytest.raises(RuntimeError, match="full"):
        pool.add("c", 0.0)


def test_most_recently_used_idle_instance_is_taken_so_the_others_expire():
    pool = InstancePool(max_instances=3, keep_alive_s=10)
    for name, t in (("a", 0.0), ("b", 0.0), ("c", 0.0)):
        pool.add(name, t)
    pool.release("a", 1.0)
    pool.release("b", 3.0)
    pool.release("c", 2.0)
    assert pool.acquire(4.0) == Acquire("warm", "b")
    pool.release("b", 5.0)
    # a idle since 1, c since 2, b since 5: at t=12.5 a and c have expired (oldest first), b has not
    assert pool.expired(12.5) == ["a", "c"]
    assert pool.next_expiry() == 11.0


def test_scale_to_zero_after_keep_alive():
    pool = InstancePool(max_instances=2, keep_alive_s=600)
    pool.add("a", 0.0)
    pool.release("a", 10.0)
    assert pool.expired(609.9) == []
    assert pool.expired(610.0) == ["a"]
    pool.remove("a")
    assert len(pool) == 0
    assert pool.acquire(611.0) == Acquire("start")


def test_a_busy_instance_never_expires():
    pool = InstancePool(max_instances=1, keep_alive_s=1)
    pool.add("a", 0.0)
    assert pool.expired(100.0) == []
    assert pool.next_expiry() is None


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError):
        InstancePool(max_instances=0)
    with pytest.raises(ValueError):
        InstancePool(max_instances=1, keep_alive_s=-1)


def test_a_count_cap_evicts_the_longest_idle_proxy_first():
    warm = WarmProxies(devices=1, max_per_device=PAPER_PROXIES_PER_DEVICE, keep_alive_s=600)
    for i, name in enumerate(("a", "b", "c")):
        assert warm.admit(name, float(i)) == Admission(0)
        warm.started(name, 0, float(i))
    warm.begin("a", 10.0)
    warm.end("a", 11.0)  # a was used last
    warm.begin("b", 5.0)
    warm.end("b", 6.0)
    # c idle since 2, b since 6, a since 11: c goes
    assert warm.admit("d", 12.0) == Admission(0, evict=("c",))
    assert warm.admit("a", 12.0) == Admission(0)  # warm already: nothing to do


def test_busy_proxies_are_not_evicted_the_caller_waits():
    warm = WarmProxies(devices=1, max_per_device=2)
    for name in ("a", "b"):
        warm.started(name, 0, 0.0)
        warm.begin(name, 1.0)
    assert warm.admit("c", 2.0) == Admission(0, wait=True)
    warm.end("b", 3.0)
    assert warm.admit("c", 4.0) == Admission(0, evict=("b",))


def test_a_fresh_proxy_is_not_evicted_before_the_request_that_started_it_begins():
    warm = WarmProxies(devices=1, max_per_device=1)
    warm.started("a", 0, 0.0)
    warm.begin("a", 0.0, reservation=True)
    warm.end("a", 1.0)  # started; its request has not resumed yet
    assert warm.admit("b", 1.5) == Admission(0, wait=True)
    assert warm.admit("b", 2.0) == Admission(0, evict=("a",))  # START_GRACE_S: that request gave up
    warm.remove("a")
    warm.started("b", 0, 2.0)
    warm.begin("b", 2.0, reservation=True)
    warm.end("b", 3.0)
    warm.begin("b", 3.1)  # its request
    warm.end("b", 3.2)
    assert warm.admit("a", 3.3) == Admission(0, evict=("b",))


def test_a_waiter_makes_the_busy_proxies_of_its_gpu_yield_once_both_have_waited_their_turn():
    warm = WarmProxies(devices=1, max_per_device=1, yield_after_s=5.0)
    warm.started("a", 0, 0.0)
    warm.begin("a", 0.1)  # a request that keeps `a` busy
    for tick in range(50):  # `b` asks every 0.1 s from 1.0 on (the invoker: every 10 ms)
        assert warm.admit("b", 1.0 + tick / 10) == Admission(0, wait=True)
    assert not warm.yields("a", 5.9)  # `b` has waited 4.9 s
    assert warm.admit("b", 6.0) == Admission(0, wait=True)
    assert warm.yields("a", 6.0) and not warm.yields("b", 6.0)
    assert not warm.yields("a", 6.6)  # `b` stopped asking (its request gave up): forgotten
    assert warm.admit("b", 7.0) == Admission(0, wait=True)  # asks again: its wait starts over
    assert not warm.yields("a", 7.0)
    warm.end("a", 12.5)
    assert warm.admit("b", 12.5) == Admission(0, evict=("a",))
    warm.remove("a")
    warm.started("b", 0, 12.5)
    assert not warm.yields("b", 30.0)  # nobody waits
    with pytest.raises(ValueError, match="yield_after_s"):
        WarmProxies(yield_after_s=-1)


def test_proxies_are_admitted_by_memory_with_no_count_cap():
    """Six 1 GB proxies fit a 16 GB GPU; what does not fit evicts idle ones, longest-idle first, until it
    does, waits while the rest are busy, and an empty GPU admits even what cannot fit."""
    gib = 1 << 30
    warm = WarmProxies(devices=1)
    for i in range(6):
        # The node reports what the ready proxies hold; started ones count by their footprint.
        assert warm.admit(f"p{i}", 0.0, free=[16 * gib], footprint=gib) == Admission(0)
        warm.started(f"p{i}", 0, float(i), footprint=gib)
    assert len(warm.warm(0)) == 6
    # 10 GB left while all six start: a 13 GB proxy evicts three, longest-idle first.
    assert warm.admit("big", 9.0, free=[16 * gib], footprint=13 * gib) == Admission(
        0, evict=("p0", "p1", "p2")
    )
    for i in range(6):
        warm.ready(f"p{i}")  # now the node's figure holds them: 10 GB free
    assert warm.admit("big", 9.0, free=[10 * gib], footprint=11 * gib) == Admission(0, evict=("p0",))
    for i in range(6):
        warm.begin(f"p{i}", 10.0)  # every one busy
    assert warm.admit("big", 11.0, free=[10 * gib], footprint=11 * gib) == Admission(0, wait=True)
    empty = WarmProxies(devices=1)
    assert empty.admit("huge", 0.0, free=[16 * gib], footprint=20 * gib) == Admission(0, fits=False)


def test_new_proxies_go_to_the_least_loaded_gpu():
    warm = WarmProxies(devices=2, max_per_device=3)
    assert warm.admit("a", 0.0).device == 0
    warm.started("a", 0, 0.0)
    assert warm.admit("b", 0.0).device == 1
    warm.started("b", 1, 0.0)
    assert warm.admit("c", 0.0).device == 0
    with pytest.raises(RuntimeError):
        for name in ("x", "y", "z"):
            warm.started(name, 0, 0.0)


def test_idle_proxies_expire_after_keep_alive():
    warm = WarmProxies(devices=1, max_per_device=3, keep_alive_s=600)
    warm.started("a", 0, 0.0)
    warm.started("b", 0, 100.0)
    warm.begin("b", 100.0)
    assert warm.expired(700.0) == ["a"]
    warm.remove("a")
    assert warm.warm() == ["b"]


def test_pinned_instances_and_proxies_never_expire_and_count_as_used_when_unpinned():
    pool = InstancePool(max_instances=2, keep_alive_s=10)
    pool.add("idle", 0.0)
    pool.release("idle", 0.0)
    pool.add("busy", 0.0)
    pool.pin()  # a replay's warm-up: the deploys after this workflow's take 30 s
    assert pool.expired(30.0) == [] and pool.next_expiry() is None
    pool.unpin(30.0)  # the replay's clock starts
    assert pool.expired(39.0) == [] and pool.next_expiry() == 40.0 and pool.expired(40.0) == ["idle"]
    assert pool.busy == ["busy"]  # a busy instance stays busy
    proxies = WarmProxies(keep_alive_s=10)
    proxies.started("wf", 0, 0.0)
    proxies.started("other", 0, 0.0)
    proxies.pin("wf")
    proxies.pin("gone")  # not warm: nothing to do
    assert proxies.expired(30.0) == ["other"]
    proxies.unpin("wf", 30.0)
    assert proxies.expired(39.0) == ["other"] and proxies.expired(40.0) == ["other", "wf"]


def test_weight_cache_restart_idle_counts_idle_models_from_then_and_leaves_used_ones():
    from streambox.memory_pool.mapping_table import WeightCache

    cache = WeightCache()
    cache.acquire("idle", 0.0)
    cache.release("idle", 0.0)
    cache.acquire("used", 0.0)
    cache.restart_idle(30.0)
    assert cache.expired(39.0, 10.0) == [] and cache.expired(40.5, 10.0) == ["idle"]
    assert cache.idle_since("used") is None
