"""Generated requests for the property-based tests (tests/unit/tasks/test_request_fuzz.py) and the fuzz benchmark
(bench/fuzz.py): every field of a completion / chat request with values of every JSON type, edge
numbers, huge and tiny values, unicode, token-id prompts, and chat messages of every shape; plus
chat templates written as real model families ship them in tokenizer_config.json (they refuse
what they do not support with ``raise_exception``).
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

# -- chat templates of real model families (tokenizer_config.json "chat_template", abridged to the
# -- parts that render and refuse messages) ---------------------------------------------------
MISTRAL_INSTRUCT = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
CHATML_QWEN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
TEMPLATES = {"mistral-instruct": MISTRAL_INSTRUCT, "llama-2-chat": LLAMA2_CHAT, "gemma": GEMMA,
             "chatml-qwen": CHATML_QWEN, "llama-3": LLAMA3}

# every field a request may carry, and what the error's "param" may name
FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "best_of", "logprobs", "top_logprobs", "echo", "stop", "seed", "presence_penalty", "frequency_penalty",
          "logit_bias", "model", "custom_id", "body", "url", "response_format", "structured_outputs", "min_p",
          "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "return_token_ids", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar")
# fields a request may carry that change nothing here (tasks.fields.NO_EFFECT), as real files carry them
NO_EFFECT = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "engine": "tiny-llama",
             "request_type": "language-modeling", "priority": 0, "request_id": "r-1", "safety_identifier": "s"}

EDGE_INTS = [0, 1, 2, -1, -2, 7, 20, 21, 128, 129, 1023, 1024, 2048, 2**31 - 1, 2**31, 2**53, 2**63 - 1, 2**63,
             2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**20, -(10**20)]
EDGE_FLOATS = [0.0, -0.0, 1e-40, 5e-324, 1e-5, 9.99e-6, 1e-7, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, -0.5, 1e308,
               -1e308, 3.4e38, 1e-310]
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


def ints() -> st.SearchStrategy:
    return st.sampled_from(EDGE_INTS) | st.integers(-5, 1100)


def floats(nonfinite: bool = False) -> st.SearchStrategy:
    extra = st.sampled_from([math.nan, math.inf, -math.inf]) if nonfinite else st.nothing()
    return st.sampled_from(EDGE_FLOATS) | st.floats(-3, 3, allow_nan=False) | extra


def any_json(nonfinite: bool = False) -> st.SearchStrategy:
    """A value of any JSON type (what a client may put in any field)."""
    scalar = st.none() | st.booleans() | ints() | floats(nonfinite) | TEXT
    return st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                        max_leaves=6)


def token_ids() -> st.SearchStrategy:
    return st.lists(st.sampled_from([0, 1, 2, 5, 100, 1023, 1024, 5000, -1, 2**31, 2**63]) | st.integers(0, 1023),
                    min_size=1, max_size=8)


def prompts(nonfinite: bool = False) -> st.SearchStrategy:
    return (TEXT | st.lists(TEXT, min_size=1, max_size=3) | token_ids() | st.lists(token_ids(), max_size=2)
            | any_json(nonfinite))


def bias_keys() -> st.SearchStrategy:
    return (st.integers(0, 1023).map(str) | st.sampled_from(["1024", "5000", "-1", "-0", "99999999999999999999", "+5",
                                                              " 5", "5.0", "1e3", "", "٥", "0x10", "00012"]) | TEXT)


def logit_bias(nonfinite: bool = False) -> st.SearchStrategy:
    values = st.sampled_from([-100, 100, -100.5, 100.0001, 0, 5, 1e-40, 1e308]) | floats(nonfinite) | st.booleans()
    return st.dictionaries(bias_keys(), values | any_json(nonfinite), max_size=4) | any_json(nonfinite)


def messages(nonfinite: bool = False) -> st.SearchStrategy:
    role = st.sampled_from(["system", "user", "assistant", "tool", "", "User", "developer"]) | TEXT
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT})
    content = TEXT | st.lists(part, max_size=2) | st.none() | ints()
    message = st.fixed_dictionaries({"role": role, "content": content}) | any_json(nonfinite)
    return st.lists(message, max_size=5) | any_json(nonfinite)


def schemas(depth: int = 2) -> st.SearchStrategy:
    """A JSON schema of the kinds structured outputs compile: typed scalars with bounds, enums, patterns,
    formats, arrays with bounds, objects with required and optional fields, anyOf, $defs and $ref."""
    scalar = st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.fixed_dictionaries({"type": st.just("number")}, optional={"minimum": st.integers(-5, 0),
                                                                   "maximum": st.integers(1, 9)}),
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.fixed_dictionaries({"type": st.just("string")}, optional={"maxLength": st.integers(1, 6),
                                                                   "minLength": st.integers(0, 1)}),
        st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-c]{1,3}$", "^[0-9]+$", "^x?y$"])),
        st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(["date", "email", "uuid", "date-time"])),
        st.builds(lambda v: {"enum": v}, st.lists(st.sampled_from(["a", "b c", 1, 2.5, True, None, "ü"]), min_size=1,
                                                  max_size=3, unique_by=repr)),
    )
    if depth == 0:
        return scalar
    inner = schemas(depth - 1)
    names = st.sampled_from(["a", "b", "name", "x y", "ü"])
    obj = st.builds(lambda props, req, extra: {"type": "object", "properties": props, "additionalProperties": extra,
                                               "required": [k for k in props if k in req]},
                    st.dictionaries(names, inner, min_size=1, max_size=3), st.sets(names), st.booleans())
    arr = st.builds(lambda items, lo, more: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + more},
                    inner, st.integers(0, 2), st.integers(0, 2))
    ref = st.builds(lambda s: {"$defs": {"d": s}, "type": "object", "properties": {"r": {"$ref": "#/$defs/d"}},
                               "required": ["r"], "additionalProperties": False}, inner)
    return scalar | obj | arr | ref | st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=2, max_size=2))


def constraints() -> st.SearchStrategy:
    """A valid structured-output constraint as a request carries it: (the body's fields, its kind and value)."""
    json_schema = st.builds(lambda s, strict: ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "out", "schema": s, "strict": strict}}}, "json", s), schemas(), st.booleans())
    json_object = st.just(({"response_format": {"type": "json_object"}}, "json", {"type": "object"}))
    regex = st.sampled_from([r"[a-c]{1,4}", r"\d{1,3}(\.\d)?", r"(yes|no) [0-9]", r"[^\n]{0,5}!", "é+x"]).map(
        lambda r: ({"structured_outputs": {"regex": r}}, "regex", r))
    choice = st.lists(TEXT.filter(bool), min_size=1, max_size=4).map(
        lambda c: ({"structured_outputs": {"choice": c}}, "choice", c))
    return json_schema | json_object | regex | choice


def structured_values(nonfinite: bool = False) -> dict[str, st.SearchStrategy]:
    """``response_format`` and ``structured_outputs``: valid constraints, near misses and anything."""
    anything = any_json(nonfinite)
    near = st.fixed_dictionaries({"type": st.sampled_from(["json_object", "json_schema", "text", "jsonx", ""])},
                                 optional={"json_schema": st.fixed_dictionaries(
                                     {"schema": schemas(1) | anything}, optional={"name": TEXT, "strict": anything})
                                     | anything})
    keys = st.sampled_from(["regex", "choice", "grammar", "json", "nope"])
    odd = st.dictionaries(keys, anything | TEXT | schemas(1), min_size=0, max_size=2)
    grammar = st.sampled_from(['start: "yes" | "no"', 'root ::= "a" | "b"', "start: ", "::=", "start: /[/"])
    valid = constraints().map(lambda c: next(iter(c[0].values())))
    return {"response_format": valid | near | anything,
            "structured_outputs": valid | odd | st.fixed_dictionaries({"grammar": grammar | TEXT}) | anything,
            "guided_choice": st.lists(TEXT.filter(bool), min_size=1, max_size=3) | anything,
            "guided_regex": st.sampled_from([r"[a-c]{1,4}", "(yes|no)", ""]) | anything}


def field_values(nonfinite: bool = False) -> dict[str, st.SearchStrategy]:
    """Each sampling field: mostly plausible values, sometimes anything."""
    anything = any_json(nonfinite)
    small = st.sampled_from([0, 1, 2, 3])
    return {
        "max_tokens": small | ints() | anything,
        "max_completion_tokens": small | anything,
        "temperature": floats(nonfinite) | anything,
        "top_p": floats(nonfinite) | anything,
        "top_k": ints() | anything,
        "n": st.sampled_from([1, 2]) | ints() | anything,
        "best_of": st.sampled_from([1, 2, 3]) | ints() | anything,
        "logprobs": st.sampled_from([None, 0, 1, 5, True, False]) | ints() | anything,
        "top_logprobs": ints() | anything,
        "echo": st.booleans() | anything,
        "stop": TEXT | st.lists(TEXT, max_size=5) | anything,
        "seed": ints() | anything,
        "presence_penalty": floats(nonfinite) | anything,
        "frequency_penalty": floats(nonfinite) | anything,
        "logit_bias": logit_bias(nonfinite),
        "min_p": st.sampled_from([0, 0.05, 0.5, 1]) | floats(nonfinite) | anything,
        "repetition_penalty": st.sampled_from([1, 1.2, 0.8, 0, 100, 101]) | floats(nonfinite) | anything,
        "min_tokens": small | ints() | anything,
        "ignore_eos": st.booleans() | anything,
        "stop_token_ids": st.lists(st.integers(0, 1023) | st.sampled_from([1024, -1, 2**31]), max_size=3) | anything,
        "return_token_ids": st.booleans() | anything,
        "model": st.sampled_from([None, "tiny", "nope"]) | anything,
        "stream": st.just(False),
        **structured_values(nonfinite),
    }


def unknown_fields() -> st.SearchStrategy:
    """Field names no request format defines (random text, near misses of real fields), and a value."""
    from tasks.fields import COMPLETION, CHAT, DEFAULT_ONLY, ENDPOINT_DEFAULT, NO_EFFECT as ACCEPTED, TOOLS

    known = COMPLETION | CHAT | ACCEPTED | set(DEFAULT_ONLY) | set(ENDPOINT_DEFAULT) | set(TOOLS)
    names = st.sampled_from(["temprature", "max_token", "topP", "stop_sequences", "repeat_penalty", "num_predict",
                             "do_sample", "max_new_tokens", "typical_p", "mirostat", "guided_xml"]) | TEXT
    return st.tuples(names.filter(lambda k: k not in known and k != "custom_id"), any_json())


def valid_bodies(chat: bool = False) -> st.SearchStrategy:
    """A request carrying every field the runner implements, each with a valid value (the output constraint in
    one of its forms), and the fields that change nothing here: a request the runner must take."""
    def build(d):
        d = dict(d)
        form, (fields, _, _) = d.pop("constraint_form"), d.pop("constraint")
        value = next(iter(fields.values()))
        if form == "guided" and "structured_outputs" in fields:
            key, inner = next(iter(value.items()))
            d[f"guided_{key}"] = inner
        elif form != "none":
            d.update(fields)
        d["best_of"] = max(d["best_of"], d["n"])
        d["min_tokens"] = min(d["min_tokens"], d["max_completion_tokens" if chat else "max_tokens"])
        return d

    common = {
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 1), "n": st.integers(1, 2), "best_of": st.integers(1, 3),
        "stop": st.lists(TEXT, max_size=4), "seed": st.integers(0, 2**63 - 1),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.05, 3), "logit_bias": st.dictionaries(st.integers(0, 1023).map(str),
                                                                               st.floats(-100, 100), max_size=3),
        "min_tokens": st.integers(0, 4), "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, 1023), max_size=3), "return_token_ids": st.booleans(),
        "model": st.none(), "stream": st.just(False), "stream_options": st.none(),
        "constraint": constraints(), "constraint_form": st.sampled_from(["none", "as drawn", "guided"]),
        **{k: st.just(v) for k, v in NO_EFFECT.items()},
    }
    if chat:
        own = {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                           "content": TEXT}), min_size=1, max_size=2),
               "max_completion_tokens": st.integers(0, 8), "logprobs": st.booleans(), "top_logprobs": st.none()}
    else:
        own = {"prompt": TEXT | st.lists(st.integers(0, 1023), min_size=1, max_size=4),
               "max_tokens": st.integers(0, 8), "logprobs": st.none() | st.integers(0, 5), "echo": st.booleans()}
    return st.fixed_dictionaries({**common, **own}).map(build)


def bodies(chat: bool = False, nonfinite: bool = False, cheap: bool = False) -> st.SearchStrategy:
    """A completion (or chat completion) request body. ``cheap``: few tokens to compute (a run)."""
    values = field_values(nonfinite)
    if cheap:  # keep what a valid request asks of the model small
        values = dict(values, max_tokens=st.sampled_from([0, 1, 2, 3, -1, 10**9, "2", None]),
                      max_completion_tokens=st.sampled_from([1, 2, 0, -5, None]),
                      n=st.sampled_from([1, 2, 0, 129, None, True]), best_of=st.sampled_from([1, 2, 3, 0, None]))
    required = {"messages": messages(nonfinite)} if chat else {"prompt": prompts(nonfinite)}
    return st.fixed_dictionaries(required, optional=values) | st.fixed_dictionaries({}, optional=values)


def batch_line(nonfinite: bool = False, cheap: bool = False) -> st.SearchStrategy:
    """A Batch API line of either endpoint (or a broken one)."""
    chat = st.builds(lambda cid, b: {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": b},
                     TEXT, bodies(True, nonfinite, cheap))
    comp = st.builds(lambda cid, b: {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": b},
                     TEXT, bodies(False, nonfinite, cheap))
    odd = st.fixed_dictionaries({"custom_id": any_json(), "body": any_json()}, optional={"url": any_json()})
    return chat | comp | odd


def lines(cheap: bool = True) -> st.SearchStrategy:
    """One line of a request file: a completion body, a Batch API line, or any JSON (bytes)."""
    import json

    value = bodies(cheap=cheap) | batch_line(cheap=cheap) | any_json()
    # the standard library writes what orjson cannot (integers beyond 64 bits, NaN): clients do too
    dump = (lambda v: json.dumps(v, ensure_ascii=False).encode())
    return value.map(dump) | st.sampled_from([b"not json", b"{", b"[1, 2", b'{"prompt": NaN}'])
