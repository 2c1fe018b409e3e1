"""Shared test helpers: tiny HF models in temp dirs, in-process stage chains, real multi-process runs.

No hub access anywhere: models are random ``save_pretrained`` folders, tokenizers are the
project's locally trained BPE (pipeline/loading/default_model.py).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from subprocess import CompletedProcess  # run_local's result: no process (tests/conftest.py counts names)

import torch

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "dist_inference_runner.py"
DATA = REPO / "tests" / "data"  # copies of ../shared/data, so the tests run from any checkout


@functools.lru_cache(maxsize=1)
def local_tokenizer():
    from pipeline.loading.default_model import build_tokenizer

    return build_tokenizer()


def save_hf_model(model, out_dir: str | os.PathLike, tokenizer=None, **save_kwargs) -> str:
    """save_pretrained the model (and the local tokenizer) into out_dir; returns the path."""
    out_dir = str(out_dir)
    model.save_pretrained(out_dir, **save_kwargs)
    (tokenizer or local_tokenizer()).save_pretrained(out_dir)
    return out_dir


def tiny_llama(out_dir, seed: int = 0, **overrides) -> str:
    """A random tiny Llama (vocab of the local tokenizer) saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = local_tokenizer()
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    return save_hf_model(model, out_dir)


def random_hf_model(out_dir, model_type: str, seed: int = 0, layers: int = 3, **overrides) -> str:
    """A random tiny HF model of ``model_type`` (vocab of the local tokenizer), saved with its tokenizer.
    Biases and norm weights are randomized too (HF zero-inits biases and sets norms to 1), so the
    weight maps are really checked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = local_tokenizer()
    key = "n_layer" if model_type == "gptj" else "num_hidden_layers"
    overrides = {"max_position_embeddings": 256, key: layers, **overrides}
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return save_hf_model(model, out_dir)


def stage_chain(model_dir: str, ranges: list[tuple[int, int]], dtype=torch.float32, model_type=None,
                batch_invariant: bool = False, backend: str = "auto", cpu_linear: str = "onednn"):
    """Our stage models for the given layer ranges, loaded from model_dir (in this process), with the
    runner's CPU linear kernel (``--cpu-linear``: oneDNN's prepacked weights where they apply)."""
    from pipeline.loading.stage_weights import build_stage
    from pipeline.models.kernels.packed import pack_stage

    n = len(ranges)
    chain = [build_stage(model_dir, a, b, i == 0, i == n - 1, dtype, "cpu", model_type, batch_invariant, backend)[0]
             for i, (a, b) in enumerate(ranges)]
    if cpu_linear == "onednn":
        for st in chain:
            pack_stage(st, torch.device("cpu"), dtype, batch_invariant)
    return chain


@torch.inference_mode()
def chain_logits(stages, prompts: list[list[int]], cache_cols: int | None = None,
                 adapters: list[int] | None = None) -> list[torch.Tensor]:
    """Full-prompt logits of each prompt run together as one right-ragged micro-batch through the chain.

    Returns one (len_i, vocab) float32 tensor per prompt. Different lengths share the batch, so
    this checks per-row positions and masks. ``adapters``: each row's LoRA adapter (0: base).
    """
    from pipeline.models.decoder import Segment

    b, t = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    seg = Segment(torch.arange(b), torch.zeros(b, dtype=torch.long), t, t, all_rows=True, fresh=True, prefill=True,
                  lens=[len(p) for p in prompts], adapters=adapters)
    x = ids
    for st in stages:
        x = st(x, seg, st.new_cache(b, cache_cols or t))
    logits = stages[-1].head(x)
    return [logits[i, : len(p)] for i, p in enumerate(prompts)]


@torch.inference_mode()
def chain_greedy(stages, prompts: list[list[int]], steps: int,
                 adapters: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy decode through the chain with the KV cache: (tokens, token logprobs) per prompt."""
    from pipeline.models.decoder import Segment

    b, t = len(prompts), max(len(p) for p in prompts)
    cols = t + steps
    caches = [st.new_cache(b, cols) for st in stages]
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    seg = Segment(torch.arange(b), torch.zeros(b, dtype=torch.long), t, t, all_rows=True, fresh=True, prefill=True,
                  lens=[len(p) for p in prompts], adapters=adapters)
    x = ids
    for st, c in zip(stages, caches, strict=True):
        x = st(x, seg, c)
    lens = torch.tensor([len(p) for p in prompts])
    h = x[torch.arange(b), lens - 1]
    out_tok, out_lp = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(steps):
        lp = torch.log_softmax(stages[-1].head(h), -1)
        nxt = lp.argmax(-1)
        for i in range(b):
            out_tok[i].append(int(nxt[i]))
            out_lp[i].append(float(lp[i, nxt[i]]))
        if step == steps - 1:
            break
        seg = Segment(torch.arange(b), lens + step, 1, int((lens + step).max()) + 1, all_rows=True, adapters=adapters)
        x = nxt[:, None]
        for st, c in zip(stages, caches, strict=True):
            x = st(x, seg, c)
        h = x[:, -1]
    return out_tok, out_lp


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """HuggingFace generate (greedy) on one unpadded prompt: tokens and their logprobs."""
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=model.config.pad_token_id or 0)
    toks = out.sequences[0, len(prompt):].tolist()
    lps = [float(torch.log_softmax(l[0].float(), -1)[t]) for l, t in zip(out.logits, toks, strict=True)]
    return toks, lps


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logits(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """HF logits (len, vocab) float32 for one unpadded prompt."""
    return _hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()


def assert_hf_parity(model_dir: str, prompts: list[list[int]], stages: int, num_layers: int = 3,
                     model_type: str | None = None, steps: int = 6, backend: str = "auto") -> None:
    """Our stage chain vs HF: logits of a mixed-length micro-batch within 1e-4 of HF on each prompt
    alone, and ``steps`` greedy tokens equal with logprobs within 1e-4."""
    from pipeline.config.partition import stage_ranges

    chain = stage_chain(model_dir, stage_ranges(num_layers, stages), model_type=model_type, backend=backend)
    for prompt, ours in zip(prompts, chain_logits(chain, prompts), strict=True):
        torch.testing.assert_close(ours, hf_logits(model_dir, prompt), atol=1e-4, rtol=1e-4)
    toks, lps = chain_greedy(chain, prompts, steps)
    for prompt, t, lp in zip(prompts, toks, lps, strict=True):
        ref_t, ref_lp = hf_greedy(model_dir, prompt, steps)
        assert t == ref_t
        assert max(abs(a - b) for a, b in zip(lp, ref_lp, strict=True)) < 1e-4


def free_port() -> int:
    """A port nothing listens on, outside the kernel's ephemeral range where there is room: the ports the
    kernel hands out by itself (gloo's listeners and every outgoing connection of a P > 1 run) cannot
    take it between this call and the moment a process binds it. A server that binds late (after
    loading) is better started on port 0: see :func:`wait_served`."""
    low, high = _ephemeral_range()
    candidates = [p for p in random.sample(range(10000, 32768), 64) if not low <= p <= high]
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room outside the range: a port the kernel picks
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 1024, 65535  # unknown: treat every port as one the kernel may hand out


SERVING = re.compile(r"serving \S+ on (http://\S+?)/v1 ")


def wait_served(proc: subprocess.Popen, log: Path, seconds: float, since: int = 0) -> str:
    """The base URL (``http://HOST:PORT``) of a server started as ``proc`` with ``--serve 0`` (or
    ``HOST:0``), once it has said which port the kernel gave it (the ``serving ... on`` line of ``log``
    after byte ``since``: a log that restarts append to) and answers /health with 200. Port 0 because a
    port picked before the start can be taken by the ports a P > 1 run opens before the server binds."""
    import time

    deadline = time.monotonic() + seconds
    while not (found := SERVING.search(log.read_bytes()[since:].decode(errors="replace"))):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "server did not come up:\n" + log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    wait_healthy(proc, found.group(1) + "/health", log, max(deadline - time.monotonic(), 1.0))
    return found.group(1)


def run_torchrun(args: list[str], nproc: int, timeout: float = 300, env: dict | None = None,
                 extra_torchrun: list[str] | None = None) -> subprocess.CompletedProcess:
    """torchrun --nproc-per-node nproc dist_inference_runner.py args (gloo on loopback)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *(extra_torchrun or []),
           str(RUNNER), *args]
    return run_cmd(cmd, timeout, env)


def run_single(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, str(RUNNER), *args], timeout, env)


def run_legacy(args: list[str], nproc: int, timeout: float = 300, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """The seed's launch: one `python dist_inference_runner.py --rank i ...` process per rank."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(RUNNER), *args, "--rank", str(i), "--cuda-id", str(i),
                               "--world-size", str(nproc), "--pipeline-group-size", str(nproc), "--dist-url", url],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env),
                              start_new_session=True)
             for i in range(nproc)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            _kill_group(p)
    return results


def run_cmd(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env),
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        _kill_group(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def read_jsonl(path) -> list[dict]:
    # "\n" only: str.splitlines would also split at U+2028 and U+2029, which JSON strings hold unescaped
    return [json.loads(line) for line in Path(path).read_text().split("\n") if line.strip()]


def strip_volatile(line: dict) -> dict:
    """An output line without the fields that differ between identical runs (ids, timing)."""
    line = json.loads(json.dumps(line))
    res = line.get("result") or (line.get("response") or {}).get("body")
    for obj in (line, res or {}):
        for k in ("id", "created", "request_time"):
            obj.pop(k, None)
    if isinstance(line.get("response"), dict):
        line["response"].pop("request_id", None)
    return line


def assert_identical_results(a: list[dict], b: list[dict]) -> None:
    """Two output files are the same, ids and timing aside: for one layout run twice, or for runs
    in --batch-invariant mode (whatever their budgets, pipeline sizes and neighbours)."""
    assert len(a) == len(b), (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x, y = strip_volatile(x), strip_volatile(y)
        assert x == y, f"line {i}: {_first_difference(x, y)}"


def _first_difference(x, y, where: str = "") -> str:
    if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
        return next((_first_difference(x[k], y[k], f"{where}.{k}") for k in x if x[k] != y[k]), "")
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return next((_first_difference(u, v, f"{where}[{j}]") for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), "")
    return f"{where}: {x!r} vs {y!r}"


def assert_consistent_results(a: list[dict], b: list[dict], tol: float = 1e-4, max_sampled_flips: float = 0.1) -> None:
    """Two default-mode outputs of different layouts (budgets, pipeline sizes, neighbours) agree as far
    as float rounding lets them: a row's logits may move by ~1e-7 when its micro-batch changes shape.

    Each choice agrees token by token, with logprobs within ``tol``, up to its first differing token.
    A greedy choice may differ only at a near-tie (the two runs' chosen logprobs within 1e-3 there);
    a sampled one only after identical tokens and logprobs (same distribution up to rounding, so the
    draw sat on a boundary), and for at most ``max_sampled_flips`` of the sampled choices.
    """
    assert len(a) == len(b), (len(a), len(b))
    flips, sampled = 0, 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x, y = strip_volatile(x), strip_volatile(y)
        assert x.keys() == y.keys() and x["request"] == y["request"], f"line {i}"
        if "result" not in x:
            assert x == y, f"line {i}"
            continue
        req = x["request"] if isinstance(x["request"], dict) else {}
        greedy = req.get("temperature", 1.0) == 0
        ca, cb = x["result"]["choices"], y["result"]["choices"]
        assert len(ca) == len(cb), f"line {i}"
        diverged = False
        for j, (u, v) in enumerate(zip(ca, cb, strict=True)):
            where, d = f"line {i} choice {j}", _divergence(u, v)
            sampled += not greedy
            if d is None:
                _close(u, v, tol, where)
                continue
            diverged, flips = True, flips + (not greedy)
            lu, lv = u["logprobs"], v["logprobs"]
            _close(lu["token_logprobs"][:d], lv["token_logprobs"][:d], tol, where)
            if greedy:
                gap = abs(lu["token_logprobs"][d] - lv["token_logprobs"][d])
                assert gap < 1e-3, f"{where}: greedy tokens differ at {d} without a near-tie (gap {gap})"
        if not diverged:
            _close(x["result"], y["result"], tol, f"line {i}")
    assert flips <= max(1, max_sampled_flips * sampled), f"{flips} of {sampled} sampled choices diverged"


def _divergence(u: dict, v: dict) -> int | None:
    """Index of the first differing token of two choices, or None when their tokens are equal."""
    tu = (u.get("logprobs") or {}).get("tokens") or []
    tv = (v.get("logprobs") or {}).get("tokens") or []
    if tu == tv and u.get("text") == v.get("text"):
        return None
    return next((k for k, (p, q) in enumerate(zip(tu, tv)) if p != q), min(len(tu), len(tv)))  # a prefix: the shorter one ends


def _close(x, y, tol: float, where: str) -> None:
    """Same structure and strings; numbers within ``tol``."""
    if isinstance(x, float) or isinstance(y, float):
        assert isinstance(x, (int, float)) and isinstance(y, (int, float)), where
        assert abs(x - y) <= tol, f"{where}: {x} vs {y}"
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), f"{where}: keys {list(x)} vs {list(y)}"
        for k in x:
            _close(x[k], y[k], tol, f"{where}.{k}")
    elif isinstance(x, list):
        assert isinstance(y, list) and len(x) == len(y), f"{where}: length {len(x)} vs {len(y) if isinstance(y, list) else y}"
        for k, (u, v) in enumerate(zip(x, y, strict=True)):
            _close(u, v, tol, f"{where}[{k}]")
    else:
        assert x == y, f"{where}: {x!r} vs {y!r}"


def run_inprocess(args: list[str], stages: int = 1) -> int:
    """A run inside the test process (errors raised): one stage, or ``stages`` stages as threads
    joined by in-memory links (``--in-process``: the same rank loops and messages as under torchrun)."""
    import dist_inference_runner
    from pipeline.config.options import parse_options

    if stages > 1:
        args = [*args, "--in-process", "--pipeline-group-size", str(stages)]
    threads = torch.get_num_threads()
    try:
        return dist_inference_runner.run(parse_options(args))
    finally:
        torch.set_num_threads(threads)


def run_local(args: list[str], stages: int = 1, env: dict | None = None, data: int = 1) -> subprocess.CompletedProcess:
    """:func:`run_torchrun` / :func:`run_single` in this process: ``dist_inference_runner.main`` with every
    rank (``stages`` x ``data``) a thread (``--in-process``), its stdout, stderr (the log included, rank
    prefixes as a process writes them) and exit code returned as a process's would be. ``env``: variables
    set for the run (restored after)."""
    import contextlib
    import io
    import logging

    import dist_inference_runner

    argv = [*args, "--in-process"]
    if stages > 1:
        argv += ["--pipeline-group-size", str(stages)]
    if data > 1:
        argv += ["--data-group-size", str(data)]
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.addFilter(dist_inference_runner._RankPrefix(0))
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root, level, threads = logging.getLogger(), logging.getLogger().level, torch.get_num_threads()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    root.addHandler(handler)
    root.setLevel(os.environ.get("DIST_INFER_LOG", "INFO").upper())
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = dist_inference_runner.main(argv, signals=False)
            except SystemExit as e:  # argparse: a usage error
                code = e.code if isinstance(e.code, int) else 1
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def write_jsonl(path, objs) -> str:
    Path(path).write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def llama_stage_tensors(layer: int, has_embed: bool, has_head: bool) -> set[str]:
    """The checkpoint tensors a Llama stage holding only ``layer`` reads (embeddings / head if it has them)."""
    names = {f"model.layers.{layer}.{n}" for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
    names |= {"model.embed_tokens.weight"} if has_embed else set()
    return names | ({"model.norm.weight", "lm_head.weight"} if has_head else set())


def wait_healthy(proc: subprocess.Popen, health_url: str, log: Path, seconds: float) -> None:
    """Wait until a server started as ``proc`` answers ``health_url`` with 200 (fails with the end of its
    log if it exits or is not up within ``seconds``)."""
    import time

    try:  # the HTTP client the openai package (a declared test dependency) brings: httpx, or its fork httpx2
        import httpx
    except ImportError:
        import httpx2 as httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(health_url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("server did not come up:\n" + log.read_text()[-3000:])
