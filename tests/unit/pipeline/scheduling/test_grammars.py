"""Rank 0's grammar intake: a constraint that cannot compile or runs out of time is the request's error
(with the reason), and the same spec fails at once the next time; good specs compile once."""

import pytest

from pipeline.sampling.grammar import Grammars
from pipeline.scheduling.grammars import GrammarIntake
from tasks.protocol import RequestError
from tests.utils import local_tokenizer


def test_errors_and_time_limit():
    tok = local_tokenizer()
    intake = GrammarIntake(Grammars(tok, len(tok)), timeout=0.05)
    good = {"kind": "regex", "value": "[0-9]{3}"}
    intake.check(good)
    intake.check(good)
    assert intake.grammars.compiled == 1 and intake.constrained == 2
    with pytest.raises(RequestError, match="cannot be compiled") as e:
        intake.check({"kind": "grammar", "value": "start: undefined_rule"})
    assert e.value.reason == "grammar"
    slow = {"kind": "json", "value": {"enum": [f"w{i}x{i * 7 % 13}" for i in range(30_000)]}}  # ~1 s here
    with pytest.raises(RequestError, match="did not compile within 0.05 s") as e:
        intake.check(slow)
    assert e.value.reason == "grammar_timeout"
    with pytest.raises(RequestError, match="did not compile"):
        intake.check(slow)
