"""Checks of the flags that talk to a loaded model (``--prompts``, ``--prompts-file``, ``--chat``,
``--url``) and of their sampling defaults, made before anything loads (exit 2 with a fix-it message).

The sampling flags (``--max-tokens``, ``--temperature``, ...) are the run-wide defaults of the
requests these faces send; request files keep their own per-line fields.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from tasks.requests import MAX_REPETITION_PENALTY, MAX_STOPS


def interactive_problems(opts) -> list[str]:
    """What is wrong with the interactive flags; each message says what to change."""
    problems = []
    faces = [name for name, on in (("--prompts", opts.prompts), ("--prompts-file", opts.prompts_file),
                                   ("--chat", opts.chat)) if on]
    if len(faces) > 1:
        problems.append(f"{' and '.join(faces)} are different ways to talk to the model: pass only one of them")
    if faces and opts.serve is not None:
        problems.append(f"{faces[0]} talks to the model from this terminal; --serve answers HTTP clients: run the "
                        "server alone and use --chat --url http://HOST:PORT (or the web page at /) to talk to it")
    if faces and opts.infer_data:
        problems.append(f"{faces[0]} takes its prompts from the terminal: drop --infer-data (or put the prompts "
                        "in a request file)")
    if faces and opts.data_group_size != 1:
        problems.append(f"{faces[0]} runs one pipeline: drop --data-group-size")
    if opts.prompts_file is not None:
        try:
            if not Path(opts.prompts_file).read_text(encoding="utf-8").strip():
                problems.append(f"--prompts-file {opts.prompts_file}: no prompts in it (one a line; blank lines skipped)")
        except (OSError, UnicodeDecodeError) as e:
            why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror.lower()
            problems.append(f"--prompts-file {opts.prompts_file}: {why}")
    if opts.url is not None:
        if not opts.chat:
            problems.append("--url is the server --chat talks to: add --chat (or drop --url)")
        parts = urlsplit(opts.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"--url {opts.url}: expected http://HOST:PORT (or https://...) of a running --serve server")
    if (opts.user_msg_fmt is not None or opts.assistant_msg_fmt is not None or opts.system_prompt is not None) \
            and not opts.chat:
        problems.append("--system-prompt, --user-msg-fmt and --assistant-msg-fmt shape a --chat conversation: "
                        "add --chat or drop them")
    for flag, fmt in (("--user-msg-fmt", opts.user_msg_fmt), ("--assistant-msg-fmt", opts.assistant_msg_fmt)):
        if fmt is not None and fmt.count("{}") != 1:
            problems.append(f"{flag} {fmt!r}: must hold {{}} exactly once (where the message goes)")
    if opts.assistant_msg_fmt is not None and opts.user_msg_fmt is None:
        problems.append("--assistant-msg-fmt needs --user-msg-fmt (with a chat template, the template formats turns)")
    problems += sampling_problems(opts)
    return problems


def sampling_problems(opts) -> list[str]:
    """The sampling defaults in the ranges requests take (tasks.requests.parse_params)."""
    problems = []
    if not 0.0 <= opts.temperature <= 2.0:
        problems.append(f"--temperature must be in [0, 2], got {opts.temperature}")
    if not 0.0 < opts.top_p <= 1.0:
        problems.append(f"--top-p must be in (0, 1], got {opts.top_p}")
    for flag, v in (("--presence-penalty", opts.presence_penalty), ("--frequency-penalty", opts.frequency_penalty)):
        if not -2.0 <= v <= 2.0:
            problems.append(f"{flag} must be in [-2, 2], got {v}")
    if not 0.0 < opts.repetition_penalty <= MAX_REPETITION_PENALTY:
        problems.append(f"--repetition-penalty must be above 0 and at most {MAX_REPETITION_PENALTY:g}, got "
                        f"{opts.repetition_penalty}")
    if not 0.0 <= opts.min_p <= 1.0:
        problems.append(f"--min-p must be in [0, 1], got {opts.min_p}")
    if opts.stop and len(opts.stop) > MAX_STOPS:
        problems.append(f"--stop is given {len(opts.stop)} times; at most {MAX_STOPS} stop strings are allowed")
    return problems


def unescape(text: str) -> str:
    r"""A flag's or a prompt line's text with ``\n``, ``\t`` and ``\\`` written as escapes."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def sampling_body(opts) -> dict:
    """The request fields the sampling flags give (OpenAI names)."""
    body = {"max_tokens": opts.max_tokens, "temperature": opts.temperature, "top_p": opts.top_p,
            "top_k": opts.top_k, "presence_penalty": opts.presence_penalty,
            "frequency_penalty": opts.frequency_penalty}
    if opts.repetition_penalty != 1.0:
        body["repetition_penalty"] = opts.repetition_penalty
    if opts.min_p:
        body["min_p"] = opts.min_p
    if opts.stop:
        body["stop"] = [unescape(s) for s in opts.stop]
    return body
