"""The wire protocol: every message survives encode/decode, and a wrong field is named where it is read."""

import pytest

from pipeline.runtime.messages import (Admission, Admitting, Allocate, CloseFile, Closed, Fork, MessageError, OpenFile, Opened, PassHeader, Prefill,
                               Reply, Stop, build, decode, encode)
from tasks.output_file import FileSummary
from tasks.requests import Params

ADMIT = Admission(gid=7, req=3, prompt_i=0, n_prompts=1, prompt_ids=[1, 5, 9], kind="completion", custom_id=None,
                  note=None, rows=[2, 3], params=Params(max_tokens=4, logit_bias={50: -100.0}, stop=["\n"]),
                  raw={"prompt": "hi", "max_tokens": 4})
SUMMARY = FileSummary("out.jsonl", 2, 0, 2, {}, 10, 4, 1.5, 2.7, [0.5, 0.6], 0.1, 0.01, 0.02, 2, 1, 0, 300.0)
MESSAGES = [
    PassHeader(slot=1, rows=4, alloc=[4, 32], release=[0], decode_rows=[0, 1], decode_layout=[0, 1, 2, 3],
               decode_start=[5, 6, 0, 0], prefill=[Prefill(7, 2, 3)], forks=[Fork(2, [3], 3)], admit=[ADMIT],
               errors=[[4, {"request": "x", "error": {"message": "bad"}}]]),
    Reply(slot=1, feed=[[0, 11], [1, 12]], finished=[2]),
    OpenFile("in.jsonl", "out.jsonl", 9, "123:abc"), Opened(skip=None, error="journal mismatch"), Opened(skip=3),
    CloseFile(total=9, requests=9, error_kinds={"prompt": 1}, encode_seconds=0.1, padding_waste=0.2, busy=[1.0]),
    Closed(True, SUMMARY), Stop(), Allocate(slot=2, rows=36, cols=593),
    Admitting(lines=[3, 4], alone=[7]), Reply(slot=0, feed=[], finished=[1], failed="RuntimeError: x"),
    PassHeader(slot=0, rows=2, alloc=None, release=[], decode_rows=[1], decode_layout=[1], decode_start=[4],
               failed="RuntimeError: x", retry=True),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_nested_types_come_back_typed():
    hdr = decode(encode(MESSAGES[0]))
    assert isinstance(hdr.admit[0], Admission) and isinstance(hdr.admit[0].params, Params)
    assert hdr.admit[0].params.logit_bias == {50: -100.0}  # int keys again
    assert isinstance(hdr.prefill[0], Prefill) and isinstance(hdr.forks[0], Fork)
    assert hdr.prefill_len == 3 and hdr.dense
    assert isinstance(decode(encode(MESSAGES[6])).summary, FileSummary)


def test_a_wrong_field_is_named():
    with pytest.raises(MessageError, match=r"Reply: unknown field\(s\) \['finishd'\]; missing field\(s\) \['finished'\]"):
        build(Reply, {"slot": 1, "feed": [], "finishd": []})
    with pytest.raises(MessageError, match="unknown message kind 'bogus'"):
        decode(b'["bogus", {}]')
    with pytest.raises(TypeError, match="finishd"):  # where it is built, too
        Reply(slot=1, feed=[], finishd=[])
