"""Typed messages between this rank and its pipeline neighbours: activations down the pipeline
(``send_next`` / ``recv_prev``), the last rank's answers straight back to rank 0 (``send_first`` /
``recv_last``); headers encoded here (:mod:`pipeline.runtime.messages`), bytes moved by ``comm.p2p``.
"""

from __future__ import annotations

import torch

from comm.dist import DistInfo
from comm.p2p import Messenger

from pipeline.runtime.messages import Message, Stop, decode, encode


class Link:
    def __init__(self, info: DistInfo, messenger: Messenger):
        self.messenger = messenger
        self.next = None if info.is_last else info.pipeline_rank(info.stage + 1)
        self.prev = None if info.is_first else info.pipeline_rank(info.stage - 1)
        self.first, self.last = info.pipeline_rank(0), info.pipeline_rank(info.pipeline_size - 1)

    def send_next(self, msg: Message, x: torch.Tensor | None = None) -> None:
        self.messenger.send(self.next, encode(msg), x)

    def send_next_now(self, msg: Message) -> None:
        """:meth:`send_next`, returning once the message has left this process (it must arrive even if
        this process dies computing what follows)."""
        self.messenger.send_now(self.next, encode(msg))

    def recv_prev(self) -> tuple[Message, torch.Tensor | None]:
        data, x = self.messenger.recv(self.prev)
        msg = decode(data)
        if not isinstance(msg, Stop):  # the next message's receive posted before this one is computed
            self.messenger.expect(self.prev)
        return msg, x

    def send_first(self, msg: Message) -> None:
        self.messenger.send(self.first, encode(msg))

    def recv_last(self) -> Message:
        msg = decode(self.messenger.recv(self.last)[0])
        if not isinstance(msg, Stop):
            self.messenger.expect(self.last)
        return msg

    def flush(self) -> None:
        self.messenger.flush()
