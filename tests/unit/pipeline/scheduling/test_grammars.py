"""Rank 0's grammar intake: a constraint that cannot compile or runs out of time is the request's error
(with the reason), and the same spec fails at once the next time; good specs compile once."""

import threading

import pytest

from pipeline.sampling.grammar import Grammars
from pipeline.scheduling.grammars import GrammarIntake
from tasks.protocol import RequestError
from tests.utils import local_tokenizer


def test_errors_and_time_limit(monkeypatch):
    tok = local_tokenizer()
    intake = GrammarIntake(Grammars(tok, len(tok)), timeout=0.05)
    release = threading.Event()
    real = Grammars.compile

    def compile(self, spec):  # a compilation that outlasts the limit whatever this machine's speed
        if spec["value"] == "slow":
            release.wait(10)
        return real(self, spec)

    monkeypatch.setattr(Grammars, "compile", compile)
    good = {"kind": "regex", "value": "[0-9]{3}"}
    intake.check(good)
    intake.check(good)
    assert intake.grammars.compiled == 1 and intake.constrained == 2
    with pytest.raises(RequestError, match="cannot be compiled") as e:
        intake.check({"kind": "grammar", "value": "start: undefined_rule"})
    assert e.value.reason == "grammar"
    slow = {"kind": "regex", "value": "slow"}
    with pytest.raises(RequestError, match="did not compile within 0.05 s") as e:
        intake.check(slow)
    assert e.value.reason == "grammar_timeout"
    release.set()  # it compiles in the end: the spec still fails at once, without a second wait
    with pytest.raises(RequestError, match="did not compile"):
        intake.check(slow)


def test_an_error_names_the_field_its_constraint_came_in():
    """A constraint that cannot compile is a 400 naming the request's own field (OpenAI's ``param``):
    ``response_format`` for a json_schema, a ``guided_*`` field as vLLM's older clients send it."""
    import orjson

    from pipeline.scheduling.driver import Driver
    from pipeline.scheduling.scheduler import Scheduler, SchedulerConfig

    tok = local_tokenizer()
    d = Driver(tok, len(tok), 4096, Scheduler(SchedulerConfig(budget=4000, num_slots=2, max_rows=4)),
               grammars=GrammarIntake(Grammars(tok, len(tok))))
    bad = {"type": "no-such-type"}
    lines = [{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}},
             {"prompt": "x", "guided_regex": "(("}, {"prompt": "x", "structured_outputs": {"json": bad}},
             {"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "x", "guided_json": bad}}]
    d.start(iter(enumerate(orjson.dumps(r) for r in lines)))
    d.fill()
    params = [line["response"]["body"]["error"]["param"] if "response" in line else line["error"]["param"]
              for _, line in sorted(d.take_errors(), key=lambda e: e[0])]
    assert params == ["response_format", "guided_regex", "structured_outputs", "guided_json"]
