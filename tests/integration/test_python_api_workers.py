"""The Python API's worker processes: one LLM with workers at a time per process, with one-stage LLMs
beside it; a killed worker raises in the caller and leaves no process. (Apart from test_python_api.py,
whose module-wide LLMs stay open while its tests run.)"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from dist_inference_runner import LLM, EngineDead, SamplingParams

FLAGS = {"budget": 8192, "no_progress": True}


def _children() -> list[int]:
    out = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        f = task / "children"
        if f.exists():
            out += [int(c) for c in f.read_text().split()]
    return out


def test_one_pipeline_at_a_time_and_a_killed_worker_raises_and_leaves_nothing():
    before = set(_children())
    llm = LLM(pipeline_size=2, **FLAGS)
    try:
        with pytest.raises(ValueError, match="another LLM with pipeline_size > 1 is open"):
            LLM(pipeline_size=2, **FLAGS)
        with LLM(**FLAGS) as one:  # a one-stage LLM needs no process group: it works beside it
            assert one.generate("Hello", {"max_tokens": 2, "temperature": 0})[0].text == \
                llm.generate("Hello", {"max_tokens": 2, "temperature": 0})[0].text
        assert llm.generate("Hello", {"max_tokens": 2})[0].ok  # closing the one-stage LLM left the group alone
        worker = llm.workers.procs[0]
        assert worker.pid in _children()
        threading.Timer(2.0, os.kill, (worker.pid, signal.SIGKILL)).start()
        with pytest.raises(EngineDead, match="rank 1 died"):
            llm.generate(["Once upon a time"] * 64, SamplingParams(max_tokens=400, temperature=1.0))
        with pytest.raises(EngineDead):  # it stays dead until closed
            llm.generate("Hello")
    finally:
        llm.close()
    assert set(_children()) <= before
    with LLM(**FLAGS) as again:  # and the process can load another
        assert again.generate("Hello", {"max_tokens": 2})[0].ok
