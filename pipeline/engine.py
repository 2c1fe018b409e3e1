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
from tasks.writer import OrderedWriter

from .driver import Driver, decode_layout
from .models.decoder import KVCache, Segment, StageModel

log = logging.getLogger(__name__)


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


class StageRunner:
    """This rank's layers and its micro-batch caches."""

    def __init__(self, model: StageModel, device: torch.device):
        self.model, self.device = model, device
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
                start = torch.tensor([hdr["decode_start"][r] for r in rows], device=self.device)
                seg = Segment(torch.tensor(rows, device=self.device), start, 1, int(start.max()) + 1,
                              all_rows=len(rows) == hdr["rows"])
                outs.append(self.model(x_dec.to(self.device), seg, cache))
            if x_pre is not None:
                b, t = len(hdr["prefill"]), x_pre.shape[1]
                rows = torch.tensor([p["row"] for p in hdr["prefill"]], device=self.device)
                seg = Segment(rows, torch.zeros(b, dtype=torch.long, device=self.device), t, t, fresh=True)
                outs.append(self.model(x_pre.to(self.device), seg, cache))
            for lead, dsts, ncols in hdr["forks"]:
                cache.fork(lead, dsts, ncols)
        self.busy += time.perf_counter() - t0
        return pack(outs)


def pack(outs: list[torch.Tensor]) -> torch.Tensor | None:
    """[(r, 1, ...), (b, t, ...)] -> one (r + b*t, ...) tensor to send."""
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
                 head=None, fingerprint: dict | None = None, overwrite: bool = False, progress=None):
        self.info, self.runner, self.msg = info, runner, messenger
        self.driver, self.head = driver, head
        self.fingerprint, self.overwrite = fingerprint or {}, overwrite
        self.progress = progress
        self.writer: OrderedWriter | None = None
        self.local_replies: deque = deque()
        self.next_rank = info.pipeline_rank(info.stage + 1) if not info.is_last else None
        self.prev_rank = info.pipeline_rank(info.stage - 1) if not info.is_first else None
        self.first_rank = info.pipeline_rank(0)

    # -- transport --------------------------------------------------------------------------
    def _forward(self, hdr: dict, x: torch.Tensor | None) -> None:
        """Hand a message to the next stage, or (last stage) act on it."""
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
        reports = []
        for job in jobs:
            self._forward({"op": "open", "output": job.output, "errors": []}, None)
            reply = self._reply()
            if reply.get("error"):
                raise RuntimeError(reply["error"])
            if reply["skip"] is None:
                log.warning("%s: complete output exists at %s, skipping (--overwrite recomputes)", job.input, job.output)
                reports.append(FileReport(job.input, job.output, skipped=True))
                continue
            reports.append(self._drive_file(job, reply["skip"]))
        self._forward({"op": "stop", "errors": []}, None)
        if self.msg is not None:
            self.msg.flush()
        return reports

    def _drive_file(self, job: Job, done: int) -> FileReport:
        from .driver import read_lines

        t0 = time.perf_counter()
        d, sched = self.driver, self.driver.sched
        # `done` counts this share's finished lines; map back to input lines to skip.
        skip = done * self.info.data_size + (self.info.data_rank if done else 0)
        d.start(read_lines(job.input, skip=skip))
        d.requests_read, d.error_kinds = 0, {}
        total = sum(1 for _ in read_lines(job.input))
        if done:
            log.info("%s: resuming after %d finished requests", job.input, done)
        inflight, release = 0, []
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
                self._forward(hdr, self.runner.run(hdr, pack_ids(dec, pre)))
                inflight += 1
                d.fill()
            if inflight == 0:
                if d.exhausted and not sched.queue:
                    break
                raise RuntimeError("scheduler stalled with queued requests and nothing in flight")
            reply = self._reply()
            inflight -= 1
            was = sched.slots[reply["slot"]].allocated
            d.on_reply(reply["slot"], {int(r): t for r, t in reply["feed"]}, reply["finished"])
            if was and not sched.slots[reply["slot"]].allocated:
                release.append(reply["slot"])
            if self.progress is not None:
                self.progress(reply.get("done", 0), reply.get("generated", 0))
        self._forward({"op": "close", "total": total, "errors": d.take_errors(), "release": release}, None)
        reply = self._reply()
        report = FileReport(job.input, job.output, requests=d.requests_read, errors=reply.get("errors", 0),
                            error_kinds=dict(d.error_kinds), prompt_tokens=reply.get("prompt_tokens", 0),
                            generated_tokens=reply.get("generated", 0), seconds=time.perf_counter() - t0)
        if not reply.get("complete"):
            raise RuntimeError(f"{job.output}: the writer did not receive every result")
        return report

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
                self.msg.flush()
                return

    # -- last rank --------------------------------------------------------------------------
    def _on_last(self, hdr: dict, x: torch.Tensor | None) -> dict | None:
        op = hdr["op"]
        for index, line in hdr.get("errors", []):
            self.writer.put(index, line)
            self.file_errors += 1
        if op == "pass":
            return self._last_pass(hdr, x)
        if op == "open":
            self.writer = OrderedWriter(hdr["output"], self.fingerprint, self.info.data_rank, self.info.data_size)
            self.file_errors, self.file_prompt_tokens, self.head.generated_tokens = 0, 0, 0
            try:
                return {"op": "opened", "skip": self.writer.open(self.overwrite)}
            except Exception as e:
                return {"op": "opened", "skip": None, "error": str(e)}
        if op == "close":
            for sid in hdr.get("release", []):
                self.runner.caches.pop(sid, None)
            complete = self.writer.close(hdr["total"])
            return {"op": "closed", "complete": complete, "errors": self.file_errors,
                    "generated": self.head.generated_tokens, "prompt_tokens": self.file_prompt_tokens}
        return None  # stop

    def _last_pass(self, hdr: dict, h: torch.Tensor | None) -> dict:
        slot = hdr["slot"]
        for meta in hdr["admit"]:
            self.head.admit(slot, meta, hdr["rows"])
            self.file_prompt_tokens += len(meta["prompt_ids"])
        h_dec, h_pre = unpack(hdr, h)
        decode_rows = hdr["decode_rows"]
        h_live = None
        if h_dec is not None:  # dense layout computed every slot row; keep the live ones
            dense = len(decode_layout(decode_rows, hdr["rows"])) == hdr["rows"]
            h_live = h_dec[decode_rows, -1] if dense else h_dec[:, -1]
        with torch.inference_mode():
            feed, finished = self.head.on_pass(slot, decode_rows, h_live, hdr["prefill"], h_pre)
        done = self.writer.flush()
        return {"op": "reply", "slot": slot, "feed": sorted(feed.items()), "finished": finished,
                "done": done, "generated": len(decode_rows) + len(hdr["prefill"])}


def pack_ids(dec: torch.Tensor | None, pre: torch.Tensor | None) -> torch.Tensor | None:
    """First-stage inputs in the same packed layout as hidden states: (r + b*t,) token ids."""
    parts = [t.reshape(-1) for t in (dec, pre) if t is not None]
    return torch.cat(parts) if parts else None
