"""Rank 0's loops talk to the driver only: it builds each pass the scheduler decides into a header
and ids, tells the scheduler the outcome, and answers what status and metrics read."""

from __future__ import annotations

import ast
from pathlib import Path

import orjson

from pipeline.runtime.messages import Reply
from pipeline.scheduling.driver import Driver
from pipeline.scheduling.scheduler import Scheduler, SchedulerConfig
from tasks.requests import parse_body


def driver(serve: bool = False, chunk: int = 0) -> Driver:
    return Driver(None, 1000, 4096, Scheduler(SchedulerConfig(budget=4000, num_slots=2, max_rows=4, chunk=chunk,
                                                              serve=serve)))


def test_a_file_runs_through_the_driver_alone():
    """Passes built, replies answered, slots released with the next pass or taken at the end; each
    header's prefill ids are the prompt's part the pass says it computes."""
    d = driver(chunk=8)
    reqs = [{"prompt": list(range(100 + i, 120 + i)), "max_tokens": 2} for i in range(3)]
    d.start(iter(enumerate(orjson.dumps(r) for r in reqs)))
    d.fill()
    assert d.queued == 3
    left, released, passes, admitted = {}, [], 0, []
    while True:
        built = [b for sid in d.slot_ids if (b := d.next_pass(sid)) is not None]
        if not built:
            assert d.done and d.running_rows == 0
            break
        for hdr, dec, pre in built:
            passes += 1
            released += hdr.release
            admitted += hdr.admit
            prompts = {m.gid: reqs[m.req]["prompt"] for m in admitted}
            for p, ids in zip(hdr.prefill, pre.tolist() if pre is not None else []):
                assert len(ids) == hdr.prefill_len and p.len - p.cached <= 8
                assert ids[: p.len - p.cached] == prompts[p.gid][p.cached : p.len]  # the part the pass says
            for m in hdr.admit:
                for r in m.rows:
                    left[(hdr.slot, r)] = m.params.max_tokens
            done = [p.row for p in hdr.prefill if not p.partial]
            out = hdr.decode_rows + done
            fin = [r for r in out if left[(hdr.slot, r)] == 1]
            for r in out:
                left[(hdr.slot, r)] -= 1
            d.on_reply(Reply(hdr.slot, [(r, 5) for r in out if r not in fin], fin))
    assert passes >= 4  # 20-token prompts in chunks of 8: three passes each, then a decode step
    assert sorted(released + d.take_released()) == [0, 1] and d.sched.used == 0


def test_a_batch_line_that_cannot_run_is_answered_as_a_batch_line():
    """A line with a custom_id is a Batch API line: without a body it hears so, in the Batch API format; a
    custom_id that is not a string is refused by name (it was written back as the string "None" or "5")."""
    d = driver()
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/completions"},
             {"custom_id": None, "method": "POST", "url": "/v1/completions", "body": {"prompt": [1], "max_tokens": 1}},
             {"custom_id": 5, "method": "POST", "url": "/v1/completions", "body": {"prompt": [1], "max_tokens": 1}}]
    d.start(iter(enumerate(orjson.dumps(x) for x in lines)))
    d.fill()
    out = dict(d.take_errors())
    assert out[0]["custom_id"] == "a" and out[0]["response"]["body"]["error"]["param"] == "body"
    assert out[1]["error"]["param"] == out[2]["response"]["body"]["error"]["param"] == "custom_id"
    assert out[2]["custom_id"] == 5 and d.queued == 0


def test_cancel_and_shed_through_the_driver():
    d = driver(serve=True)
    ids = []
    for i in range(3):
        req = parse_body({"prompt": [1, 2, 3 + i], "max_tokens": 4}, False)
        req.index = 50 + i
        ids.append(d.submit_live(req))
    assert d.queued == 3 and set(d.metas) == {0, 1, 2}
    assert d.cancel(set(ids[1]), 51) == 0 and d.queued == 2 and 1 not in d.metas
    hdr, _, _ = d.next_pass(0)
    assert [m.req for m in hdr.admit] == [50, 52]
    assert d.cancel(set(ids[0]), 50) == 1  # its rows are in slot 0: dropped with its next pass
    d.on_reply(Reply(0, [(r, 9) for r in hdr.decode_rows + [p.row for p in hdr.prefill]], []))
    hdr, _, _ = d.next_pass(0)
    assert hdr.drop == [50]
    req = parse_body({"prompt": [7, 8], "max_tokens": 4}, False)
    req.index = 60
    d.submit_live(req)
    assert [m.req for m in d.shed()] == [60] and d.queued == 0 and d.exhausted


def test_nothing_outside_scheduling_reaches_into_the_scheduler():
    """Rank 0's engine, the server and the factory go through the driver: no ``.sched`` attribute is
    read outside pipeline/scheduling."""
    root = Path(__file__).resolve().parents[4]
    bad, seen = [], set()
    for pkg in ("pipeline", "serve", "tasks", "comm"):
        for path in (root / pkg).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            seen.add(rel)
            if rel.startswith("pipeline/scheduling/"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "sched":
                    bad.append(f"{rel}:{node.lineno}")
    assert {"pipeline/runtime/engine.py", "serve/server.py"} <= seen
    assert not bad, bad
