"""Progress on the writing rank: a tqdm bar on a terminal, one log line a minute otherwise."""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("progress")
LOG_EVERY = float(os.environ.get("DIST_INFER_PROGRESS_SECONDS", 60))


class Progress:
    def __init__(self, name: str, total: int, done: int = 0):
        self.total, self.done, self.start_done = total, done, done
        self.t0 = self.last_log = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc=os.path.basename(name), unit="req",
                            dynamic_ncols=True, file=sys.stderr)

    def update(self, done: int, generated_tokens: int) -> None:
        """``done``: the lines answered so far (resumed ones included)."""
        newly_done, self.done = done - self.done, done
        now = time.perf_counter()
        rate = generated_tokens / max(now - self.t0, 1e-9)
        if self.bar is not None:
            if newly_done:
                self.bar.update(newly_done)
            self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        elif now - self.last_log >= LOG_EVERY:
            self.last_log = now
            per_req = (now - self.t0) / max(1, self.done - self.start_done)
            eta = per_req * (self.total - self.done)
            log.info("%d/%d requests (%.1f%%), %.1f generated tok/s, ETA %.0fs", self.done, self.total,
                     100.0 * self.done / max(1, self.total), rate, eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
