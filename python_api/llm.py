"""``LLM``: the runner's pipeline behind Python calls.

    from dist_inference_runner import LLM, SamplingParams
    with LLM(pipeline_size=2) as llm:
        print(llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))[0].text)

Rank 0 runs in this process (a thread, :mod:`pipeline.runtime.engine_thread`); the other stages are worker
processes it starts (:mod:`python_api.workers`), or, under torchrun, the other ranks of the job.
Calls run one at a time; within a call, requests run together as a file's lines would.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from comm.dist import free_port, shutdown
from python_api.flags import from_vllm, parse, to_argv
from python_api.params import SamplingParams, fields_of, params_for
from python_api.outputs import RequestFailed, Result, Score, from_answer, score_of
from python_api.workers import Workers
from pipeline.config.options import UsageError
from pipeline.config.plan import make_plan, output_for
from pipeline.loading.tokenizer import load_tokenizer
from pipeline.runtime.engine_thread import EngineThread
from pipeline.runtime.in_process import LocalRanks, in_process_options, plan_env
from pipeline.runtime.roles import make_engine, serve_rank, start_rank
from pipeline.runtime.sources import FutureChannel, Live
from tasks.progress import Progress
from tasks.protocol import Answer, RequestError
from tasks.requests import as_json, parse_body, parse_request

log = logging.getLogger("api")

POLL_S = 0.2  # how often a waiting call looks at the engine and the workers
IN_FLIGHT = 1024  # requests handed to the pipeline at once; more are handed as these finish
START_TIMEOUT = 600.0  # seconds loading may take before LLM() gives up
STOP_GRACE = 30.0  # seconds close() waits for the pipeline to stop cleanly
WORKER_EXIT_S = 3.0  # seconds a failed pipeline waits for its dead worker to be seen exiting


class EngineDead(RuntimeError):
    """The pipeline stopped (a worker died, a stage failed, or the LLM was closed): the LLM cannot go on."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


class LLM:
    """A loaded pipeline. ``model``: a model folder or hub id (None: the embedded default model);
    ``pipeline_size`` (vLLM's ``pipeline_parallel_size``): stages (worker processes started here, or
    torchrun's ranks); ``raise_errors``: a request that cannot run raises :class:`RequestFailed` instead of
    giving an error :class:`Result`; other keyword arguments are the runner's flags (``budget=4096``,
    ``prefix_cache="off"``, ``lora={"name": path}``, ...) or vLLM's engine arguments (``dtype="half"``,
    ``gpu_memory_utilization``: docs/usage/from-vllm.md)."""

    def __init__(self, model: str | None = None, pipeline_size: int | None = None, *, raise_errors: bool = False,
                 setup_logging: bool = True, pipeline_parallel_size: int | None = None, **flags):
        if pipeline_size is not None and pipeline_parallel_size is not None and pipeline_size != pipeline_parallel_size:
            raise TypeError("LLM(): pipeline_size and pipeline_parallel_size (its vLLM name) disagree: give one")
        pipeline_size = next((p for p in (pipeline_size, pipeline_parallel_size) if p is not None), 1)
        if pipeline_size < 1:
            raise UsageError(f"pipeline_size must be at least 1, got {pipeline_size}")
        flags, aside = from_vllm(model, flags)
        self.raise_errors = raise_errors
        self._tokenizer = None
        self.engine: EngineThread | None = None
        self.workers: Workers | None = None
        self._lock = threading.Lock()
        self._closed = False
        if setup_logging and not logging.getLogger().handlers:
            logging.basicConfig(level=os.environ.get("DIST_INFER_LOG", "WARNING").upper(), stream=sys.stderr,
                                format="[%(name)s] %(levelname)s: %(message)s")
        if aside:
            log.info("vLLM engine arguments that only tune vLLM's own engine, not used here: %s", ", ".join(aside))
        argv = to_argv(model, flags)
        opts = parse(argv)
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if pipeline_size not in (1, world):
                raise UsageError(f"pipeline_size={pipeline_size} under torchrun of {world} processes: pass "
                                 f"pipeline_size={world} or leave it out")
            if int(os.environ.get("RANK", "0")) != 0:
                _serve_and_exit(opts)  # never returns: this rank serves rank 0 until it closes
        elif opts.in_process:  # every stage a thread of this process (comm.local): no workers, no process group
            opts.pipeline_group_size = pipeline_size
        elif pipeline_size > 1:
            if dist.is_initialized():
                raise UsageError("another LLM with pipeline_size > 1 is open in this process (a process holds one "
                                 "process group): close it first, or use pipeline_size=1 beside it")
            opts.rank, opts.world_size, opts.pipeline_group_size = 0, pipeline_size, pipeline_size
            opts.dist_url = f"tcp://127.0.0.1:{free_port()}"
        self._local: LocalRanks | None = None
        if opts.in_process:
            launch, opts = opts, in_process_options(opts)
            plan = make_plan(opts, plan_env())
            self._local = LocalRanks(launch, plan, make_plan)  # the other stages' plans: checked before loading
        else:
            plan = make_plan(opts)  # every flag checked before a worker starts or a weight loads
        for warning in plan.warnings:
            log.warning("%s", warning)
        self.plan, self.opts = plan, opts
        self.model_name = plan.model_name
        self.engine = EngineThread(self._build, cleanup=self._shutdown)
        self._rank = None
        try:
            if opts.dist_url is not None:
                self.workers = Workers(argv, pipeline_size, opts.dist_url)
            self.engine.start()
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        _OPEN.add(self)

    def _build(self, requests, files, stopping):
        """On the engine's thread: this process's rank started (the process group with the workers, its
        stage loaded; ``in_process``: the other stages started on threads), and rank 0's engine over it
        (requests arrive over time: serve mode's policy)."""
        info = None
        if self._local is not None:
            self._local.start(_other_stage)
            info = self._local.infos[0]
        self._rank = start_rank(self.plan, self.opts, info)
        return make_engine(self._rank, files, requests, stopping, arriving=True)

    def _shutdown(self, clean: bool) -> None:
        if self._local is not None:
            if not clean and self._local.infos[0].local is not None:  # the other stages stop at their next receive
                self._local.infos[0].local.fail(0, self.engine.failure or "rank 0 stopped")
            self._local.join()
        elif self._rank is not None and self._rank.info.backend is not None:  # one stage has no group
            shutdown(self._rank.info, clean)

    def _wait_ready(self) -> None:
        waited = 0.0
        while not self.engine.ready.wait(POLL_S):
            self._check()
            waited += POLL_S
            if waited > START_TIMEOUT:
                raise EngineDead(f"the pipeline did not load within {START_TIMEOUT:.0f} s")

    def _check(self) -> None:
        """Raise EngineDead when the pipeline stopped or a worker died."""
        if self._closed:
            raise EngineDead("this LLM is closed")
        problem = self.workers.problem() if self.workers is not None else None
        if self._local is not None:  # a stage thread that failed: its own error
            failed = next((e for e in self._local.errors[1:] if e is not None), None)
            problem = f"pipeline stage failed: {type(failed).__name__}: {failed}" if failed is not None else None
        if problem is None and self.workers is not None and (self.engine.failure or self.engine.finished.is_set()):
            # rank 0 saw the peer go first: the dead worker's own message says more (give it a moment to exit)
            self.workers.wait(WORKER_EXIT_S)
            problem = self.workers.problem()
        if problem and problem not in (self.engine.failure or ""):
            self.engine.failure = problem + (f"\n(rank 0: {self.engine.failure})" if self.engine.failure else "")
        if self.engine.failure or self.engine.finished.is_set():
            raise EngineDead(self.engine.failure or "the pipeline stopped")

    # -- requests ---------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | dict | list | None = None,
                 use_tqdm: bool | None = None, *, raise_errors: bool | None = None, params=None) -> list[Result]:
        """One :class:`Result` per prompt, in order. ``prompts``: a string, a list of token ids, vLLM's
        ``{"prompt_token_ids": [...]}``, a request dict (any field of the request format, a chat request with
        ``messages``, a Batch API line), or a list of those; ``sampling_params``: one SamplingParams (or dict
        of fields) for all, or a list of one per prompt (``params``: its older name); ``use_tqdm``: a
        progress bar (None: for more than one prompt, unless the LLM has no_progress)."""
        results = self._run(_as_list(prompts), _sampling(sampling_params, params), False, raise_errors, use_tqdm)
        return sorted(results, key=lambda r: r.index)

    def chat(self, messages, sampling_params: SamplingParams | dict | list | None = None,
             use_tqdm: bool | None = None, *, raise_errors: bool | None = None, params=None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list | None = None) -> list[Result]:
        """Chat completions through the model's chat template: one conversation (a list of
        ``{"role", "content"}``) or a list of them; one Result per conversation (text: the reply).
        vLLM's template arguments are taken at the values the runner applies (a custom ``chat_template``,
        ``continue_final_message`` and ``tools`` are refused per request, naming the field)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = {"chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs or None,
                    "tools": tools or None, "add_generation_prompt": None if add_generation_prompt else False,
                    "continue_final_message": continue_final_message or None}
        template = {k: v for k, v in template.items() if v is not None}
        per_row = _sampling(sampling_params, params)
        if template:  # added to each prompt's parameters
            per_row = [replace(p, extra={**p.extra, **template}) if isinstance(p, SamplingParams)
                       else {**template, **(p or {})} for p in params_for(per_row, len(convs))]
        return sorted(self._run(convs, per_row, True, raise_errors, use_tqdm), key=lambda r: r.index)

    def stream(self, prompts, sampling_params: SamplingParams | dict | list | None = None, *, chat: bool = False,
               raise_errors: bool | None = None, params=None) -> Iterator[Result]:
        """Results as they finish (``as_completed``-style; ``result.index`` is the prompt's position).
        Leaving the loop early frees the rows of the requests not yet finished."""
        items = _as_list(prompts) if not chat else ([prompts] if prompts and isinstance(prompts[0], dict)
                                                    else list(prompts))
        return self._run(items, _sampling(sampling_params, params), chat, raise_errors)

    def get_tokenizer(self):
        """The model's tokenizer (a transformers tokenizer; vLLM's ``LLM.get_tokenizer``): this LLM's own
        copy, loaded on first use."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.plan.model_dir, self.opts.trust_remote_code)
        return self._tokenizer

    def score(self, texts, *more, logprobs: int = 1, **fields) -> list[Score]:
        """Log-likelihoods by echo (no generation): for a text, the sum over its tokens but the first;
        for a ``(context, continuation)`` pair, over the continuation's tokens, with ``is_greedy``
        (lm-eval's ``loglikelihood``: ``logprob, is_greedy = score``)."""
        if more:  # vLLM's score(text_1, text_2) is a cross-encoder's relevance score, another thing
            raise TypeError("score() takes one argument, the texts or (context, continuation) pairs: "
                            "llm.score([(context, continuation)]) gives the continuation's log-likelihood "
                            "(vLLM's score(text_1, text_2), a cross-encoder's relevance, is not supported)")
        items = list(texts) if isinstance(texts, (list, tuple)) and not _is_pair(texts) else [texts]
        starts = [len(t[0]) if _is_pair(t) else None for t in items]  # where a continuation's characters start
        requests = [{"prompt": "".join(t) if _is_pair(t) else t} for t in items]
        params = {"echo": True, "max_tokens": 0, "logprobs": logprobs, **fields}
        results = self.generate(requests, params)
        return [score_of(r, s) for r, s in zip(results, starts, strict=True)]

    def generate_file(self, input_path: str | os.PathLike, output_path: str | os.PathLike | None = None) -> str:
        """Run a request file exactly as file mode does (same writer, journal, resume, summary); returns
        the output path (default ``output_<input name>`` beside the input). A complete output is kept
        unless the LLM was made with ``overwrite=True``."""
        src = str(input_path)
        out = output_for(src, None if output_path is None else str(output_path), False)
        if Path(out).exists():
            if not self.opts.overwrite:
                log.warning("%s: complete output exists at %s, skipping (overwrite=True recomputes)", src, out)
                return out
            Path(out).unlink()
        with self._lock:
            self._check()
            done = self.engine.files.add(src, out)
            while True:
                try:
                    done.result(timeout=POLL_S)
                    return out
                except TimeoutError:
                    self._check()

    def _run(self, items: list, params, chat: bool, raise_errors: bool | None,
             use_tqdm: bool | None = None) -> Iterator[Result]:
        raise_errors = self.raise_errors if raise_errors is None else raise_errors
        per_row = params_for(params, len(items))
        with self._lock:
            self._check()
            done: queue.Queue = queue.Queue()
            waiting: dict[int, Live] = {}
            todo = iter(enumerate(items))
            # as file mode shows it: a bar on a terminal, else a log line a minute (tasks.progress)
            show = use_tqdm if use_tqdm is not None else len(items) > 1 and not self.opts.no_progress
            progress = Progress("chat" if chat else "generate", len(items)) if show and items else None
            tokens = 0
            try:
                while True:
                    while len(waiting) < IN_FLIGHT and (nxt := next(todo, None)) is not None:
                        i, item = nxt
                        early = self._submit(i, item, per_row[i], chat, done, waiting)
                        if early is not None:
                            if progress is not None:
                                progress.update(1, tokens)
                            yield _checked(early, raise_errors)
                    if not waiting:
                        return
                    try:
                        i, value = done.get(timeout=POLL_S)
                    except queue.Empty:
                        self._check()
                        continue
                    result = self._result(i, waiting.pop(i), value)
                    if progress is not None:
                        tokens += (result.usage or {}).get("completion_tokens", 0)
                        progress.update(1, tokens)
                    yield _checked(result, raise_errors)
            finally:
                if progress is not None:
                    progress.close()
                for live in waiting.values():  # the caller left the loop (or it raised): free their rows
                    self.engine.cancel(live)

    def _submit(self, i: int, item, params, chat: bool, done: queue.Queue, waiting: dict) -> Result | None:
        """Hand one request to the pipeline; a request that cannot be parsed is answered at once."""
        try:
            req = _request(i, item, params, chat, self.opts.lenient_fields)
        except RequestError as e:
            return Result(i, getattr(e, "raw", item), error=e.to_dict())
        if req.ignored:
            log.warning("request %d: fields ignored (lenient_fields): %s", i, ", ".join(req.ignored))
        channel = FutureChannel()
        channel.future.add_done_callback(lambda f, i=i: done.put((i, f.result())))
        waiting[i] = self.engine.submit(req, channel, numbered=True)  # its position: a file line's stream
        return None

    def _result(self, i: int, live: Live, answer: Answer) -> Result:
        if answer.dead is None:
            result = from_answer(i, live.req.raw, answer)
            if live.req.kind == "chat" and result.prompt is None and result.prompt_token_ids is not None:
                result.prompt = self.get_tokenizer().decode(result.prompt_token_ids)  # as vLLM: the rendered prompt
            return result
        self._check()  # the pipeline stopped: with a dead worker's own message when there is one
        raise EngineDead(answer.dead)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the pipeline and every worker (idempotent). Requests in flight finish first (bounded)."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if self.engine is not None:
            self.engine.stop(STOP_GRACE)
            if self.engine.thread.is_alive():
                log.warning("the pipeline thread did not stop within %.0f s", STOP_GRACE)
        if self.workers is not None:
            self.workers.stop()
        # a pipeline thread that died or did not stop in time left the process group: a next LLM needs it gone
        grouped = self.engine is not None and (self.opts.dist_url is not None or under_torchrun())
        if grouped and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001
                log.warning("process group teardown: %s", e)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):  # interpreter shutdown
                self.close()


_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit: every LLM still open stops its workers (under torchrun this releases the other ranks)."""
    for llm in list(_OPEN):
        llm.close()


def _other_stage(plan, opts, info) -> int:
    """A stage of an ``in_process`` LLM but the first: passes until rank 0 stops."""
    serve_rank(start_rank(plan, opts, info))
    return 0


def _serve_and_exit(opts) -> None:
    """A rank other than 0 under torchrun: serve passes until rank 0 closes its LLM, then end the process."""
    plan = make_plan(opts)
    if plan.data != 1:
        raise UsageError("the Python API runs one pipeline (data_group_size 1)")
    rank = start_rank(plan, opts)
    clean = False
    try:
        serve_rank(rank)
        clean = True
    finally:
        shutdown(rank.info, clean)
    sys.exit(0)


def _as_list(prompts) -> list:
    """One prompt (a string, a request dict, a list of token ids) or a list of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts) if isinstance(prompts, Iterable) else [prompts]
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt of token ids
    return items


def _is_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(s, str) for s in x)


def _request(i: int, item, params, chat: bool, lenient: bool = False):
    """A tasks.requests.Request from a prompt and its parameters (the request dict's own fields win)."""
    item = as_json(_tokens_prompt(item))  # as a line or a body holds it: what the stages are sent must encode at P > 1
    chatty = chat or (isinstance(item, dict) and "messages" in item)
    fields = as_json({"return_token_ids": True, **fields_of(params, chatty)})
    if chat:
        return parse_body({**fields, "messages": item}, True, i, lenient)
    if isinstance(item, dict):
        if "custom_id" in item and "body" in item:  # a Batch API line
            body = item["body"]
            return parse_request({**item, "body": {**fields, **body}} if isinstance(body, dict) else item, i, lenient)
        if "messages" in item:
            return parse_body({**fields, **item}, True, i, lenient)
        return parse_request({**fields, **item}, i, lenient)
    return parse_request({**fields, "prompt": item}, i, lenient)


def _tokens_prompt(item):
    """vLLM's ``{"prompt_token_ids": [...]}`` (a TokensPrompt, maybe with the text it came from) as a request
    with those ids as its prompt; anything else as it is."""
    if isinstance(item, dict) and "prompt_token_ids" in item and "messages" not in item:
        rest = {k: v for k, v in item.items() if k not in ("prompt_token_ids", "prompt")}
        return {**rest, "prompt": item["prompt_token_ids"]}
    return item


def _sampling(sampling_params, params):
    """generate()'s parameters under vLLM's name, or the API's older ``params``."""
    if sampling_params is not None and params is not None:
        raise TypeError("give sampling_params (or params, its older name), not both")
    return sampling_params if sampling_params is not None else params


def _checked(result: Result, raise_errors: bool) -> Result:
    if raise_errors and result.error is not None:
        raise RequestFailed(result.index, result.error)
    return result
