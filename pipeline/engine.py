"""The per-rank loop: receive -> forward -> send, with the sampled tokens ringing back to rank 0.

Rank 0 (first stage) drives: it reads requests, schedules passes and embeds tokens. Middle ranks
only run their layers. The last rank samples and writes. Control messages ("open" a file,
"close" it, "stop") travel the same path as passes, so every rank sees them in order.
With one process the same code runs without any message passing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from comm.dist import DistInfo
from comm.faults import maybe_fail
from tasks.writer import OrderedWriter

from .driver import Driver, decode_layout
from .models.decoder import KVCache, Segment, StageModel

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A problem the user can fix (reported in one line, no traceback)."""


@dataclass
class Job:
    input: str
    output: str


@dataclass
class FileReport:
    input: str
    output: str
    skipped: bool = False
    requests: int = 0
    errors: int = 0
    error_kinds: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    summary: dict = field(default_factory=dict)


class StageRunner:
    """This rank's layers and its micro-batch caches."""

    def __init__(self, model: StageModel, device: torch.device, trace=None):
        self.model, self.device, self.trace = model, device, trace
        self.caches: dict[int, KVCache] = {}
        self.busy = 0.0  # seconds spent computing

    def run(self, hdr: dict, x: torch.Tensor | None) -> torch.Tensor | None:
        """Forward one pass. ``x``: packed inputs (ids on the first stage, hidden states elsewhere)."""
        t0 = time.perf_counter()
        for sid in hdr["release"]:
            self.caches.pop(sid, None)
        if hdr["alloc"]:
            self.caches[hdr["slot"]] = self.model.new_cache(*hdr["alloc"])
        cache = self.caches[hdr["slot"]]
        x_dec, x_pre = unpack(hdr, x)
        outs = []
        with torch.inference_mode():
            if x_dec is not None:
                rows = decode_layout(hdr["decode_rows"], hdr["rows"])
                starts = [hdr["decode_start"][r] for r in rows]
                seg = Segment(torch.tensor(rows, device=self.device), torch.tensor(starts, device=self.device), 1,
                              max(starts) + 1, all_rows=len(rows) == hdr["rows"], host_rows=rows,
                              host_start=starts, lens=[1] * len(rows))
                outs.append(self.model(x_dec.to(self.device), seg, cache))
            if x_pre is not None:
                b, t = len(hdr["prefill"]), x_pre.shape[1]
                rows = [p["row"] for p in hdr["prefill"]]
                seg = Segment(torch.tensor(rows, device=self.device), torch.zeros(b, dtype=torch.long, device=self.device),
                              t, t, fresh=True, host_rows=rows, host_start=[0] * b, lens=[p["len"] for p in hdr["prefill"]])
                outs.append(self.model(x_pre.to(self.device), seg, cache))
            for lead, dsts, ncols in hdr["forks"]:
                cache.fork(lead, dsts, ncols)
        t1 = time.perf_counter()
        self.busy += t1 - t0
        hdr["busy"] = hdr.get("busy", []) + [self.busy]  # every stage's cumulative compute, for the summary
        if self.trace is not None:
            self.trace.add("forward", t0, t1, args={"slot": hdr["slot"], "decode": len(hdr["decode_rows"]),
                                                    "prefill": len(hdr["prefill"])})
        return pack(outs)


def pack(outs: list[torch.Tensor]) -> torch.Tensor | None:
    """[(r, 1, ...), (b, t, ...)] -> one (r + b*t, ...) tensor: hidden states, or token ids on the first stage."""
    if not outs:
        return None
    return torch.cat([o.reshape(-1, *o.shape[2:]) for o in outs])


def unpack(hdr: dict, x: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Inverse of :func:`pack`, shapes from the header."""
    if x is None:
        return None, None
    r = len(decode_layout(hdr["decode_rows"], hdr["rows"])) if hdr["decode_rows"] else 0
    b = len(hdr["prefill"])
    t = max((p["len"] for p in hdr["prefill"]), default=0)
    x_dec = x[:r].reshape(r, 1, *x.shape[1:]) if r else None
    x_pre = x[r:].reshape(b, t, *x.shape[1:]) if b else None
    return x_dec, x_pre


class Engine:
    def __init__(self, info: DistInfo, runner: StageRunner, messenger=None, driver: Driver | None = None,
                 head=None, fingerprint: dict | None = None, overwrite: bool = False, show_progress: bool = True,
                 trace=None):
        self.info, self.runner, self.msg = info, runner, messenger
        self.driver, self.head = driver, head
        self.fingerprint, self.overwrite = fingerprint or {}, overwrite
        self.show_progress, self.trace = show_progress, trace
        self.writer: OrderedWriter | None = None
        self.file: dict = {}  # last rank: figures of the file being written
        self.outputs: list[str] = []  # every output this rank has seen (for the trace's location)
        self.local_replies: deque = deque()
        self.next_rank = info.pipeline_rank(info.stage + 1) if not info.is_last else None
        self.prev_rank = info.pipeline_rank(info.stage - 1) if not info.is_first else None
        self.first_rank = info.pipeline_rank(0)

    # -- transport --------------------------------------------------------------------------
    def _forward(self, hdr: dict, x: torch.Tensor | None) -> None:
        """Hand a message to the next stage, or (last stage) act on it."""
        if hdr["op"] == "open":
            self.outputs.append(hdr["output"])
            self.runner.busy = 0.0  # busy fractions are per file
        if self.info.is_last:
            reply = self._on_last(hdr, x)
            if reply is not None:
                if self.info.is_first:
                    self.local_replies.append(reply)
                else:
                    self.msg.send(self.first_rank, reply)
        else:
            self.msg.send(self.next_rank, hdr, x)

    def _reply(self) -> dict:
        if self.info.is_first and self.info.is_last:
            return self.local_replies.popleft()
        hdr, _ = self.msg.recv(self.info.pipeline_rank(self.info.pipeline_size - 1))
        return hdr

    # -- rank 0 -----------------------------------------------------------------------------
    def drive(self, jobs: list[Job]) -> list[FileReport]:
        from .driver import input_fingerprint, read_lines

        reports = []
        for job in jobs:
            total = sum(1 for _ in read_lines(job.input))
            self._forward({"op": "open", "output": job.output, "input": job.input, "total": total,
                           "input_id": input_fingerprint(job.input), "errors": []}, None)
            reply = self._reply()
            if reply.get("error"):
                raise RunError(reply["error"])
            if reply["skip"] is None:
                log.warning("%s: complete output exists at %s, skipping (--overwrite recomputes)", job.input, job.output)
                reports.append(FileReport(job.input, job.output, skipped=True))
                continue
            reports.append(self._drive_file(job, reply["skip"], total))
        self._forward({"op": "stop", "errors": []}, None)
        self.finish()
        return reports

    def finish(self) -> None:
        """End of the run on this rank: messages out, trace written."""
        if self.msg is not None:
            self.msg.flush()
        if self.trace is not None and self.outputs:
            path = f"{self.outputs[-1]}.trace-rank{self.info.rank}.json"
            log.info("profile trace: %s", self.trace.save(path))

    def _drive_file(self, job: Job, done: int, total: int) -> FileReport:
        from .driver import read_lines

        t0 = time.perf_counter()
        d, sched = self.driver, self.driver.sched
        # `done` counts this share's finished lines; its next line is input index data_rank + done * D.
        d.start(read_lines(job.input, skip=self.info.data_rank + done * self.info.data_size))
        d.requests_read, d.error_kinds, d.encode_seconds = 0, {}, 0.0
        if done:
            log.info("%s: resuming after %d finished requests", job.input, done)
        inflight, replies, release = 0, 0, []
        while True:
            d.fill()
            for slot in sched.slots:
                if slot.inflight:
                    continue
                ps = sched.next_pass(slot.sid)
                if ps is None:
                    continue
                hdr, dec, pre = d.build(ps, release)
                release = []
                self._forward(hdr, self.runner.run(hdr, pack([t for t in (dec, pre) if t is not None])))
                inflight += 1
                d.fill()
            if inflight == 0:
                if d.exhausted and not sched.queue:
                    break
                raise RuntimeError("scheduler stalled with queued requests and nothing in flight")
            reply = self._reply()
            inflight -= 1
            replies += 1
            if replies == 10:
                maybe_fail("drive", self.info.rank)
            was = sched.slots[reply["slot"]].allocated
            d.on_reply(reply["slot"], {int(r): t for r, t in reply["feed"]}, reply["finished"])
            if was and not sched.slots[reply["slot"]].allocated:
                release.append(reply["slot"])
        self._forward({"op": "close", "total": total, "errors": d.take_errors(), "release": release,
                       "requests": d.requests_read, "error_kinds": d.error_kinds, "encode_seconds": d.encode_seconds,
                       "padding_waste": sched.padding_waste / max(1, sched.allocated_cells)}, None)
        reply = self._reply()
        if not reply.get("complete"):
            raise RuntimeError(f"{job.output}: the writer did not receive every result")
        s = reply["summary"]
        return FileReport(job.input, job.output, requests=d.requests_read, errors=s["errors"],
                          error_kinds=dict(d.error_kinds), prompt_tokens=s["prompt_tokens"],
                          generated_tokens=s["completion_tokens"], seconds=time.perf_counter() - t0,
                          summary=s)

    # -- middle ranks -----------------------------------------------------------------------
    def serve(self) -> None:
        """Every rank but the first: receive until "stop"."""
        while True:
            hdr, x = self.msg.recv(self.prev_rank)
            if hdr["op"] == "pass":
                out = self.runner.run(hdr, x)
                if self.info.is_last:
                    self._forward(hdr, out)
                else:
                    self.msg.send(self.next_rank, hdr, out)
            else:
                self._forward(hdr, x)
            if hdr["op"] == "stop":
                self.finish()
                return

    # -- last rank --------------------------------------------------------------------------
    def _on_last(self, hdr: dict, x: torch.Tensor | None) -> dict | None:
        op = hdr["op"]
        for index, line in hdr.get("errors", []):
            self.writer.put(index, line)
            self.file["errors"] += 1
        if op == "pass":
            return self._last_pass(hdr, x)
        if op == "open":
            return self._open(hdr)
        if op == "close":
            return self._close(hdr)
        return None  # stop

    def _open(self, hdr: dict) -> dict:
        fingerprint = dict(self.fingerprint, input=hdr.get("input_id"))
        self.writer = OrderedWriter(hdr["output"], fingerprint, self.info.data_rank, self.info.data_size)
        try:
            skip = self.writer.open(self.overwrite)
        except Exception as e:
            return {"op": "opened", "skip": None, "error": str(e)}
        share_total = len(range(self.info.data_rank, hdr["total"], self.info.data_size))
        self.file = {"errors": 0, "prompt_tokens": 0, "t0": time.perf_counter(), "busy": [],
                     "decode_seconds": 0.0, "progress": None}
        self.head.generated_tokens, self.head.format_seconds = 0, 0.0
        if skip is not None and self.show_progress:
            from tasks.progress import Progress

            self.file["progress"] = Progress(hdr["output"], share_total, skip)
        return {"op": "opened", "skip": skip}

    def _close(self, hdr: dict) -> dict:
        for sid in hdr.get("release", []):
            self.runner.caches.pop(sid, None)
        f = self.file
        if f["progress"] is not None:
            f["progress"].close()
        complete = self.writer.close(hdr["total"])
        wall = time.perf_counter() - f["t0"]
        summary = {
            "output": str(self.writer.output), "requests": hdr["requests"], "errors": f["errors"],
            "answered": hdr["requests"] - f["errors"], "error_kinds": hdr["error_kinds"],
            "prompt_tokens": f["prompt_tokens"], "completion_tokens": self.head.generated_tokens,
            "wall_seconds": round(wall, 3),
            "completion_tokens_per_second": round(self.head.generated_tokens / wall, 2) if wall else None,
            "stage_busy": [round(b / wall, 4) for b in f["busy"]] if wall else [],
            "padding_waste": round(hdr.get("padding_waste", 0.0), 4),
            "encode_seconds": round(hdr.get("encode_seconds", 0.0), 4),
            "decode_seconds": round(self.head.format_seconds, 4),
            "pipeline_size": self.info.pipeline_size, "data_group_size": self.info.data_size,
            "data_rank": self.info.data_rank, "last_rank_peak_rss_mb": round(peak_rss_mb(), 1),
        }
        if complete:
            _write_json(summary_path(self.writer.output, self.info.data_rank, self.info.data_size), summary)
            if self.info.data_size > 1:
                from tasks.writer import try_merge_shares

                try_merge_shares(self.writer.output, self.info.data_size, hdr["total"])
        return {"op": "closed", "complete": complete, "summary": summary}

    def _last_pass(self, hdr: dict, h: torch.Tensor | None) -> dict:
        slot = hdr["slot"]
        t0 = time.perf_counter()
        for meta in hdr["admit"]:
            self.head.admit(slot, meta, hdr["rows"])
            self.file["prompt_tokens"] += len(meta["prompt_ids"])
        h_dec, h_pre = unpack(hdr, h)
        decode_rows = hdr["decode_rows"]
        h_live = None
        if h_dec is not None:  # dense layout computed every slot row; keep the live ones
            dense = len(decode_layout(decode_rows, hdr["rows"])) == hdr["rows"]
            h_live = h_dec[decode_rows, -1] if dense else h_dec[:, -1]
        with torch.inference_mode():
            feed, finished = self.head.on_pass(slot, decode_rows, h_live, hdr["prefill"], h_pre)
        done = self.writer.flush()
        if self.writer.written >= 3:
            maybe_fail("midgen", self.info.rank)
        elif hdr["prefill"]:
            maybe_fail("prefill", self.info.rank)
        t1 = time.perf_counter()
        self.runner.busy += t1 - t0
        if self.trace is not None:
            self.trace.add("sample+write", t0, t1, args={"slot": slot})
        self.file["busy"] = hdr["busy"][:-1] + [self.runner.busy]  # each stage's compute seconds in this file
        if self.file["progress"] is not None:
            self.file["progress"].update(done, self.head.generated_tokens)
        return {"op": "reply", "slot": slot, "feed": sorted(feed.items()), "finished": finished}


def peak_rss_mb() -> float:
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def summary_path(output, data_rank: int, data_size: int) -> str:
    suffix = ".summary.json" if data_size == 1 else f".summary-{data_rank}-of-{data_size}.json"
    return str(output) + suffix


def _write_json(path: str, obj: dict) -> None:
    import json
    import os

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
