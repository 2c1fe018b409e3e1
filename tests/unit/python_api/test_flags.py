"""Keyword arguments -> the runner's flags, with the runner's checks."""

import pytest

from python_api.flags import parse, to_argv
from pipeline.config.options import UsageError


def test_kwargs_become_flags():
    argv = to_argv("/m", {"budget": 4096, "prefix_cache": "off", "batch_invariant": True, "truncate_prompts": False,
                          "lora": {"a": "/x"}, "seed": None})
    assert argv == ["--model-name", "/m", "--budget", "4096", "--prefix-cache", "off", "--batch-invariant",
                    "--lora", "a=/x"]
    opts = parse(to_argv(None, {"budget": 4096, "prefix_cache": "off"}))
    # one adapter as the command line writes it (a string was split into one --lora per character)
    assert to_argv(None, {"lora": "a=/x"}) == to_argv(None, {"lora": ["a=/x"]}) == ["--lora", "a=/x"]
    assert opts.budget == 4096 and opts.prefix_cache == "off"


def test_unknown_and_refused_kwargs():
    with pytest.raises(TypeError, match="unexpected keyword argument 'budgte'"):
        to_argv(None, {"budgte": 1})
    with pytest.raises(TypeError, match="generate_file"):
        to_argv(None, {"infer_data": ["a.jsonl"]})
    for value in (False, True):  # a flag with a value given as a switch: False was dropped (the cache stayed on)
        with pytest.raises(TypeError, match=r"prefix_cache=.*--prefix-cache takes a value.*prefix_cache='on'"):
            to_argv(None, {"prefix_cache": value})


def test_bad_value_is_the_runners_message():
    with pytest.raises(UsageError, match="prefix-cache"):
        parse(to_argv(None, {"prefix_cache": "maybe"}))
    with pytest.raises(UsageError, match="--budget must be a positive number"):
        parse(to_argv(None, {"budget": 0}))
