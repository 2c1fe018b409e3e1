"""``--chat``: an interactive shell that keeps a conversation with the model (docs/usage/chat.md). Each
turn sends the whole conversation, as a chat request or, with ``--user-msg-fmt`` / ``--assistant-msg-fmt``
(base models), a completion request of the formatted turns; a conversation longer than the context
window loses its oldest turns, with a notice.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from pipeline.config.interactive_options import sampling_body, unescape

from terminal.chat_backends import BackendError
from terminal.line_editor import Terminal

HELP = """commands:
  /help, /?           this list
  /reset              forget the conversation (the system prompt stays)
  /system TEXT        set the system prompt (/system alone clears it)
  /set NAME VALUE     set a sampling parameter: max_tokens, temperature, top_p, top_k, seed,
                      presence_penalty, frequency_penalty, repetition_penalty, min_p,
                      stop (\\n is a newline; 'none' clears)
  /show               the sampling parameters
  /context            the exact prompt of the last request
  /undo               forget the last exchange
  /save FILE          write the conversation as chat JSON ({"messages": [...]})
  /adapter NAME       answer with a LoRA adapter (/adapter alone: the base model)
  /quit, /exit        leave (Ctrl-D too)
A line ending in \\ continues on the next line. Ctrl-C stops the answer being written."""

NUMBERS = {"max_tokens": int, "top_k": int, "seed": int, "temperature": float, "top_p": float,
           "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float, "min_p": float}


@dataclass
class Conversation:
    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)  # (user, assistant), oldest first

    def messages(self, user: str | None = None) -> list[dict]:
        out = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.turns:
            out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        if user is not None:
            out.append({"role": "user", "content": user})
        return out

    def formatted(self, user: str, user_fmt: str, assistant_fmt: str) -> str:
        """A base model's prompt: the system prompt, every turn formatted, the new turn, the answer's start."""
        text = self.system or ""
        if text and not text.endswith("\n"):
            text += "\n"
        for u, a in self.turns:
            text += user_fmt.replace("{}", u) + assistant_fmt.replace("{}", a)
        return text + user_fmt.replace("{}", user) + assistant_fmt.split("{}", 1)[0]


class ChatShell:
    def __init__(self, backend, opts, term: Terminal | None = None, out=sys.stdout):
        self.backend, self.out = backend, out
        self.term = term or Terminal()
        self.params = sampling_body(opts)
        self.model: str | None = None  # an adapter's name; None: the base model
        self.conv = Conversation(unescape(opts.system_prompt) if opts.system_prompt else None)
        self.user_fmt = unescape(opts.user_msg_fmt) if opts.user_msg_fmt else None
        self.assistant_fmt = unescape(opts.assistant_msg_fmt) if opts.assistant_msg_fmt else "{}\n"
        if self.user_fmt is None and not backend.has_template:
            self.user_fmt, self.assistant_fmt = "User: {}\n", "Assistant: {}\n"
            self.say("(this model's tokenizer has no chat template: turns are written as 'User: ...' and "
                     "'Assistant: ...'; --user-msg-fmt and --assistant-msg-fmt choose other formats)")
        self.last_context: str | None = None

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def run(self) -> int:
        """Until /quit or end of input."""
        self.say(f"chatting with {self.backend.model} ({self.backend.where}); /help lists the commands, "
                 "/quit or Ctrl-D leaves")
        with self.term:
            while True:
                try:
                    line = self.term.read(">>> ")
                except EOFError:
                    self.say("")
                    return 0
                except KeyboardInterrupt:  # no terminal: Ctrl-C at the prompt
                    self.say("")
                    continue
                line = line.strip()
                if not line:
                    continue
                if line.startswith("/"):
                    if self.command(line) == "quit":
                        return 0
                    continue
                self.turn(line)

    # -- a turn -------------------------------------------------------------------------------
    def request(self, user: str) -> tuple[dict, bool]:
        """The body of the next request and whether it is a chat request."""
        body = dict(self.params)
        if self.model:
            body["model"] = self.model
        if self.user_fmt is not None:
            body["prompt"] = self.conv.formatted(user, self.user_fmt, self.assistant_fmt)
            return body, False
        body["messages"] = self.conv.messages(user)
        return body, True

    def fit(self, user: str) -> tuple[dict, bool]:
        """The request, after dropping the oldest turns while the prompt and max_tokens exceed the window."""
        body, chat = self.request(user)
        context = self.backend.context
        while context is not None and self.conv.turns:
            n = self.backend.tokens(body, chat)
            if n is None or n + body["max_tokens"] <= context:
                break
            self.drop_oldest()
            body, chat = self.request(user)
        return body, chat

    def drop_oldest(self) -> None:
        self.conv.turns.pop(0)
        self.say(f"(the conversation is longer than the context window: its oldest exchange was dropped; "
                 f"{len(self.conv.turns)} kept)")

    def turn(self, user: str) -> None:
        kept = list(self.conv.turns)
        body, chat = self.fit(user)
        while True:
            self.last_context = self._context(body, chat)
            try:
                answer, stopped = self.stream(body, chat)
                break
            except BackendError as e:
                if e.context and self.conv.turns:  # the server said so (it counts the tokens)
                    self.drop_oldest()
                    body, chat = self.request(user)
                    continue
                dropped, self.conv.turns = len(kept) - len(self.conv.turns), kept  # they did not make it fit
                self.say(f"error: {e}" + (f" (the {dropped} exchange(s) dropped for it are kept)" if dropped else ""))
                return
        self.conv.turns.append((user, answer))
        if stopped:
            self.say("(stopped: the answer so far is kept; /undo forgets it)")

    def stream(self, body: dict, chat: bool) -> tuple[str, bool]:
        """Print the answer as it comes; (its text, whether Ctrl-C stopped it)."""
        parts, stopped = [], False
        gen = self.backend.generate(body, chat)
        try:
            with self.term.streaming() as keys:
                for piece in gen:
                    if piece:
                        parts.append(piece)
                        self.out.write(piece)
                        self.out.flush()
                    if keys.interrupted():
                        stopped = True
                        break
        except KeyboardInterrupt:  # no terminal: Ctrl-C is a signal
            stopped = True
        finally:
            gen.close()  # a stopped answer's rows are freed
            self.out.write("\n")  # an error that cut the answer is said on a line of its own
            self.out.flush()
        return "".join(parts), stopped

    def _context(self, body: dict, chat: bool) -> str:
        if not chat:
            return body["prompt"]
        rendered = self.backend.render(body["messages"])
        if rendered is not None:
            return rendered
        return ("(the server renders these messages with its chat template)\n"
                + json.dumps(body["messages"], indent=2, ensure_ascii=False))

    # -- commands -----------------------------------------------------------------------------
    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit", "/bye"):
            return "quit"
        handler = {"/help": self.help, "/?": self.help, "/reset": self.reset, "/system": self.system,
                   "/set": self.set, "/show": self.show, "/context": self.context, "/undo": self.undo,
                   "/save": self.save, "/adapter": self.adapter}.get(name)
        if handler is None:
            self.say(f"unknown command {name}; /help lists the commands")
            return None
        handler(arg)
        return None

    def help(self, arg: str) -> None:
        self.say(HELP)

    def reset(self, arg: str) -> None:
        self.conv.turns.clear()
        self.say("(the conversation is reset)")

    def system(self, arg: str) -> None:
        self.conv.system = unescape(arg) or None
        self.say(f"(system prompt: {self.conv.system!r})" if self.conv.system else "(no system prompt)")

    def set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        value = value.strip()
        if name == "stop":
            if value.lower() in ("", "none"):
                self.params.pop("stop", None)
            else:
                self.params["stop"] = [unescape(value)]
            self.say(f"(stop: {self.params.get('stop')!r})")
            return
        kind = NUMBERS.get(name)
        if kind is None or not value:
            self.say(f"usage: /set NAME VALUE, NAME one of {', '.join([*NUMBERS, 'stop'])}")
            return
        try:
            self.params[name] = kind(value)
        except ValueError:
            self.say(f"/set {name}: {value!r} is not {'an integer' if kind is int else 'a number'}")
            return
        self.say(f"({name} = {self.params[name]})")

    def show(self, arg: str) -> None:
        for key, value in self.params.items():
            self.say(f"{key}: {value!r}")
        self.say(f"model: {self.model or self.backend.model}")
        self.say(f"system prompt: {self.conv.system!r}")
        self.say(f"exchanges kept: {len(self.conv.turns)}")

    def context(self, arg: str) -> None:
        if self.last_context is None:
            self.say("(nothing sent yet)")
            return
        self.say(f"---- the last prompt sent ----\n{self.last_context}\n---- end ----")

    def undo(self, arg: str) -> None:
        if not self.conv.turns:
            self.say("(nothing to undo)")
            return
        self.conv.turns.pop()
        self.say("(the last exchange is forgotten)")

    def save(self, arg: str) -> None:
        if not arg:
            self.say("usage: /save FILE")
            return
        data = {"model": self.model or self.backend.model, "messages": self.conv.messages(), **self.params}
        try:
            with open(arg, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, ensure_ascii=False)
        except OSError as e:
            self.say(f"/save {arg}: {e.strerror}")
            return
        self.say(f"(saved {len(self.conv.turns)} exchanges to {arg})")

    def adapter(self, arg: str) -> None:
        if not arg or arg == self.backend.model:
            self.model = None
            self.say(f"(answering with the base model {self.backend.model})")
            return
        if arg not in self.backend.adapters:
            have = ", ".join(self.backend.adapters) or "none loaded (start with --lora NAME=PATH)"
            self.say(f"/adapter {arg}: no such adapter; adapters: {have}")
            return
        self.model = arg
        self.say(f"(answering with the adapter {arg})")
