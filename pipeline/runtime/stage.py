"""The stage step: receive a pass, run this stage's layers over it, send it on.

A pass carries up to two segments of one micro-batch, a decode segment (one token per ``decode_layout``
row) then a prefill segment (new prompts right-padded to ``prefill_len``), packed into one tensor
(:func:`pack` / :func:`unpack`): token ids on the first stage, hidden states after it. Every rank but
the first runs :func:`serve`.
"""

from __future__ import annotations

import logging
import time

import torch

from comm.faults import ForwardPoint

from pipeline.runtime.messages import Admitting, Allocate, CloseFile, OpenFile, PassHeader, Release, Stop
from pipeline.models.decoder import Segment, StageModel
from pipeline.cache.kv_cache import KVCache
from pipeline.cache.prefix import PrefixStore
from pipeline.models.device import to_device
from pipeline.models.kernels.logits import block_buffer_bytes
from pipeline.runtime.memory import MemoryLedger
from tasks.status import peak_memory_mb

log = logging.getLogger(__name__)


class Stage:
    """This rank's layers, its micro-batch caches, its prefix pool and its compute clock."""

    def __init__(self, model: StageModel, device: torch.device, trace=None, prefix_block: int = 0):
        self.model, self.device, self.trace = model, device, trace
        self.caches: dict[int, KVCache] = {}
        self.pending: dict[int, list[int]] = {}  # slot -> [rows, cols] of a cache no pass has needed yet
        self.prepared: dict[int, tuple[list[int], KVCache]] = {}  # slot -> a cache allocated ahead (Allocate)
        self.prefix = PrefixStore(prefix_block, keep_hidden=model.has_head) if prefix_block else None
        self._busy = 0.0  # compute seconds since the current file opened (see ``busy``)
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: timed on the stream, not resolved yet
        self._start: torch.cuda.Event | None = None
        self.peak_cells = 0  # most KV cells (micro-batch caches + prefix pool) held since the file opened
        self.index = 0  # this stage's position in the pipeline (for logs)
        self.poisoned: set[int] = set()  # slots whose pass failed here or before: skipped until rank 0's retry
        self.bad_blocks: set[int] = set()  # prefix pool blocks a failed pass did not write here
        self.ledger: MemoryLedger | None = None  # its memory account, when loaded by pipeline.runtime.roles
        self._noted_cells = 0  # KV cells at the ledger's last look
        self._changed = True  # the caches changed since note_peak last looked
        self.fault = ForwardPoint()  # the reliability tests' injected forward failure (comm.faults); unset: inert

    @property
    def busy(self) -> float:
        """Compute seconds since the file opened: host time on the CPU; on CUDA the time between events
        recorded on the stream around each span (host timing would see only the kernel launches)."""
        for start, end in self._spans:
            end.synchronize()
            self._busy += start.elapsed_time(end) / 1000
        self._spans.clear()
        return self._busy

    @busy.setter
    def busy(self, seconds: float) -> None:
        """Restart the file's figures: compute seconds, and on CUDA the peak memory."""
        self._busy, self._spans = seconds, []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_mb(self) -> dict:
        """The stage's memory breakdown in MiB for the run summary (pipeline.runtime.memory); {} for a
        stage built without a ledger."""
        if self.ledger is None:
            return {}
        head = block_buffer_bytes() if getattr(self.model, "has_head", False) else 0
        return self.ledger.breakdown(self.model, self.device, head)

    def add_figures(self, msg: CloseFile) -> None:
        """This stage's figures for the file's summary, appended to its CloseFile on the way down:
        compute seconds, peak GPU memory, precision, memory breakdown."""
        msg.busy.append(self.busy)
        if self.device.type == "cuda":  # its peak allocated MiB since the file opened
            msg.gpu_peak_mb.append(round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1))
        msg.precision.append(self.precision())
        msg.memory.append(self.memory_mb())

    def note_peak(self) -> None:
        """After the caches changed (:attr:`_changed`: allocated, created, released, the pool resized;
        not on every pass): the file's most KV cells, and the ledger's most KV bytes (looked at only
        when the cells changed: a cache's bytes follow its cells)."""
        if not self._changed:
            return
        self._changed = False
        cells = self.kv_cells
        self.peak_cells = max(self.peak_cells, cells)
        if self.ledger is not None and cells != self._noted_cells:
            self._noted_cells = cells
            self.ledger.note_kv([*self.caches.values(), *(c for _, c in self.prepared.values())], self.prefix)

    def precision(self) -> dict:
        """The stage's weights and compute dtype, with --quantize the int8 kernel chosen per (in x out)
        shape at load (``StageModel.quantized``), on a CPU stage the linear kernel (``--cpu-linear``);
        for the run summary."""
        kv = {"kv_cache": "int8"} if getattr(self.model, "kv_int8", False) else {}
        quantized = getattr(self.model, "quantized", None)
        if quantized:
            return quantized | kv
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        kernel = getattr(self.model, "cpu_linear", None)  # --cpu-linear on a CPU stage: which one ran
        return {"weights": dtype, "compute_dtype": dtype} | ({"linear": kernel} if kernel else {}) | kv

    def mark(self) -> float:
        """The start of a span for :meth:`clock` (on CUDA an event is recorded on the stream too)."""
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        return time.perf_counter()

    def step(self, hdr: PassHeader, x: torch.Tensor | None, ahead: bool = False) -> torch.Tensor | None:
        """Forward one pass; ``x`` is what :func:`pack` made of the previous stage's output. ``ahead``
        (rank 0, for the trace): the slot's previous pass is still in flight. A forward that raises marks
        the pass ``failed`` (None goes on) and the slot's later passes are skipped until rank 0's retry
        (:mod:`pipeline.runtime.retry`: their rows miss this pass's keys); the bookkeeping (release,
        allocation, prefix pool size) runs in any case, so that every stage keeps the same caches."""
        t0 = self.mark()
        if self.fault.armed:
            self.fault.watch(hdr)
        if hdr.release:
            self.release(hdr.release)
        if hdr.alloc:
            self._changed = True
            self.caches.pop(hdr.slot, None)
            dims, cache = self.prepared.pop(hdr.slot, (None, None))
            if dims == hdr.alloc:
                self.caches[hdr.slot] = cache
            else:
                self.pending[hdr.slot] = hdr.alloc
        cache = self._cache(hdr)
        if hdr.prefix_grow is not None:
            self._changed = True
            dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())  # an int8 cache's hidden
            if hdr.prefix_grow < self.prefix.capacity or not hdr.prefix_grow:
                self.bad_blocks.clear()  # the pool is dropped
            self.prefix.resize(hdr.prefix_grow, cache.k, self.model.spec.hidden_size, dtype)
        if hdr.retry:
            self.poisoned.discard(hdr.slot)  # every pass of the slot sent before the retry went by
        elif hdr.failed is None and hdr.slot in self.poisoned:
            hdr.failed = "an earlier pass of this micro-batch failed"
        out = None
        if hdr.failed is None:
            try:
                if self.fault.armed:
                    self.fault.check(hdr)
                out = self._forward(hdr, x, cache)
            except Exception as e:  # the pass fails, not the process: rank 0 finds the row it was
                hdr.failed = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("stage %s: the forward of a pass of micro-batch %d raised (%s); its groups are "
                            "computed again one at a time", self.index, hdr.slot, hdr.failed)
        if hdr.failed is not None and not hdr.retry:
            self.poisoned.add(hdr.slot)
            self.bad_blocks.update(bid for p in hdr.prefill for _, bid in p.save)  # not written here
        self.note_peak()  # after the forward: the generic stage's caches allocate their layers in it
        self.clock("forward", t0, slot=hdr.slot, decode=len(hdr.decode_layout), prefill=len(hdr.prefill),
                   **({"ahead": True} if ahead else {}))
        if hdr.stats is not None:  # this stage's figures for the status file and /metrics (every few seconds)
            hdr.stats.append([round(self.busy, 4), self.kv_cells, peak_memory_mb(self.device)])
        return out

    def _forward(self, hdr: PassHeader, x: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor | None:
        x_dec, x_pre = unpack(hdr, x)
        outs = []
        with torch.inference_mode():
            if x_dec is not None:  # a dense decode segment writes column 0 of idle rows: load after it
                outs.append(self.model(to_device(x_dec, self.device), decode_segment(hdr, self.device), cache))
            for p in hdr.prefill:
                if p.load:
                    if self.bad_blocks.intersection(p.load):
                        raise RuntimeError("its prompt's cached blocks were not written here (a failed pass)")
                    self.prefix.load(cache, p.row, p.load, p.cached)
            if x_pre is not None:
                outs.append(self.model(to_device(x_pre, self.device), prefill_segment(hdr, self.device), cache))
                if self.prefix is not None:
                    self.prefix.save_pass(hdr.slot, hdr.prefill, cache, outs[-1] if self.model.has_head else None)
                    self.bad_blocks.difference_update(bid for p in hdr.prefill for _, bid in p.save)
            for f in hdr.forks:
                cache.fork(f.lead, f.rows, f.cols)
        return pack(outs)

    def prepare(self, msg: Allocate) -> None:
        """Allocate a slot's cache ahead of the pass that needs it, after freeing what that pass
        releases (the slot's own old cache included: rank 0 re-allocates only a finished slot)."""
        t0 = self.mark()
        self.release([*msg.release, msg.slot])
        self.prepared[msg.slot] = ([msg.rows, msg.cols], self.model.new_cache(msg.rows, msg.cols))
        self._changed = True
        self.note_peak()
        self.clock("allocate", t0, slot=msg.slot, rows=msg.rows, cols=msg.cols)

    def _cache(self, hdr: PassHeader) -> KVCache | None:
        """The slot's cache, allocated by the first pass that needs one: a pass of prompts that all
        end there (echo scoring, ``max_tokens`` 0) attends to its own keys only and keeps none, so a
        scoring micro-batch never allocates (on the CPU, zeroing it cost 5% of a scoring file)."""
        cache = self.caches.get(hdr.slot)
        needed = hdr.keeps_cache
        if cache is None and needed:
            cache = self.caches[hdr.slot] = self.model.new_cache(*self.pending.pop(hdr.slot))
            self._changed = True
        return cache if needed else None

    @property
    def kv_cells(self) -> int:
        """Token positions of keys/values held: every micro-batch's rows x columns plus the prefix pool."""
        pool = self.prefix.capacity * self.prefix.block_size if self.prefix is not None else 0
        ahead = sum(rows * cols for (rows, cols), _ in self.prepared.values())
        return sum(c.rows * c.cols for c in self.caches.values()) + ahead + pool

    def release(self, slots: list[int]) -> None:
        self._changed = True
        for sid in slots:
            self.caches.pop(sid, None)
            self.pending.pop(sid, None)
            self.poisoned.discard(sid)  # rank 0 releases a slot only once all its passes are answered
            # (not ``prepared``: a slot released and allocated again in one pass gets its new cache ahead)
        if self.prefix is not None and slots:
            self.prefix.forget(slots)

    def clock(self, what: str, t0: float, **args) -> None:
        """Count the time since ``t0`` (from :meth:`mark`) as compute (and trace it, in host time)."""
        t1 = time.perf_counter()
        if self._start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._start, end))
            self._start = None
        else:
            self._busy += t1 - t0
        if self.trace is not None:
            self.trace.add(what, t0, t1, args=args)


def serve(link, stage: Stage, last=None) -> str | None:
    """Every rank but the first: receive until :class:`Stop`; the last rank answers through ``last``.
    Returns the output path of the last file opened (the profile trace goes beside it)."""
    output = None
    while True:
        msg, x = link.recv_prev()
        if isinstance(msg, Admitting):  # on at once: the last rank records the lines before they are computed
            if last is None:
                link.send_next_now(msg)
            else:
                last.record(msg)
            continue
        if isinstance(msg, (Allocate, Release)):  # on at once: the next ranks allocate (zero) or free meanwhile
            if last is None:
                link.send_next(msg)
            if isinstance(msg, Allocate):
                stage.prepare(msg)
            else:  # rank 0 is idle: no pass carries these slots' release
                stage.release(msg.slots)
            continue
        if isinstance(msg, PassHeader):
            x = stage.step(msg, x)
        elif isinstance(msg, OpenFile):
            stage.busy, stage.peak_cells, output = 0.0, stage.kv_cells, msg.output  # per-file figures
        elif isinstance(msg, CloseFile):
            stage.release(msg.release)
            stage.add_figures(msg)
        if last is None:
            link.send_next(msg, x)
        else:
            reply = last.handle(msg, x)
            if reply is not None:
                link.send_first(reply)
                last.idle()  # (while the other stages compute)
        if isinstance(msg, Stop):
            return output


def decode_segment(hdr: PassHeader, device: torch.device) -> Segment:
    """The decode rows; their index tensors built once on the host and copied without a sync."""
    rows, starts = hdr.decode_layout, hdr.decode_start
    index = to_device([rows, starts], device, torch.long)
    return Segment(index[0], index[1], 1, max(starts) + 1,
                   all_rows=hdr.dense, host_rows=rows, host_start=starts, lens=[1] * len(rows),
                   adapters=[hdr.adapters[r] for r in rows] if hdr.adapters else None)


def prefill_segment(hdr: PassHeader, device: torch.device) -> Segment:
    """The new prompts; a prompt with cached tokens computes from there on, attending to them."""
    rows, t = [p.row for p in hdr.prefill], hdr.prefill_len
    starts, lens = [p.cached for p in hdr.prefill], [p.len - p.cached for p in hdr.prefill]
    fresh = not any(starts)
    index = to_device([rows, starts], device, torch.long)
    return Segment(index[0], index[1], t,
                   t if fresh else max(starts) + t, fresh=fresh, prefill=True, host_rows=rows, host_start=starts,
                   lens=lens, adapters=[hdr.adapters[r] for r in rows] if hdr.adapters else None,
                   replay=[p.replay for p in hdr.prefill] if any(p.replay for p in hdr.prefill) else None)


def pack(outs: list[torch.Tensor]) -> torch.Tensor | None:
    """[(r, 1, ...), (b, t, ...)] -> one (r + b*t, ...) tensor: hidden states, or token ids on the first stage."""
    if not outs:
        return None
    return torch.cat([o.reshape(-1, *o.shape[2:]) for o in outs])


def unpack(hdr: PassHeader, x: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Inverse of :func:`pack`: (decode (r, 1, ...), prefill (b, t, ...)), shapes from the header."""
    if x is None:
        return None, None
    r, b = len(hdr.decode_layout), len(hdr.prefill)
    t = hdr.prefill_len if b else 0
    x_dec = x[:r].reshape(r, 1, *x.shape[1:]) if r else None
    x_pre = x[r:].reshape(b, t, *x.shape[1:]) if b else None
    return x_dec, x_pre
