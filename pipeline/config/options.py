"""Run options: one dataclass, from which argparse and the YAML config loader are built.

Defaults are written once, on the fields. ``--config run.yaml`` supplies values keyed by the long
flag names (``budget: 4096``, ``infer-data: [a.jsonl]``); flags on the command line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config.capabilities import refusals
from pipeline.config.interactive_options import interactive_problems
from pipeline.loading.hub import looks_like_repo_id
from pipeline.config.serve_options import read_key_file, serve_address, serve_problems  # noqa: F401 (read_key_file: re-exported)
from pipeline.config.partition import parse_layers_per_stage, parse_stage_memory
from pipeline.models.backends import BACKENDS  # what each means
from tasks.requests import SEED_RANGE

PP_MODES = ("pipe_sync_sample_mask_token_pipe",)
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZE = ("none", "int8")
# --prefill-chunk auto with several stages. A GPU computes a few hundred tokens in about a decode
# step's time (both read the weights once), so chunks of 512 even out its passes; on the CPU a pass's
# time grows with its tokens from the first: 64 tokens cost about a 32-row decode step (docs/design/chunked-prefill.md)
AUTO_PREFILL_CHUNK = {"cpu": 64, "cuda": 512}


class UsageError(ValueError):
    """A problem with how the runner was invoked; reported without a traceback (exit code 2)."""


def number_or_auto(what: str):
    """The argparse type of --budget and --prefill-chunk: a number of ``what``, or auto."""
    def value(text: str) -> int | str:
        if text == "auto" or text.isdigit():
            return text if text == "auto" else int(text)
        raise argparse.ArgumentTypeError(f"expected a number of {what} or auto, got {text!r}")
    return value


def _opt(default, help: str, least: int | None = None, **argparse_kwargs):
    """A flag's field: its default, help and argparse settings; ``least``: the smallest value it takes
    (check_options refuses a smaller one, from the command line or --config alike)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs, **({} if least is None else {"least": least})})


@dataclass
class RunOptions:
    # what to run
    model_name: str | None = _opt(None, "HuggingFace model folder (config.json + weights + tokenizer), or a hub id org/name (org/name@REVISION too), found in the HuggingFace cache or downloaded (each stage fetches only its own shards; HF_HUB_OFFLINE=1: the cache only). Omitted: the embedded default tiny Llama, built locally on first use.")
    revision: str | None = _opt(None, "Hub id only: the branch, tag or commit of --model-name (default: main).")
    cache_dir: str | None = _opt(None, "Hub id only: the HuggingFace cache folder to find and download models and --lora adapters in (default: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).")
    model_type: str | None = _opt(None, "Model family (gpt2, gptj, gptneox, opt, bloom, llama, falcon, or any HF model_type, see --backend). Omitted: read from config.json.")
    backend: str = _opt("auto", "Stage code: auto = the native family if there is one, else transformers' own decoder layers (any decoder-only *ForCausalLM); native = native code only; transformers = force the generic stage.", choices=BACKENDS)
    infer_data: list[str] = _opt(None, "Request files (JSONL): several files, a glob or a directory. Omitted: the path after '#' in the job name, else dummy-data mode.", nargs="+")
    output_path: str | None = _opt(None, "Output file (one input; an existing directory: output_<input name> in it) or directory (several inputs). Default: output_<input name> beside each input.")
    job_name: str | None = _opt(None, "Job name NAME#PATH: PATH is used as --infer-data when that is omitted (LSF's LSB_JOBNAME and Slurm's SLURM_JOB_NAME are read too, in that order).")
    # scheduling
    budget: int | str = _opt("auto", "KV-cache tokens held at once over all micro-batches (rows x columns); requests beyond it wait. auto = what fits in the memory left once every stage has loaded (the least over stages, 1 GiB or 10%% kept free; on CPU the available RAM shared among the node's processes, 8192..65536). A ceiling: a micro-batch takes only the cells its rows need.", type=number_or_auto("KV-cache tokens"))
    max_micro_batch_size: int = _opt(64, "Most sequences (rows) in one micro-batch.", least=1)
    num_micro_batches: int = _opt(0, "Micro-batches kept in flight; 0 = the pipeline size P on GPU, P + 1 on CPU with P > 1 (the extra one covers the ring's host work: sampling, scheduling), P there too when a stage holds 512 MiB of weights or more (its decode passes are bound by reading them, once per micro-batch); 1 for such stages when the whole pipeline runs on one node, where they take turns with every core (see --num-threads).", least=0)
    pp_mode: str = _opt(PP_MODES[0], "Pipeline schedule; kept so the seed runner's command lines still work (there is one schedule).", choices=PP_MODES)
    prefix_cache: str = _opt("on", "Reuse the keys and values of prompt prefixes shared by several requests (few-shot prefixes, multiple-choice contexts): computed once, copied into each later row. Off under --batch-invariant, for longrope models and on the generic transformers stage.", choices=("on", "off"))
    prefix_block_size: int = _opt(16, "Tokens per prefix-cache block: prefixes are shared in whole blocks.", least=1)
    prefill_chunk: int | str = _opt("auto", "Chunked prefill: a generating prompt (no echo, best_of 1) longer than this many tokens is computed over several passes of its micro-batch, this many tokens a pass, so that no pass is far longer than the others and the pipeline stages do not wait for one another. 0 = whole prompts; auto = %d on CPU and %d on GPU with several stages, 0 with one stage or --batch-invariant (and on the generic transformers stage or longrope models, which cannot resume a prompt)." % (AUTO_PREFILL_CHUNK["cpu"], AUTO_PREFILL_CHUNK["cuda"]), type=number_or_auto("prompt tokens (0: off)"))
    seed: int = _opt(42, "Run seed: with a request's position it fixes sampled outputs of requests without their own 'seed'.")
    # model partition and numerics
    num_layers: int | None = _opt(None, "Layers per pipeline stage (the seed's meaning). Omitted: split evenly.")
    max_layers: int | None = _opt(None, "Use only the first N layers of the model (trailing layers dropped).")
    layers_per_stage: str | None = _opt(None, "Explicit, possibly unequal layers of each stage, e.g. 10,14,14,10: one number per pipeline stage, adding up to the model's layers (or --max-layers).", metavar="N,N,...")
    stage_memory: str | None = _opt(None, "Size stages by memory: each stage's memory, e.g. 20GiB,40GiB (one per stage, or one for all), or auto (GPU: each device's free memory; CPU: available RAM divided by the local processes). Layers go to stages in proportion to what is left after the embedding (first stage), the head (last stage), the --budget KV cache and the adapters; the plan is printed before loading.", metavar="SIZES|auto")
    lora: list[str] = _opt(None, "A PEFT LoRA adapter folder, or a hub id org/adapter (org/adapter@REVISION too), as NAME=PATH (repeat for several). A request's 'model' names the adapter it runs with; the base model's name, or no 'model', runs the base. Requests for different adapters share micro-batches.", action="append", metavar="NAME=PATH")
    fp16: bool = _opt(False, "Shorthand for --dtype float16.")
    dtype: str = _opt("auto", "Weights and activations dtype; auto = checkpoint dtype on GPU, float32 on CPU. Logprobs are always float32.", choices=DTYPES)
    quantize: str = _opt("none", "int8: the decoder layers' linear weights stored in int8 (per-output-channel scales, quantized as each stage loads); each stage times int8 compute (dynamic per-token activations) against dequantizing to --dtype on its own shapes and keeps the faster (see docs/usage/quantization.md). Native families only; not with --lora or --batch-invariant.", choices=QUANTIZE)
    kv_cache_dtype: str = _opt("auto", "Keys and values kept in the KV cache: auto = the compute dtype; int8 = one byte a value plus a float32 scale per token and head (CPU, native families): decode attention reads a quarter of float32's bytes, half of bfloat16's. Prompts attend to their own keys before they are stored, so echo scoring is unchanged; generated tokens see the rounding (see docs/usage/quantization.md).", choices=("auto", "int8"))
    kernel_table: str | None = _opt(None, "JSON file of the kernels chosen per layer shape for --quantize int8 and pre-quantized checkpoints (read where it has the shape; where not, timed once and written to it). Default: one file per kind of machine in the cache (DIST_INFER_CACHE, else ~/.cache/dist-inference-runner/kernels/), so a choice is made once and kept; give a path to pin the choices (e.g. one file for every node of a cluster). See docs/usage/quantization.md.", metavar="PATH")
    cpu_linear: str = _opt("onednn", "CPU stages in float32 (and bfloat16 on CPUs with avx512_bf16 or AMX): onednn = the decoder layers' linear weights (and a float32 head of its own, at most a tenth of its stage's weights) reordered once, at load, into oneDNN's blocked layout and multiplied by its kernel (measured 1.2-2.6x faster than MKL at decode micro-batch sizes, even at prefill sizes; results within float rounding); bfloat16 on CPUs without bf16 instructions: the project's AVX2 loop on the weights as loaded (PyTorch's bf16 product collapses beyond one row there); plain = F.linear (MKL). GPU stages, float16, --quantize and --batch-invariant always use their own kernels.", choices=("onednn", "plain"))
    no_memory_check: bool = _opt(False, "Skip the check before loading that the stages on this node fit its memory (weights in the run's dtype, the --budget KV cache, the process itself; on GPUs each device's free memory). Use it when the estimate is wrong for your machine.")
    batch_invariant: bool = _opt(False, "Bit-identical logits for a request whatever shares its micro-batch, the budget or the pipeline size (fixed-shape row tiles, per-row attention), so sampled outputs repeat exactly across layouts; costs speed (see docs/design/determinism.md).")
    trust_remote_code: bool = _opt(False, "Allow tokenizers that need custom code from the model folder.")
    # distributed launch (torchrun sets these through the environment)
    world_size: int | None = _opt(None, "Legacy launch: total number of processes.")
    pipeline_group_size: int | None = _opt(None, "Stages per pipeline (default: world size / data group size).")
    data_group_size: int = _opt(1, "Independent pipelines sharing the requests (world = data x pipeline).", least=1)
    rank: int | None = _opt(None, "Legacy launch: this process's rank.")
    cuda_id: int | None = _opt(None, "Legacy launch: CUDA device index of this process.")
    dist_url: str | None = _opt(None, "Legacy launch: rendezvous URL, e.g. tcp://127.0.0.1:29500.")
    in_process: bool = _opt(False, "Run every rank (--pipeline-group-size x --data-group-size) as a thread of this one process, joined by in-memory links instead of a process group: no torchrun. For tests and debugging, and for several stages on one GPU (each stage on GPU stage %% device count).")
    dist_backend: str = _opt("auto", "How ranks talk: auto = NCCL for activations on GPUs (one rank per GPU) and gloo on CPUs; gloo = every message through host memory, also on GPUs, where ranks may then share a GPU (a pipeline tested on one GPU; slower than NCCL); nccl = require GPUs.", choices=("auto", "gloo", "nccl"))
    timeout: int = _opt(1800, "Seconds a collective may wait before the run fails (first prefill of a big model included).", least=1)
    num_threads: int = _opt(0, "CPU threads per process; 0 = the cores this process may use (its affinity mask, e.g. a Slurm or LSF allocation, and its cgroup's CPU quota) divided among local processes, 1 for a model under 400k weights a layer; every core of the node (its share per pipeline) for stages of 512 MiB of weights or more when the whole pipeline runs on one node and --num-micro-batches is 0 or 1: the stages take turns with the cores, one micro-batch at a time, as fast as one process there (on a node shared with other work, --num-threads 1 stages side by side hold up better). Threads wait passively between parallel regions (OMP_WAIT_POLICY=PASSIVE unless OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME is set).", least=0)
    # requests and results
    truncate_prompts: bool = _opt(False, "Left-truncate prompts that do not fit the context window (noted in the result) instead of failing them.")
    json_string_max_length: int = _opt(256, "Structured outputs: a JSON schema's string that sets no length of its own (no maxLength, pattern, format, enum or const) is closed by the grammar at this many characters, so a model that never ends a string (a plain str field on a small model) still gives valid JSON within max_tokens; give a maxLength in the schema for longer text. An integer without a minimum or maximum is likewise held to 18 digits. 0: neither bound (vLLM's and OpenAI's behaviour).", least=0)
    lenient_fields: bool = _opt(False, "Ignore request fields this runner does not know or does not implement with the value given (vLLM's behaviour), logging and counting them (the summary's ignored_fields), instead of answering the request with an error naming the field.")
    grammar_timeout: float = _opt(5, "Structured outputs: seconds each distinct JSON schema, regex or grammar may take to compile; one that takes longer is that request's error.", type=float)
    reasoning_parser: str = _opt("auto", "Reasoning models: how a row's thinking is told from its answer (chat results carry it in message.reasoning_content, usage counts its reasoning_tokens, thinking_token_budget and reasoning_effort bound it, structured outputs and stop strings apply to the answer). auto = qwen3 when the chat template writes <think> (Qwen3, QwQ, DeepSeek-R1 and its distills, the default model), else none; qwen3 = <think>...</think>, a row thinks when its prompt ends inside <think> (or a chat answer opens with it); deepseek_r1 = the same, every chat row starts inside the thinking; gpt_oss is refused (its channels are special tokens); none = raw text (see docs/usage/reasoning.md).", choices=("auto", "none", "qwen3", "deepseek_r1", "gpt_oss"))
    retry_starved: bool = _opt(False, "Reasoning models: a request whose thinking used max_tokens and left an answer empty (finish_reason length, 'starved' in the choice) runs once more in the same job with the same seed, its thinking budget twice what it thought and max_tokens that much larger (within the context window and --budget); its line is the rerun's (see docs/usage/reasoning.md).")
    overwrite: bool = _opt(False, "Recompute inputs whose output already exists.")
    checkpoint_interval: float = _opt(60.0, "Seconds between checkpoints of the rows in flight (each row's generated tokens and logprobs, beside the journal) and of the lines answered that wait for an earlier one: a run started again after a crash resumes the rows mid-generation instead of from their first token, and keeps those lines; a stop (SIGTERM, SIGINT) checkpoints at once. 0: only at a stop.", type=float, least=0)
    strict: bool = _opt(False, "Exit non-zero when any request failed, or when a reasoning model's thinking left some answer empty (starved rows, after --retry-starved).")
    no_progress: bool = _opt(False, "No progress bar or progress log lines.")
    profiling: bool = _opt(False, "Write a Chrome trace of compute and communication per rank beside the output.")
    status_file: str | None = _opt(None, "File mode: a JSON file replaced atomically every --status-interval seconds and at the end with the run's state (loading, running, finished, failed: reason), lines done per file, tokens, tokens/s, ETA, per-stage busy and memory (see docs/usage/monitoring.md). Default: <output>.status.json beside the (first) output; 'none' turns it off.", metavar="PATH")
    status_interval: int = _opt(5, "File mode: seconds between status file updates (the file's heartbeat_seconds: an updated_at older than a few of these means the writing rank is gone).", least=1)
    metrics_port: int | None = _opt(None, "File mode: serve Prometheus metrics at http://127.0.0.1:PORT/metrics from the writing rank while the run lasts (serve mode has /metrics on its own port).", metavar="PORT")
    dry_run: bool = _opt(False, "Read the request files and the model's config (no weights), count prompt tokens, print the plan (layers and memory per stage, budget, micro-batches, shared-prefix ratio) and an estimate of the run's time, then exit 0 without writing outputs.")
    # dummy-data mode (no --infer-data)
    batch_size: int = _opt(8, "Dummy-data mode: number of synthetic prompts.", least=1)
    input_seq_length: int = _opt(64, "Dummy-data mode: prompt length in tokens.", least=1)
    generate_seq_length: int = _opt(32, "Dummy-data mode: tokens to generate per prompt.", least=1)
    # talking to the model (terminal/prompts.py, terminal/chat_shell.py; docs/usage/chat.md)
    prompts: list[str] = _opt(None, "Generate for these prompts (one quoted text each) with the sampling flags below, print each with its completion and a latency report, then exit.", nargs="+", metavar="TEXT")
    prompts_file: str | None = _opt(None, "Like --prompts, one prompt per line of this text file (blank lines skipped; \\n in a line is a newline).")
    chat: bool = _opt(False, "An interactive chat shell on the loaded pipeline (rank 0 reads the terminal), or with --url on a running --serve server; /help lists its commands.")
    url: str | None = _opt(None, "--chat: the address of a running server (http://HOST:PORT), instead of loading a model; --api-key (or $DIST_INFER_API_KEY) is its key.")
    max_tokens: int = _opt(128, "--prompts and --chat: most tokens generated per answer.", least=1)
    temperature: float = _opt(1.0, "--prompts and --chat: sampling temperature (0: greedy).", type=float)
    top_p: float = _opt(1.0, "--prompts and --chat: nucleus sampling, in (0, 1].", type=float)
    top_k: int = _opt(0, "--prompts and --chat: sample among the k likeliest tokens (0: all).", least=0)
    presence_penalty: float = _opt(0.0, "--prompts and --chat: OpenAI's presence penalty, in [-2, 2].", type=float)
    frequency_penalty: float = _opt(0.0, "--prompts and --chat: OpenAI's frequency penalty, in [-2, 2].", type=float)
    repetition_penalty: float = _opt(1.0, "--prompts and --chat: vLLM's and transformers' multiplicative repetition penalty over the prompt's and the answer's tokens, above 0 (1: off; 1.1-1.3 are usual).", type=float)
    min_p: float = _opt(0.0, "--prompts and --chat: keep only tokens at least this fraction as likely as the likeliest, in [0, 1] (0: off).", type=float)
    stop: list[str] = _opt(None, "--prompts and --chat: a stop string (repeat for up to 4); \\n is a newline.", action="append", metavar="TEXT")
    system_prompt: str | None = _opt(None, "--chat: the system message the conversation starts with (/system changes it).")
    user_msg_fmt: str | None = _opt(None, "--chat on a model without a chat template (or to bypass it): each user turn as this text with {} for the message, e.g. 'Question: {}\\nAnswer:'; the prompt is the system prompt followed by the turns.")
    assistant_msg_fmt: str | None = _opt(None, "--chat with --user-msg-fmt: each answer as this text with {} for it (default '{}\\n'); the text before {} starts the answer being generated.")
    # serve mode
    serve: str | None = _opt(None, "Serve an OpenAI-compatible HTTP API on [HOST:]PORT (default host 127.0.0.1; port 0: a free one, named in the 'serving ... on' line) instead of reading request files.", metavar="[HOST:]PORT")
    served_model_name: str | None = _opt(None, "Serve mode: the model name clients use (default: the model folder's name).")
    api_key: str | None = _opt(None, "Serve mode: require 'Authorization: Bearer KEY' on every /v1 endpoint (default: $DIST_INFER_API_KEY). Visible in ps: prefer --api-key-file or the environment variable.")
    serve_dir: str | None = _opt(None, "Serve mode: folder for uploaded files, batch state and outputs (batches resume from it after a restart). Omitted: a temporary folder.")
    max_pending: int = _opt(256, "Serve mode: interactive requests waiting or running at once; more get 429 with Retry-After.", least=1)
    max_request_bytes: int = _opt(8 << 20, "Serve mode: largest JSON request body in bytes, chunked bodies included (larger: 413).", least=1)
    # serve mode: limits where clients reach (serve/limits.py, serve/connection_limits.py, serve/auth.py)
    api_key_file: str | None = _opt(None, "Serve mode: file of API keys, one a line as KEY, NAME:KEY or 'KEY NAME' (# comments); each key's name identifies its holder. Not with --api-key.")
    max_upload_bytes: int = _opt(200_000_000, "Serve mode: largest uploaded file (POST /v1/files) in bytes, streamed to --serve-dir with a running count (larger: 413); OpenAI's limit for batch input files is 200 MB.", least=1)
    max_pending_rows: int = _opt(4096, "Serve mode: rows (prompts x best_of) of interactive requests waiting, running or streaming at once; more get 429 with Retry-After.", least=1)
    max_prompts_per_request: int = _opt(2048, "Serve mode: most prompts in one completions request (more: 400).", least=1)
    max_connections: int = _opt(0, "Serve mode: open HTTP connections at most; beyond it the oldest connection still waiting for a request head is closed, or the new one gets 503. 0 = the open-file limit minus 64.", least=0)
    header_timeout: float = _opt(10.0, "Serve mode: seconds a connection may take to send a complete request head (counted from connecting or from the previous answer); then it is closed.", type=float, least=1)
    body_timeout: float = _opt(30.0, "Serve mode: seconds a request body may go without a byte while the server waits for it; then 408 and the connection closes.", type=float, least=1)
    keep_alive_timeout: int = _opt(5, "Serve mode: seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive).", least=1)
    send_timeout: float = _opt(60.0, "Serve mode: seconds a client may leave the server's output unread (a slow or stalled reader, a stream it does not read); then the connection closes and its rows are freed.", type=float, least=1)
    allowed_hosts: str | None = _opt(None, "Serve mode: comma-separated Host header names accepted besides localhost, IP addresses and the --serve host (and this machine's names when bound beyond loopback); * accepts any (others: 403, against DNS rebinding).")
    allowed_origins: str | None = _opt(None, "Serve mode: comma-separated browser origins (scheme://host[:port]) allowed to call the API, with CORS headers; * allows any. A request with another Origin gets 403 (same-origin pages on an accepted host are allowed).")
    # serve mode: the Batch API's storage (per API key) and the state folder
    key_storage_bytes: int = _opt(10 << 30, "Serve mode: bytes of files (uploads and batch outputs) one API key may keep; an upload beyond it gets 413.", least=1)
    key_max_files: int = _opt(1000, "Serve mode: files one API key may keep; an upload beyond it gets 429.", least=1)
    file_expiry_hours: int = _opt(720, "Serve mode: an uploaded file is deleted this long after its upload, unless it sets its own expires_after (1 hour to 30 days).", least=1)
    batch_retention_hours: int = _opt(720, "Serve mode: an ended batch's output and error files, and its record, are deleted this long after it ended.", least=1)
    min_free_disk_bytes: int = _opt(256 << 20, "Serve mode: below this much free space in --serve-dir, batches pause (interactive requests go on) until space is freed.", least=0)
    config: str | None = _opt(None, "YAML file of options keyed by long flag names; command-line flags override it.")

    @property
    def torch_dtype_name(self) -> str:
        return "float16" if self.fp16 else self.dtype


def quiet_exit_grace() -> None:
    """Before a rank other than 0 exits quietly on a problem every rank finds: wait a moment, so that
    rank 0 prints the message first. Under torchrun the first rank to exit is the failure it reports,
    and it stops the others at once; without the wait rank 0 could be stopped before printing."""
    time.sleep(QUIET_GRACE_S)


QUIET_GRACE_S = 3.0


HELP_POINTER = "python dist_inference_runner.py --help lists every flag (docs/usage/flags.md)"


class _Parser(argparse.ArgumentParser):
    quiet = False  # exit 2 without printing (every rank but rank 0: the message is printed once)

    def error(self, message: str):
        """The problem in one line and where the flags are described, not argparse's 70 lines of usage."""
        if self.quiet:
            quiet_exit_grace()
            sys.exit(2)
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}\n{HELP_POINTER}\n")

    def _suggestion(self, message: str) -> str:
        """For a flag argparse does not know: the flags it may be a misspelling of."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        import difflib

        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        unknown = [w.split("=", 1)[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
        close = [m for w in unknown for m in difflib.get_close_matches(w, known, n=1, cutoff=0.75)]
        return f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dist_inference_runner.py",
        description="Pipeline-parallel batch inference over OpenAI-style completion request files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(RunOptions):
        flag = "--" + f.name.replace("_", "-")
        kwargs = {k: v for k, v in f.metadata.items() if k != "least"}
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=f.default, **kwargs)
            continue
        if "nargs" not in kwargs:
            kwargs.setdefault("type", int if f.type.startswith("int") else str)  # list fields (append): str
        parser.add_argument(flag, default=f.default, **kwargs)
    return parser


def _load_yaml(path: str, parser: argparse.ArgumentParser) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        parser.error(f"--config {path}: {e.strerror}")
    except yaml.YAMLError as e:
        parser.error(f"--config {path}: not valid YAML: {e}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of option names to values")
    known = {f.name for f in dataclasses.fields(RunOptions)}
    values = {str(k).lstrip("-").replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(k for k in values if k not in known or k == "config")
    if unknown:
        parser.error(f"--config {path}: unknown option(s) {', '.join(unknown)}; keys are the long flag names, e.g. budget, infer-data")
    values = {k: v for k, v in values.items() if v is not None}  # null: the default (seed: null crashed the run)
    if isinstance(values.get("infer_data"), str):
        values["infer_data"] = [values["infer_data"]]
    if isinstance(values.get("prefix_cache"), bool):  # YAML 1.1 reads an unquoted on / off as a boolean
        values["prefix_cache"] = "on" if values["prefix_cache"] else "off"
    types = {f.name: f.type for f in dataclasses.fields(RunOptions)}
    for key, value in values.items():
        if _type_ok(types[key], value):
            continue
        parser.error(f"--config {path}: '{key.replace('_', '-')}' must be {_type_word(types[key])}, got {value!r}")
    for f in dataclasses.fields(RunOptions):
        if "choices" in f.metadata and values.get(f.name) not in (None, *f.metadata["choices"]):
            parser.error(f"--config {path}: '{f.name.replace('_', '-')}' must be one of {', '.join(f.metadata['choices'])}")
    return values


def _type_ok(annotation: str, value) -> bool:
    if annotation == "bool":
        return isinstance(value, bool)
    if annotation == "int | str":  # a number or auto (--budget)
        return (isinstance(value, int) and not isinstance(value, bool)) or value == "auto"
    if annotation.startswith("int"):
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation.startswith("list"):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, str)


def _type_word(annotation: str) -> str:
    if annotation == "int | str":
        return "an integer or auto"
    return {"bool": "true or false", "list": "a list of paths", "float": "a number"}.get(
        annotation.split("[")[0].split(" ")[0], "an integer" if annotation.startswith("int") else "a string")


def parse_options(argv: list[str] | None = None, quiet: bool = False) -> RunOptions:
    """Parse flags (after merging --config), check what can be checked without a model.
    A problem exits 2 with the message (``quiet``: without it, for every rank but rank 0)."""
    parser = build_parser()
    parser.quiet = quiet
    first = parser.parse_args(argv)
    if first.config:
        parser.set_defaults(**_load_yaml(first.config, parser))
    ns = parser.parse_args(argv)
    opts = RunOptions(**vars(ns))
    problems = check_options(opts)
    if problems:
        parser.error("; ".join(problems))
    return opts


def check_options(opts: RunOptions) -> list[str]:
    """Flag problems that need no model: each message says what to change."""
    problems = []
    for f in dataclasses.fields(RunOptions):  # the fields' lower bounds (_opt's least)
        value, least = getattr(opts, f.name), f.metadata.get("least")
        if least is not None and value is not None and value < least:
            problems.append(f"--{f.name.replace('_', '-')} must be at least {least}, got {value}")
    if opts.budget != "auto" and not (isinstance(opts.budget, int) and opts.budget >= 1):
        problems.append(f"--budget must be a positive number of KV-cache tokens or auto, got {opts.budget}")
    if not SEED_RANGE[0] <= opts.seed <= SEED_RANGE[1]:  # a 64-bit seed, as a request's
        problems.append(f"--seed must be an integer between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {opts.seed}")
    if not opts.grammar_timeout > 0:
        problems.append(f"--grammar-timeout must be a positive number of seconds, got {opts.grammar_timeout}")
    if opts.prefill_chunk != "auto" and not (isinstance(opts.prefill_chunk, int) and opts.prefill_chunk >= 0):
        problems.append(f"--prefill-chunk must be a number of prompt tokens (0: off) or auto, got {opts.prefill_chunk}")
    if opts.batch_invariant and opts.prefill_chunk not in ("auto", 0):
        problems.append("--prefill-chunk changes how a prompt is computed, which --batch-invariant keeps fixed: "
                        "drop --prefill-chunk (auto is off under --batch-invariant)")
    if opts.reasoning_parser == "gpt_oss":
        problems.append("--reasoning-parser gpt_oss: gpt-oss's harmony channels are not parsed (their markers are "
                        "special tokens, which results leave out of the text); use --reasoning-parser none: results then "
                        "carry the raw text of both channels (docs/usage/reasoning.md)")
    if opts.status_file == "":
        problems.append("--status-file needs a file path ('none' turns the status file off)")
    if opts.metrics_port is not None and not 0 < opts.metrics_port < 65536:
        problems.append(f"--metrics-port must be a TCP port (1-65535), got {opts.metrics_port}")
    if opts.metrics_port is not None and opts.status_file == "none":
        problems.append("--metrics-port serves the status file's figures: drop --status-file none (or --metrics-port)")
    if opts.serve is not None and (opts.dry_run or opts.metrics_port is not None or opts.status_file):
        problems.append("--dry-run, --metrics-port and --status-file are for file mode: serve mode has /metrics on "
                        "its own port; drop them or --serve")
    if opts.fp16 and opts.dtype not in ("auto", "float16"):
        problems.append(f"--fp16 contradicts --dtype {opts.dtype}: pass only one of them")
    if opts.model_name is not None and not Path(opts.model_name).is_dir() and not looks_like_repo_id(opts.model_name):
        problems.append(
            f"--model-name {opts.model_name}: no such folder, nor a hub id org/name (give a HuggingFace model "
            "folder or a hub id such as Qwen/Qwen2.5-0.5B; omit --model-name to use the embedded default model)"
        )
    if opts.revision is not None and (opts.model_name is None or Path(opts.model_name).is_dir()):
        problems.append("--revision applies to a hub id given as --model-name org/name: drop --revision")
    if opts.serve is not None:
        try:
            serve_address(opts.serve)
        except ValueError as e:
            problems.append(str(e))
        if opts.data_group_size != 1:
            problems.append("--serve runs one pipeline: drop --data-group-size (or run one server per pipeline)")
        if opts.infer_data:
            problems.append("--serve takes requests over HTTP: drop --infer-data (or send the file through the Batch API)")
    problems += _layout_problems(opts) + _lora_problems(opts) + _kernel_table_problems(opts)
    problems += refusals(opts, generic="--backend transformers" if opts.backend == "transformers" else None)
    problems += serve_problems(opts)
    problems += interactive_problems(opts)
    return problems


def _layout_problems(opts: RunOptions) -> list[str]:
    problems = []
    if opts.in_process and (opts.rank is not None or opts.world_size is not None or opts.dist_url is not None):
        problems.append("--in-process runs every rank in this process: drop --rank, --world-size and --dist-url")
    if opts.in_process and opts.dist_backend != "auto":
        problems.append("--in-process joins its ranks by in-memory links, not a process group: drop --dist-backend")
    given = [f for f in ("num_layers", "layers_per_stage", "stage_memory") if getattr(opts, f) is not None]
    if len(given) > 1:
        problems.append(f"{' and '.join('--' + f.replace('_', '-') for f in given)} each decide the stage sizes: "
                        "pass only one of them")
    try:
        if opts.layers_per_stage is not None:
            parse_layers_per_stage(opts.layers_per_stage)
        if opts.stage_memory is not None:
            parse_stage_memory(opts.stage_memory)
    except ValueError as e:
        problems.append(str(e))
    return problems


def _lora_problems(opts: RunOptions) -> list[str]:
    if not opts.lora:
        return []
    problems, names = [], set()
    for value in opts.lora:
        try:
            name, path = parse_lora_flag(value)
        except ValueError as e:
            problems.append(str(e))
            continue
        if name in names:
            problems.append(f"--lora {value}: the name {name!r} is given twice")
        if name in (opts.served_model_name, Path(opts.model_name or "").name):  # requests naming it get the base
            problems.append(f"--lora {value}: {name!r} is the base model's name: give the adapter another")
        names.add(name)
        if not Path(path).is_dir() and not looks_like_repo_id(path):
            problems.append(f"--lora {value}: no such folder, nor a hub id org/name")
    return problems


def _kernel_table_problems(opts: RunOptions) -> list[str]:
    """--kernel-table PATH: a file there must be a table (it is read and added to, never replaced)."""
    if not opts.kernel_table or not Path(opts.kernel_table).exists():
        return []
    try:
        data = json.loads(Path(opts.kernel_table).read_text())
        if isinstance(data, dict) and isinstance(data.get("entries", {}), dict):
            return []
    except (OSError, ValueError):
        pass
    return [f"--kernel-table {opts.kernel_table}: not a kernel table (a JSON object with 'entries', as a run writes "
            "it): give a new path or a table a run wrote"]


def parse_lora_flag(value: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, path); ValueError saying what is wrong."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora {value}: expected NAME=PATH (e.g. --lora support-bot=/adapters/support-bot)")
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$", name):
        raise ValueError(f"--lora {value}: the name {name!r} may hold only letters, digits and . _ : / -")
    return name, path
