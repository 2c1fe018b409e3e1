"""Serve mode without a server: the scheduler's serve policy (interactive requests first, spare rows), the
--serve flags, a dropped request releasing its prefix-cache digests on rank 0's engine, the warning for a
server beyond loopback without a key. Servers themselves: tests/runs/test_serve_*.py."""

from __future__ import annotations

import pytest


def test_scheduler_priority_and_spare_rows():
    """Pure scheduler logic: interactive groups go ahead of queued batch lines (in their own arrival
    order), and serve mode sizes a new micro-batch with free rows for requests still to come."""
    from pipeline.scheduling.scheduler import Group, Scheduler, SchedulerConfig, ServePolicy

    s = Scheduler(SchedulerConfig(budget=4096, num_slots=1, max_rows=8), policy=ServePolicy())
    for gid in range(3):
        s.submit(Group(gid, 10, 10))
    s.submit(Group(10, 10, 10, priority=True))
    s.submit(Group(11, 10, 10, priority=True))
    assert [g.gid for g in s.queue] == [10, 11, 0, 1, 2]
    s.shed()
    s.submit(Group(20, 10, 10, priority=True))
    ps = s.next_pass(0)
    assert ps.alloc == (8, 512)  # one request, but 8 rows of 4096 / 8 columns
    s.on_reply(0, [ps.prefill[0][1]], [])
    s.submit(Group(21, 100, 50, priority=True))
    ps = s.next_pass(0)
    assert ps.alloc is None and [gid for gid, _ in ps.prefill] == [21]  # joined the running micro-batch


def test_serve_flags():
    from pipeline.config.options import parse_options, serve_address
    from serve.auth import loopback

    assert serve_address("8000") == ("127.0.0.1", 8000)
    assert serve_address("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert serve_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="HOST:]PORT"):
        serve_address("localhost")
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost") and not loopback("0.0.0.0")
    with pytest.raises(SystemExit):
        parse_options(["--serve", "8000", "--infer-data", "x.jsonl"])
    with pytest.raises(SystemExit):
        parse_options(["--serve", "8000", "--data-group-size", "2"])
    assert parse_options(["--serve", "8000"]).max_pending == 256


def test_dropped_request_releases_its_prefix_digests():
    """A queued request whose client left takes its pending prefix-cache digests with it (they would
    otherwise keep blocks pinned against eviction and count as sharing evidence forever)."""
    from types import SimpleNamespace

    from pipeline.cache.prefix import PrefixCache
    from pipeline.runtime.engine import Engine
    from pipeline.runtime.sources import FutureChannel, Live, Requests
    from pipeline.scheduling.driver import Driver
    from pipeline.scheduling.scheduler import Scheduler, SchedulerConfig, ServePolicy
    from tasks.requests import parse_body

    prefix = PrefixCache(4, 4096)
    driver = Driver(None, 100, 512, Scheduler(SchedulerConfig(4096, 1, 8), prefix=prefix, policy=ServePolicy()))
    source = Requests(10)
    engine = Engine(None, driver, None, SimpleNamespace(), requests=source)
    lives = [Live(parse_body({"prompt": list(range(1, 20)), "max_tokens": 4, "n": n}, False), FutureChannel())
             for n in (1, 2)]
    for live in lives:
        source.submit(live)
    engine._take(source.take())
    assert len(driver.sched.queue) == 2 and prefix.pending[block_key(prefix)] == 2
    engine.cancel(lives[0])
    assert len(driver.sched.queue) == 1 and prefix.pending[block_key(prefix)] == 1
    engine.cancel(lives[1])
    assert not driver.sched.queue and not prefix.pending and not driver.metas
    assert source.pending == 0


def block_key(prefix) -> bytes:
    from pipeline.cache.prefix import block_digests

    return block_digests(list(range(1, 20)), prefix.block_size)[0]


def test_non_loopback_without_key_warns(caplog, monkeypatch, tmp_path):
    """Binding beyond loopback without a key prints a warning before anything loads; a key (flag or
    environment) silences it."""
    from types import SimpleNamespace

    from serve import server as run

    class Loaded(Exception):
        pass

    def make_engine(*_):
        raise Loaded

    monkeypatch.setattr(run, "Requests", make_engine)  # the first thing after the checks: nothing loads
    monkeypatch.delenv(run.API_KEY_ENV, raising=False)
    for serve, key, env, warned in (("0.0.0.0:1", None, None, True), ("127.0.0.1:1", None, None, False),
                                    ("0.0.0.0:1", "k", None, False), ("0.0.0.0:1", None, "k", False)):
        if env:
            monkeypatch.setenv(run.API_KEY_ENV, env)
        caplog.clear()
        with caplog.at_level("WARNING", logger="serve"), pytest.raises(Loaded):
            opts = SimpleNamespace(serve=serve, api_key=key, serve_dir=str(tmp_path), max_pending=1, max_pending_rows=None)
            run.run_server(SimpleNamespace(plan=None, opts=opts), None)
        assert ("without an API key" in caplog.text) == warned, (serve, key, env)
