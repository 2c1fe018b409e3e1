"""The last stage's answers: what it does with each message after its layers ran (:meth:`LastRank.handle`:
a file's output opened and closed, a pass's groups admitted and sampled with the
:class:`~pipeline.output.head.Head`, error lines written in their input position).
"""

from __future__ import annotations

import time

import torch

from comm.dist import DistInfo
from comm.faults import LINE, PREFILL
from tasks.output_file import FileStats, OutputFile
from tasks.protocol import CANCELLED
from tasks.shards import share_size

from pipeline.output.head import Head
from pipeline.runtime.messages import Admitting, CloseFile, Closed, Message, OpenFile, Opened, PassHeader, Reply, Stop
from pipeline.runtime.stage import Stage, unpack


class LastRank:
    def __init__(self, stage: Stage, info: DistInfo, head: Head, fingerprint: dict, overwrite: bool = False,
                 show_progress: bool = True):
        self.stage, self.info, self.head = stage, info, head
        self.fingerprint, self.overwrite, self.show_progress = fingerprint, overwrite, show_progress
        self.file: OutputFile | None = None
        self.status = None  # file mode: the run's tasks.status.RunStatus (pipeline.runtime.monitor)
        self.checkpoint_interval = 0.0  # seconds between checkpoints of the rows in flight (0: only at a stop)
        self._checkpointed = 0.0

    def handle(self, msg: Message, x: torch.Tensor | None) -> Message | None:
        """Act on a message that went through this stage's layers; the answer for rank 0, if any."""
        for index, line in getattr(msg, "errors", []):  # only ever with a file open
            self.file.put(index, line, error=True)
        if isinstance(msg, PassHeader):
            return self._pass(msg, x)
        if isinstance(msg, Admitting):
            return self.record(msg)
        if isinstance(msg, OpenFile):
            return self._open(msg)
        if isinstance(msg, CloseFile):
            return self._close(msg)
        assert isinstance(msg, Stop), msg
        if self.file is not None:  # stopped with the file open: its rows in flight resume where they are
            self.file.checkpoint(self.head.checkpoint())
            if self.file.inflight is not None:  # a stop, not a crash: the next run suspects nobody
                self.file.inflight.close(complete=False)  # (closed: a process that goes on holds no record)
        if self.status is not None:  # (a signal's reason, written first, stays)
            self.status.finish("stopped" if self.file is not None else "finished")
        return None

    def idle(self) -> None:
        """Between passes, once the answer has left (P > 1): the masks computed ahead without a thread."""
        masks = self.head.constraints.masks
        if masks.flushed:
            masks.idle()

    def _open(self, msg: OpenFile) -> Opened:
        self.file = OutputFile(msg.output, dict(self.fingerprint, input=msg.input_id), self.info.data_rank,
                               self.info.data_size)
        self.head.start_file()
        try:
            skip = self.file.open(msg.total, self.overwrite, self.show_progress)
            if self.status is not None:
                if skip is None:
                    self.status.skip_file(msg.output)
                else:
                    self.status.open_file(msg.input, msg.output, share_size(self.info.data_rank, msg.total,
                                                                            self.info.data_size), skip)
            self.head.resume = self.file.resumed_rows() if skip is not None else {}
            answered = self.file.restore_answered() if skip is not None else []
            self._checkpointed = time.monotonic()
            kept = set(answered)  # answered before the crash: no longer suspects
            return Opened(skip, suspects=[i for i in self.file.suspects if i not in kept],
                          culprits=[i for i in self.file.culprits if i not in kept],
                          resume=[[i, r["ids"]] for i, r in sorted(self.head.resume.items())], answered=answered)
        except Exception as e:  # e.g. a journal of other settings: rank 0 reports it and stops
            self.file = None
            return Opened(None, error=str(e))

    @staticmethod
    def admitting(hdr: PassHeader) -> Admitting | None:
        """The open file's lines ``hdr`` admits (None: none), to record before anything computes them."""
        batch = [m for m in hdr.admit if not m.live]
        if not batch:
            return None
        return Admitting(sorted({m.req for m in batch if not (m.alone or m.probe)}),
                         sorted({m.req for m in batch if m.alone}), sorted({m.req for m in batch if m.probe}),
                         max(m.probe for m in batch))

    def record(self, msg: Admitting) -> None:
        """Note the file's lines a pass admits before they are computed (tasks.inflight): with P = 1 rank
        0 calls this before its forward; else rank 0 sends :class:`Admitting` ahead of the pass."""
        if self.file is None or self.file.inflight is None:
            return
        self.file.inflight.admitted(msg.lines, msg.alone, msg.probe, msg.group)
        if LINE.armed:
            LINE.admit(msg.lines + msg.alone + msg.probe)

    def _pass(self, hdr: PassHeader, h: torch.Tensor | None) -> Reply:
        t0 = self.stage.mark()
        for meta in hdr.admit:
            self.head.admit(hdr.slot, meta, hdr.rows)
            if not meta.live:
                self.file.prompt_tokens += len(meta.prompt_ids)
        dropped = self.head.drop(hdr.slot, set(hdr.drop)) if hdr.drop else []
        if hdr.cancel:  # a cancelled file's rows end now, answered as cancelled
            dropped += self.head.cancel(hdr.slot, set(hdr.cancel), CANCELLED.to_dict())
        if hdr.failed is not None:
            return self._failed(hdr, dropped, t0)
        h_dec, h_pre = unpack(hdr, h)
        h_live, decode_rows = None, hdr.decode_rows
        if h_dec is not None:  # a dense decode segment computed every slot row: keep the live ones
            h_live = h_dec[hdr.decode_rows, -1] if hdr.dense else h_dec[:, -1]
        if dropped and decode_rows:
            keep = [i for i, r in enumerate(decode_rows) if r not in dropped]
            decode_rows, h_live = [decode_rows[i] for i in keep], h_live[keep]
        groups = [self.head.groups.get(p.gid) for p in hdr.prefill]
        if self.file is not None:
            self.file.cached_tokens += sum(p.cached for p, g in zip(hdr.prefill, groups)
                                           if g and not g.meta.live and not p.resumed)
        with torch.inference_mode():
            feed, finished = self.head.on_pass(hdr.slot, decode_rows, h_live, hdr.prefill, h_pre, self.stage.prefix)
        return self._reply(hdr, feed, finished, dropped, t0)

    def _failed(self, hdr: PassHeader, dropped: list[int], t0: float) -> Reply:
        """A pass no stage computed to the end: nothing is sampled (rank 0 computes its groups again
        one at a time, pipeline.runtime.retry); when it was such a retry, its group is the culprit and
        its request is answered with an error."""
        finished = []
        if hdr.retry:
            rows = [*hdr.decode_rows, *(r for p in hdr.prefill for r in self.head.rows_of(p.gid))]
            finished = self.head.fail_rows(hdr.slot, [r for r in dict.fromkeys(rows) if r not in dropped],
                                           hdr.failed)
        reply = self._reply(hdr, {}, finished, dropped, t0)
        reply.failed = hdr.failed
        return reply

    def _reply(self, hdr: PassHeader, feed: dict, finished: list[int], dropped: list[int], t0: float) -> Reply:
        taken = self.head.answers.take()
        for index, line in taken.results:
            failed = line.get("error") is not None  # a row whose computation raised (pipeline.output.head)
            self.file.put(index, line, error=failed)
            if failed:  # the request's own field (a grammar that could not go on), else the computation
                err = line["error"]
                kind = err.get("param") or ("cancelled" if err.get("type") == CANCELLED.kind else "computation")
                self.file.kinds[kind] = self.file.kinds.get(kind, 0) + 1
        if PREFILL.armed:
            PREFILL.tick(ready=bool(hdr.prefill))
        if self.file is not None:
            self.file.flush(self.head.generated_tokens)
            now = time.monotonic()  # every checkpoint_interval seconds the rows in flight, for a rerun to resume
            if self.checkpoint_interval and now - self._checkpointed >= self.checkpoint_interval:
                self._checkpointed = now
                self.file.checkpoint(self.head.checkpoint())
        self.stage.clock("sample+write", t0, slot=hdr.slot)
        if self.status is not None and self.file is not None:
            f = self.file
            self.status.progress(f.answered, f.errors, f.prompt_tokens, f.cached_tokens, self.head.generated_tokens,
                                 hdr.stats, f.writer.written)
        return Reply(hdr.slot, sorted(feed.items()), finished + [r for r in dropped if r not in finished],
                     taken.live, len(taken.results), taken.deltas, stats=hdr.stats, retry=taken.retries)

    def _close(self, msg: CloseFile) -> Closed:
        self.file.structured = self.head.constraints.figures()
        if self.head.reasoning is not None:
            self.file.reasoning = self.head.reasoning.figures()
        stats = FileStats(msg.requests, msg.error_kinds, msg.encode_seconds, msg.padding_waste, msg.ignored_fields)
        complete, summary = self.file.close(msg.total, stats, msg.busy, self.head.generated_tokens,
                                            self.head.answers.format_seconds, self.info.pipeline_size,
                                            self.stage.peak_cells, msg.gpu_peak_mb, msg.precision, msg.memory)
        self.file = None
        if self.status is not None:
            self.status.close_file(complete)
        return Closed(complete, summary)
