"""One-command throughput benchmark: HF generate, CTranslate2 and this runner (P = 1, 2) on one workload.

    python bench/throughput.py                 # ~100M-parameter Llama, 256 mixed requests
    python bench/throughput.py --quick         # smaller model and workload, < 1 min on 2 cores
    python bench/throughput.py --systems hf,runner1 --json /tmp/t.json

Everything is built locally and deterministically (no hub): a random float32 Llama saved with
``save_pretrained`` plus the project's local BPE tokenizer (pipeline/loading/default_model.py), cached under
``$DIST_INFER_CACHE/bench`` and reused across runs, and a mixed request file (fixed seed) of
greedy generation requests (some with stop strings) and echo scoring requests
(``echo: true, max_tokens: 0, logprobs: 1``). The workload is split by kind into ``gen.jsonl`` and
``score.jsonl`` (input order kept); every system answers both files, each in its own process:

- ``hf``: ``AutoModelForCausalLM.generate`` in batches of 32 in file order (left padding,
  ``max_new_tokens`` = largest in the batch, EOS/max_tokens/stop strings applied afterwards) and a
  plain forward + ``log_softmax`` (right padding) for scoring;
- ``ct2``: CTranslate2 converted from the same folder (float32, ``intra_threads`` = cores,
  ``max_batch_size`` 32), ``generate_batch`` per 32 requests and ``score_batch``;
- ``runner1`` / ``runner2``: ``dist_inference_runner.py`` with P = 1 (``--num-threads`` = cores) and
  ``torchrun`` P = 2 (cores / 2 threads each), both files in one invocation.

Timing: phase seconds exclude process start and model loading. HF and CTranslate2 time their
generation and scoring loops in-process; the runner's figures are its own per-file summary line
("N prompt + M generated tokens in Xs"), one per file. Generated tokens are counted alike for every
system: tokens sampled up to and including EOS or the token that completes a stop string, at most
max_tokens (padding and tokens generated past a request's end are waste, not counted).
Peak memory: per process VmHWM polled from /proc, and ``os.wait4``'s ru_maxrss (the largest process
of the tree). FLOP/s = 2 * (matmul parameters, input embedding excluded) * tokens processed / time,
against a float32 matmul peak measured in the same run with the same core count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "dist_inference_runner.py"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SYSTEMS = ("hf", "ct2", "runner1", "runner2", "hf-bf16", "runner1-bf16", "hf-int8", "ct2-int8", "runner1-int8")
LABELS = {"hf": "HF generate", "ct2": "CTranslate2", "runner1": "runner P=1", "runner2": "runner P=2",
          "hf-bf16": "HF bf16", "runner1-bf16": "runner P=1 bf16",
          "hf-int8": "HF int8 (fake)", "ct2-int8": "CT2 int8", "runner1-int8": "runner P=1 int8"}
# (lower-precision system, its float32 counterpart): fidelity on the echo scoring requests
PRECISION_PAIRS = (("runner1-bf16", "runner1"), ("hf-bf16", "hf"), ("runner1-int8", "runner1"), ("hf-int8", "hf"))
PRECISIONS = ("-bf16", "-int8")


def base_of(system: str) -> str:
    """"runner1-int8" -> "runner1": the engine and layout without the precision suffix."""
    for suffix in PRECISIONS:
        system = system.removesuffix(suffix)
    return system
BATCH = 32
AGREE_THRESHOLD = 0.95
LOGPROB_TOL = 1e-3  # max |difference| of a prompt token's logprob for two scorings to agree
# "\n" is what eval suites send (a random model rarely emits it); the others end most outputs early
STOP_SETS = [["\n"], [" "], ["o", "i"], ["e", "1"], [" c", "s"]]

# model config, workload shape
PROFILES = {
    "full": dict(hidden=768, layers=12, heads=12, intermediate=2048, requests=256, max_prompt=512, max_tokens=128),
    "quick": dict(hidden=256, layers=4, heads=8, intermediate=688, requests=48, max_prompt=256, max_tokens=32),
    "tiny": dict(hidden=64, layers=2, heads=4, intermediate=128, requests=12, max_prompt=64, max_tokens=16),
}
SCORE_SHARE, STOP_SHARE, MIN_PROMPT = 0.2, 0.3, 8


# ------------------------------------------------------------------------------------------------
# model and workload (deterministic, cached)
# ------------------------------------------------------------------------------------------------
def build_model(cache: Path, prof: dict) -> Path:
    """The random Llama for ``prof``, built once into ``cache`` (build in a temp sibling, rename)."""
    from pipeline.loading.default_model import build_tokenizer

    vocab = len(build_tokenizer())  # the name says which tokenizer the cached model was built with
    name = f"bench-llama-h{prof['hidden']}-l{prof['layers']}-i{prof['intermediate']}-vocab{vocab}"
    target = cache / name
    if (target / ".complete").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache))
    try:
        tok = build_tokenizer()
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=prof["hidden"], intermediate_size=prof["intermediate"],
                          num_hidden_layers=prof["layers"], num_attention_heads=prof["heads"],
                          num_key_value_heads=prof["heads"], max_position_embeddings=2048, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, dtype="float32")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            model = LlamaForCausalLM(cfg).to(torch.float32).eval()
        model.generation_config.do_sample = False
        hf_logging.disable_progress_bar()
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(name + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another run won the race
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def matmul_params(model_dir: Path) -> int:
    """Parameters used in matmuls: all tensors but the input embedding table."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if not k.endswith("embed_tokens.weight"):
                    total += math.prod(st.get_slice(k).get_shape())
    return total


def build_workload(model_dir: Path, prof: dict, out: Path, seed: int = 0) -> dict:
    """Write workload.jsonl (mixed) + gen.jsonl + score.jsonl; return the per-request plan."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = (REPO / "examples" / "corpus.txt").read_text(encoding="utf-8")
    corpus = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids  # no max-length warning
    rng = random.Random(seed)
    n = prof["requests"]
    n_score = max(1, round(SCORE_SHARE * n))
    score_idx = set(rng.sample(range(n), n_score))
    gen_idx = [i for i in range(n) if i not in score_idx]
    stop_idx = set(rng.sample(gen_idx, max(1, round(STOP_SHARE * len(gen_idx)))))
    plan = []
    for i in range(n):
        # log-uniform prompt length: many short prompts, a few long ones (counts include BOS)
        want = int(round(math.exp(rng.uniform(math.log(MIN_PROMPT), math.log(prof["max_prompt"])))))
        while True:
            off = rng.randrange(0, len(corpus) - want)
            text = tok.decode(corpus[off: off + want - 1])
            ids = tok(text)["input_ids"]
            if "\ufffd" not in text and MIN_PROMPT <= len(ids) <= prof["max_prompt"]:
                break
        if i in score_idx:
            body = {"prompt": text, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
        else:
            body = {"prompt": text, "max_tokens": rng.randint(1, prof["max_tokens"]), "temperature": 0}
            if i in stop_idx:
                body["stop"] = rng.choice(STOP_SETS)
        plan.append({"i": i, "kind": "score" if i in score_idx else "gen", "prompt_tokens": len(ids), "body": body})
    out.mkdir(parents=True, exist_ok=True)
    for name, kinds in (("workload.jsonl", ("gen", "score")), ("gen.jsonl", ("gen",)), ("score.jsonl", ("score",))):
        with open(out / name, "w", encoding="utf-8") as f:
            for p in plan:
                if p["kind"] in kinds:
                    f.write(json.dumps(p["body"], ensure_ascii=False) + "\n")
    return {"plan": plan, "dir": str(out)}


# ------------------------------------------------------------------------------------------------
# shared post-processing (what a user of HF / CTranslate2 has to write around generate)
# ------------------------------------------------------------------------------------------------
def finish_generation(tok, ids: list[int], max_tokens: int, stops: list[str], eos: int) -> dict:
    """Cut one generated sequence like the runner does: EOS, stop strings (earliest, found as tokens
    arrive), max_tokens. ``generated`` counts the tokens computed (EOS / completing token included)."""
    ids = list(ids)
    if eos in ids[:max_tokens]:
        k = ids.index(eos)
        ids, generated, reason = ids[:k], k + 1, "stop"
    else:
        ids = ids[:max_tokens]
        generated, reason = len(ids), "length"
    if stops:
        prev = ""
        for k in range(len(ids)):
            text = tok.decode(ids[: k + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if text.endswith("\ufffd"):
                continue  # an incomplete character: no text yet
            hits = [j for s in stops if (j := text.find(s, max(0, len(prev) - len(s) + 1))) >= 0]
            if hits:
                return {"text": text[: min(hits)], "generated": k + 1, "finish": "stop"}
            prev = text
    text = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return {"text": text, "generated": generated, "finish": reason}


def read_requests(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def batches(items: list, size: int = BATCH):
    for a in range(0, len(items), size):
        yield items[a: a + size]


# ------------------------------------------------------------------------------------------------
# workers: one process per system (invoked as  throughput.py --worker hf|ct2 ...)
# ------------------------------------------------------------------------------------------------
def fake_quantize_layers(model) -> None:
    """HF with int8 weights and activations, computed in float: each decoder-layer linear's weight
    replaced by what its int8 per-output-channel quantization stands for, and its input by what its
    per-token int8 quantization stands for (the runner's own quantizers, pipeline.models.kernels.int8)."""
    import torch

    from pipeline.models.kernels.int8 import eager_quantize_tokens, fake_quantize

    def tokens(_mod, args):
        x = args[0]
        q, scale = eager_quantize_tokens(x.reshape(-1, x.shape[-1]))
        return (q.float().mul_(scale).to(x.dtype).reshape(x.shape), *args[1:])

    with torch.no_grad():
        for mod in model.model.layers.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(fake_quantize(mod.weight))
                mod.register_forward_pre_hook(tokens)


def worker_hf(model_dir: Path, wdir: Path, threads: int, precision: str = "") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # bf16: the whole model cast, as HF runs it
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    if precision == "int8":
        fake_quantize_layers(model)
    load = time.perf_counter() - t0
    eos, pad = tok.eos_token_id, tok.pad_token_id
    gen_reqs, score_reqs = read_requests(wdir / "gen.jsonl"), read_requests(wdir / "score.jsonl")
    gen_out, score_out = [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches(gen_reqs):
            tok.padding_side = "left"
            enc = tok([r["prompt"] for r in batch], padding=True, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=max(r["max_tokens"] for r in batch), do_sample=False,
                                 pad_token_id=pad, eos_token_id=eos)
            width = enc["input_ids"].shape[1]
            for r, row in zip(batch, out[:, width:].tolist()):
                gen_out.append(finish_generation(tok, row, r["max_tokens"], r.get("stop") or [], eos))
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches(score_reqs):
            tok.padding_side = "right"  # a plain forward numbers positions from 0: pad on the right
            enc = tok([r["prompt"] for r in batch], padding=True, return_tensors="pt")
            logp = torch.log_softmax(model(**enc).logits.float(), -1)  # (B, T, V)
            nxt = enc["input_ids"][:, 1:]
            lp = logp[:, :-1].gather(-1, nxt[..., None])[..., 0]  # (B, T-1): position p predicts p+1
            top1 = logp[:, :-1].argmax(-1)  # (B, T-1): the model's own first choice at each position
            for i, n in enumerate(enc["attention_mask"].sum(1).tolist()):
                score_out.append({"logprobs": lp[i, : n - 1].tolist(), "tokens": n, "top1": top1[i, : n - 1].tolist()})
    score_s = time.perf_counter() - t0
    return {"load_s": load, "gen_s": gen_s, "score_s": score_s, "gen": gen_out, "score": score_out}


def ct2_dir(model_dir: Path, quantization: str = "float32") -> Path:
    """Convert once (cached beside the model folder); CTranslate2 errors propagate."""
    import ctranslate2.converters

    target = model_dir.with_name(model_dir.name + f"-ct2-{quantization}")
    if (target / ".complete").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=model_dir.parent))
    try:
        ctranslate2.converters.TransformersConverter(str(model_dir)).convert(str(tmp), quantization=quantization, force=True)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def worker_ct2(model_dir: Path, wdir: Path, threads: int, precision: str = "") -> dict:
    import ctranslate2
    from transformers import AutoTokenizer

    int8 = precision == "int8"
    compute = "int8_float32" if int8 else "float32"  # int8 weights and GEMMs, float32 elsewhere
    t0 = time.perf_counter()
    path = ct2_dir(model_dir, "int8_float32" if int8 else "float32")
    convert = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    gen = ctranslate2.Generator(str(path), device="cpu", compute_type=compute, intra_threads=threads, inter_threads=1)
    load = time.perf_counter() - t0
    eos = tok.eos_token_id
    gen_reqs, score_reqs = read_requests(wdir / "gen.jsonl"), read_requests(wdir / "score.jsonl")
    gen_out, score_out = [], []
    t0 = time.perf_counter()
    for batch in batches(gen_reqs):
        toks = [tok.convert_ids_to_tokens(tok(r["prompt"])["input_ids"]) for r in batch]
        res = gen.generate_batch(toks, max_batch_size=BATCH, max_length=max(r["max_tokens"] for r in batch),
                                 beam_size=1, sampling_topk=1, include_prompt_in_result=False, return_scores=True)
        for r, x in zip(batch, res):
            ids = list(x.sequences_ids[0])
            if len(ids) < max(r["max_tokens"] for r in batch):
                ids.append(eos)  # ended by the end token, which CTranslate2 leaves out
            gen_out.append(finish_generation(tok, ids, r["max_tokens"], r.get("stop") or [], eos))
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for batch in batches(score_reqs):
        toks = [tok.convert_ids_to_tokens(tok(r["prompt"])["input_ids"]) for r in batch]
        for t, x in zip(toks, gen.score_batch(toks, max_batch_size=BATCH)):
            score_out.append({"logprobs": list(x.log_probs), "tokens": len(t)})
    score_s = time.perf_counter() - t0
    return {"load_s": load, "convert_s": convert, "gen_s": gen_s, "score_s": score_s, "gen": gen_out, "score": score_out}


def read_runner_output(outdir: Path) -> dict:
    gen_out, score_out, errors = [], [], []
    for name, dest in (("gen", gen_out), ("score", score_out)):
        path = outdir / f"output_{name}.jsonl"
        for k, line in enumerate(read_requests(path) if path.exists() else []):
            if "error" in line or not line.get("result"):
                errors.append({"file": f"{name}.jsonl", "line": k, "error": line.get("error"), "request": line.get("request")})
                dest.append(None)
                continue
            c = line["result"]["choices"][0]
            if name == "gen":
                dest.append({"text": c["text"], "generated": line["result"]["usage"]["completion_tokens"],
                             "finish": c["finish_reason"]})
            else:
                lps = (c.get("logprobs") or {}).get("token_logprobs") or []
                tops = (c.get("logprobs") or {}).get("top_logprobs") or []
                top1 = [max(t, key=t.get) if t else None for t in tops[1:]]  # logprobs: 1 -> the first choice
                dest.append({"logprobs": lps[1:], "tokens": len(lps), "top1": top1})
    return {"gen": gen_out, "score": score_out, "errors": errors}


# ------------------------------------------------------------------------------------------------
# measuring subprocesses
# ------------------------------------------------------------------------------------------------
class ProcWatch(threading.Thread):
    """Poll /proc for the peak resident memory (VmHWM) of a process and all its descendants."""

    def __init__(self, root: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_kb: dict[int, int] = {}
        self.label: dict[int, str] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        parent = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = Path(f"/proc/{d}/stat").read_text()
                    parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        tree, grew = {self.root}, True
        while grew:
            new = {p for p, pp in parent.items() if pp in tree} - tree
            grew, tree = bool(new), tree | new
        for pid in tree:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1))
            except (OSError, AttributeError):
                continue
            self.peak_kb[pid] = max(hwm, self.peak_kb.get(pid, 0))
            if pid not in self.label:
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
                except OSError:
                    rank = None
                self.label[pid] = f"rank{rank}" if rank is not None else ("main" if pid == self.root else f"pid{pid}")


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used since boot (/proc/stat, idle excluded)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def run_measured(cmd: list[str], env: dict, log_path: Path, timeout: float) -> dict:
    """Run ``cmd`` (stderr+stdout to log_path): wall time, exit code, per-process and tree peak RSS,
    CPU seconds of the tree, and how many cores other processes of the machine kept busy meanwhile."""
    t0, busy0 = time.perf_counter(), machine_busy_seconds()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), start_new_session=True)
        watch = ProcWatch(p.pid)
        watch.start()
        deadline, status, usage = t0 + timeout, None, None
        while status is None:
            pid, st, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                status, usage = st, ru
            elif time.perf_counter() > deadline:
                os.killpg(p.pid, 9)
                _, status, usage = os.wait4(p.pid, 0)
                status = -9
            else:
                time.sleep(0.05)
        p.returncode = 0  # reaped by wait4: keep Popen from waiting again
        watch.stopped.set()
        watch.join()
    wall, busy = time.perf_counter() - t0, machine_busy_seconds() - busy0
    rc = os.waitstatus_to_exitcode(status) if status != -9 else -9
    ranks = any(v.startswith("rank") for v in watch.label.values())
    per = {}
    for pid, kb in sorted(watch.peak_kb.items()):
        if kb >= 20 * 1024:  # short-lived helpers (uname, ldconfig) are not worth a column
            label = "launcher" if pid == p.pid and ranks else watch.label[pid]
            per[label] = round(kb / 1024, 1)
    cpu = usage.ru_utime + usage.ru_stime if usage else 0.0
    return {"rc": rc, "wall_s": wall, "timed_out": status == -9, "cpu_s": cpu,
            "other_load_cores": max(0.0, (busy - cpu) / wall) if wall else 0.0,
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1) if usage else None, "peak_rss_mb_per_process": per}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_system(name: str, model_dir: Path, wdir: Path, cores: int, timeout: float, runner_args: list[str],
               label: str | None = None) -> dict:
    """Run one system on ``wdir``'s gen.jsonl and score.jsonl; outputs go to ``wdir / (label or name)``."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    sysdir = wdir / (label or name)
    shutil.rmtree(sysdir, ignore_errors=True)
    sysdir.mkdir(parents=True)
    log = sysdir / "log.txt"
    base = base_of(name)
    if base in ("hf", "ct2"):
        env["OMP_NUM_THREADS"] = str(cores)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model-dir", str(model_dir),
               "--work-dir", str(wdir), "--cores", str(cores), "--worker-out", str(sysdir / "result.json")]
    else:
        p = int(base.removeprefix("runner") or 1)  # runner1, runner2, runner3: the pipeline size
        threads = max(1, cores // p)
        int8 = ["--quantize", "int8", "--kv-cache-dtype", "int8"]  # int8 weights, activations and KV cache
        runner_args = [*runner_args, *(int8 if name.endswith("-int8") else []),
                       *(["--dtype", "bfloat16"] if name.endswith("-bf16") else [])]
        env["OMP_NUM_THREADS"] = str(threads)
        args = [str(RUNNER), "--model-name", str(model_dir), "--infer-data", str(wdir / "gen.jsonl"), str(wdir / "score.jsonl"),
                "--output-path", str(sysdir), "--num-threads", str(threads), "--no-progress", "--overwrite", *runner_args]
        cmd = [sys.executable, *args] if p == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(p), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), *args]
    m = run_measured(cmd, env, log, timeout)
    m["command"] = " ".join(cmd)
    m["log"] = str(log)
    text = log.read_text(errors="replace")
    if m["rc"] != 0:
        m["error"] = f"exit code {m['rc']}" + (" (timed out)" if m["timed_out"] else "")
        m["log_tail"] = text[-3000:]
        return m
    if base in ("hf", "ct2"):
        m.update(json.loads((sysdir / "result.json").read_text()))
        m["timing"] = "in-process perf_counter around the generation / scoring loops (load excluded)"
        return m
    out = read_runner_output(sysdir)
    m.update(out)
    summ = {}
    for line in text.splitlines():
        g = re.search(r"(\S+\.jsonl): (\d+) requests, .*?; (\d+) prompt \+ (\d+) generated tokens in ([\d.]+)s", line)
        if g:
            summ[Path(g.group(1)).stem] = {"requests": int(g.group(2)), "prompt_tokens": int(g.group(3)),
                                           "generated_tokens": int(g.group(4)), "seconds": float(g.group(5))}
    m["summary_lines"] = summ
    if "gen" not in summ or "score" not in summ:
        m["error"] = "no per-file summary line on stderr"
        m["log_tail"] = text[-3000:]
        return m
    m["gen_s"], m["score_s"] = summ["gen"]["seconds"], summ["score"]["seconds"]
    m["load_s"] = m["wall_s"] - m["gen_s"] - m["score_s"]
    m["timing"] = "the runner's per-file summary line on stderr (excludes process start and model load)"
    busy = {}
    for kind in ("gen", "score"):
        sj = sysdir / f"output_{kind}.jsonl.summary.json"
        if sj.exists():
            try:
                busy[kind] = json.loads(sj.read_text()).get("stage_busy")
            except ValueError:
                pass
    m["stage_busy"] = busy or None
    if out["errors"]:
        m["request_errors"] = out["errors"][:5]
    return m


def matmul_peak(threads: int, n: int = 2048, reps: int = 5) -> float:
    """Best float32 FLOP/s of an n x n matmul with ``threads`` threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(2):
            a @ b
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------------
# figures, agreement, report
# ------------------------------------------------------------------------------------------------
def figures(m: dict, plan: list[dict], params: int, peak: float) -> dict:
    gen_prompt = sum(p["prompt_tokens"] for p in plan if p["kind"] == "gen")
    score_prompt = sum(p["prompt_tokens"] for p in plan if p["kind"] == "score")
    generated = sum(g["generated"] for g in m["gen"] if g)
    busy_s = m["gen_s"] + m["score_s"]
    # a phase timed as 0.0 s (the runner prints tenths) has no meaningful rate: None, printed n/a
    flops = 2 * params * (gen_prompt + generated + score_prompt) / busy_s if busy_s else None
    return {"generated_tokens": generated, "scored_prompt_tokens": score_prompt,
            "gen_tokens_per_s": generated / m["gen_s"] if m["gen_s"] else None,
            "scored_tokens_per_s": score_prompt / m["score_s"] if m["score_s"] else None,
            "gen_seconds": m["gen_s"], "score_seconds": m["score_s"], "wall_seconds": m["wall_s"],
            "startup_and_load_seconds": m["wall_s"] - busy_s, "cpu_seconds": m["cpu_s"],
            "other_load_cores": m["other_load_cores"], "peak_rss_mb": m["peak_rss_mb"],
            "peak_rss_mb_per_process": m["peak_rss_mb_per_process"], "flops_per_s": flops,
            "flops_fraction_of_peak": flops / peak if peak and flops else None, "stage_busy": m.get("stage_busy"),
            "timing": m["timing"], "command": m["command"],
            **({"ct2_convert_seconds": m["convert_s"]} if "convert_s" in m else {})}


def compare(a: dict, b: dict, plan: list[dict]) -> dict:
    gen_plan = [p for p in plan if p["kind"] == "gen"]
    score_plan = [p for p in plan if p["kind"] == "score"]
    total, agree, bad = 0, 0, []
    for p, x, y in zip(gen_plan, a["gen"], b["gen"]):
        total += 1
        if x and y and x["text"] == y["text"]:
            agree += 1
        elif len(bad) < 5:
            ta, tb = (None if x is None else x["text"]), (None if y is None else y["text"])
            at = next((k for k, (u, v) in enumerate(zip(ta, tb)) if u != v), min(len(ta), len(tb))) if ta and tb else 0
            bad.append({"request": p["i"], "kind": "gen", "prompt_tokens": p["prompt_tokens"], "stop": p["body"].get("stop"),
                        "first_diff_char": at, "a": None if ta is None else ta[max(0, at - 20): at + 40],
                        "b": None if tb is None else tb[max(0, at - 20): at + 40]})
    for p, x, y in zip(score_plan, a["score"], b["score"]):
        total += 1
        ok = bool(x and y and len(x["logprobs"]) == len(y["logprobs"]))
        diff = max((abs(u - v) for u, v in zip(x["logprobs"], y["logprobs"])), default=0.0) if ok else None
        if ok and diff <= LOGPROB_TOL:
            agree += 1
        elif len(bad) < 5:
            bad.append({"request": p["i"], "kind": "score", "prompt_tokens": p["prompt_tokens"], "max_logprob_diff": diff,
                        "lengths": [None if x is None else len(x["logprobs"]), None if y is None else len(y["logprobs"])]})
    pct = agree / total if total else 0.0
    return {"requests": total, "agree": agree, "disagree": total - agree, "fraction": pct,
            "agreeing": pct >= AGREE_THRESHOLD, "first_disagreements": bad}


def fidelity(quant: dict, full: dict) -> dict:
    """A bf16 or int8 system against its float32 counterpart on the echo scoring requests: the share of
    prompt positions where both put the same token first (top-1 agreement), and the mean and largest
    |difference| of the prompt tokens' logprobs."""
    same = positions = 0
    diffs = []
    for x, y in zip(quant["score"], full["score"]):
        if not x or not y or len(x["logprobs"]) != len(y["logprobs"]):
            continue
        diffs += [abs(u - v) for u, v in zip(x["logprobs"], y["logprobs"])]
        pairs = [(u, v) for u, v in zip(x.get("top1") or [], y.get("top1") or []) if u is not None and v is not None]
        same += sum(u == v for u, v in pairs)
        positions += len(pairs)
    return {"positions": positions, "top1_agreement": same / positions if positions else None,
            "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None,
            "max_abs_logprob_diff": max(diffs, default=None)}


def target(name: str, value: float | None, need: float, unit: str = "x") -> dict:
    status = "n/a" if value is None else ("PASS" if value >= need else "FAIL")
    return {"target": name, "need": need, "value": value, "status": status, "unit": unit}


def ratio(res: dict, a: str, b: str, key: str) -> float | None:
    fa, fb = res.get(a), res.get(b)
    if not fa or not fb or not fa[key] or not fb[key]:
        return None
    return fa[key] / fb[key]


def _num(v: float | None, width: int, scale: float = 1.0) -> str:
    return f"{'n/a':>{width}}" if v is None else f"{v * scale:>{width}.1f}"


def report(out: dict) -> str:
    lines = []
    mdl, wl = out["model"], out["workload"]
    lines.append(f"Model: random Llama, {mdl['params'] / 1e6:.1f}M params ({mdl['matmul_params'] / 1e6:.1f}M in matmuls), "
                 f"hidden {mdl['hidden']}, {mdl['layers']} layers, {mdl['heads']} heads, vocab {mdl['vocab']}, float32; "
                 f"{out['cores']} cores")
    lines.append(f"Workload: {wl['requests']} requests: {wl['gen_requests']} greedy generation ({wl['gen_prompt_tokens']} prompt tokens, "
                 f"max_tokens 1..{wl['max_tokens']}, {wl['stop_requests']} with stop strings), {wl['score_requests']} echo scoring "
                 f"({wl['scored_prompt_tokens']} prompt tokens); prompts {wl['min_prompt']}..{wl['max_prompt']} tokens")
    lines.append(f"Matmul peak (float32 2048^3, best of the start and the end of the run): {out['matmul_peak_flops'][str(out['cores'])] / 1e9:.1f} GFLOP/s with {out['cores']} threads, "
                 f"{out['matmul_peak_flops']['1'] / 1e9:.1f} GFLOP/s with 1")
    lines.append("")
    hdr = (f"{'system':<16}{'gen tok/s':>10}{'score tok/s':>12}{'gen s':>8}{'score s':>8}{'wall s':>8}{'load s':>8}"
           f"{'GFLOP/s':>9}{'%peak':>7}{'other':>7}  {'peak RSS MB (per process)':<34} stage busy")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for s in SYSTEMS:
        f = out["systems"].get(s)
        if f is None:
            if s in out["failures"]:
                lines.append(f"{LABELS[s]:<16} FAILED: {out['failures'][s]['error']}")
            continue
        per = ", ".join(f"{k} {v:.0f}" for k, v in f["peak_rss_mb_per_process"].items()) or f"{f['peak_rss_mb']:.0f}"
        busy = f["stage_busy"]
        busy = "n/a" if not busy else json.dumps(busy)
        if base_of(s) in ("hf", "ct2"):
            busy = "-"
        lines.append(f"{LABELS[s]:<16}{_num(f['gen_tokens_per_s'], 10)}{_num(f['scored_tokens_per_s'], 12)}"
                     f"{f['gen_seconds']:>8.1f}{f['score_seconds']:>8.1f}{f['wall_seconds']:>8.1f}"
                     f"{f['startup_and_load_seconds']:>8.1f}{_num(f['flops_per_s'], 9, 1e-9)}"
                     f"{_num(f['flops_fraction_of_peak'], 6, 100)}%{f['other_load_cores']:>7.2f}  {per:<34} {busy}")
    busy_others = [LABELS[s] for s, f in out["systems"].items() if f["other_load_cores"] > 0.25]
    if busy_others:
        lines.append(f"WARNING: other processes competed for the cores during {', '.join(busy_others)}: "
                     "those figures are low; rerun on a quiet machine")
    lines.append("")
    lines.append("gen tok/s: generated tokens / generation-phase seconds; score tok/s: scored prompt tokens / scoring-phase "
                 "seconds; load s: wall - both phases (process start, imports, model load)")
    lines.append("other: cores kept busy by other processes of the machine during that system's run (0 = quiet machine); "
                 "%peak: GFLOP/s / the matmul peak")
    lines.append("Timing: HF and CTranslate2 time their loops in-process; the runner's phases are its own per-file summary "
                 "lines on stderr. GFLOP/s counts useful tokens only (2 x matmul params x tokens).")
    convert = out["systems"].get("ct2", {}).get("ct2_convert_seconds")
    if convert is not None:
        lines.append("CTranslate2 model: " + (f"converted in {convert:.1f}s (not timed above; cached for later runs)"
                                             if convert >= 0.5 else "converted by an earlier run (cached)"))
    lines.append("")
    lines.append("Ratios: " + ", ".join(f"{k} {v:.2f}x" if v is not None else f"{k} n/a" for k, v in out["ratios"].items()))
    lines.append("")
    lines.append(f"Greedy agreement (text after stop/EOS/max_tokens; scoring: every prompt logprob within {LOGPROB_TOL}; "
                 f">= {AGREE_THRESHOLD:.0%} counts as agreeing, since float differences between engines on a random "
                 "model can flip near-ties):")
    for pair, a in out["agreement"].items():
        lines.append(f"  {pair}: {a['agree']}/{a['requests']} = {100 * a['fraction']:.1f}% "
                     f"{'AGREE' if a['agreeing'] else 'DISAGREE'}")
        for d in a["first_disagreements"][:3]:
            lines.append(f"    request {d['request']} ({d['kind']}, {d['prompt_tokens']} prompt tokens): "
                         + (f"from char {d['first_diff_char']}: ...{d['a']!r} vs ...{d['b']!r}" if d["kind"] == "gen" else f"max logprob diff {d['max_logprob_diff']}, lengths {d['lengths']}"))
    if out["workload"].get("stop_hits") is not None:
        lines.append(f"  stop strings ended {out['workload']['stop_hits']} of {wl['stop_requests']} stop requests early (reference outputs)")
    if out.get("fidelity"):
        lines.append("")
        lines.append("bf16 and int8 fidelity against float32 on the echo scoring requests (top-1: the same first-choice token at a "
                     "prompt position; |logprob diff|: the prompt tokens' logprobs):")
        for pair, f in out["fidelity"].items():
            if f["top1_agreement"] is None:
                lines.append(f"  {pair}: n/a")
                continue
            lines.append(f"  {pair}: top-1 agreement {f['top1_agreement']:.4f} over {f['positions']} positions, "
                         f"mean |logprob diff| {f['mean_abs_logprob_diff']:.5f}, max {f['max_abs_logprob_diff']:.4f}")
    kernels = out["systems"].get("runner1-int8", {}).get("int8_kernels")
    if kernels:
        lines.append(f"  runner int8 kernels chosen at load (per in x out shape): {json.dumps(kernels)}")
    lines.append("")
    lines.append("Targets:")
    for t in out["targets"]:
        unit = t.get("unit", "x")
        fmt = {"x": lambda x: f"{x:.2f}x", "%": lambda x: f"{100 * x:.0f}%"}.get(unit, lambda x: f"{x:+.4f}")
        v = "n/a" if t["value"] is None else fmt(t["value"])
        need = fmt(t["need"]) if unit == "%" else f"{t['need']}{'x' if unit == 'x' else ''}"
        lines.append(f"  {t['status']:<5} {t['target']}: {v} (need >= {need})")
    for s, f in out["failures"].items():
        lines.append("")
        lines.append(f"{LABELS.get(s, s)} failed: {f['error']}  (log: {f.get('log')})")
        if f.get("log_tail"):
            lines.append("  " + "\n  ".join(f["log_tail"].strip().splitlines()[-15:]))
        for e in f.get("request_errors", []):
            lines.append(f"  request error: {json.dumps(e)[:300]}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller model and workload (< 1 minute on 2 cores)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (hidden 64, 2 layers) and 12 requests (smoke test)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)} (default: all)")
    ap.add_argument("--cores", type=int, default=2, help="cores every system gets (threads; P=2 gets cores/2 per process)")
    ap.add_argument("--json", default=None,
                    help="where to write all figures (default: bench/results/throughput.json for the full run, "
                         "throughput-<profile>.json for --quick / --tiny, so a quick run keeps the full run's figures)")
    ap.add_argument("--work-dir", default=None, help="workload and outputs (default: bench/results/<profile>)")
    ap.add_argument("--cache-dir", default=None, help="model cache (default: $DIST_INFER_CACHE/bench)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed per system")
    ap.add_argument("--runner-args", default="", help="extra flags for dist_inference_runner.py, e.g. '--budget 16384'")
    ap.add_argument("--report", metavar="JSON", help="print the table of a saved --json file again and exit")
    ap.add_argument("--worker", choices=("hf", "ct2", "hf-bf16", "hf-int8", "ct2-int8"), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.systems_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems_list if s not in SYSTEMS]
    if unknown:
        ap.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    args.profile = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.json is None:
        name = "throughput.json" if args.profile == "full" else f"throughput-{args.profile}.json"
        args.json = str(REPO / "bench" / "results" / name)
    return args


def run_systems(systems: list[str], model_dir: Path, wdir: Path, args) -> tuple[dict, dict]:
    """Each system in its own process: ({system: measurements}, {system: failure})."""
    if "ct2" in systems or "ct2-int8" in systems:
        try:
            import ctranslate2  # noqa: F401
        except ImportError as e:
            print(f"[bench] CTranslate2 skipped: cannot import ctranslate2 ({e}); pip install -r bench/requirements.txt",
                  file=sys.stderr)
            systems = [s for s in systems if s not in ("ct2", "ct2-int8")]
    results, failures = {}, {}
    for s in systems:
        print(f"[bench] running {LABELS[s]} ...", file=sys.stderr, flush=True)
        m = run_system(s, model_dir, wdir, args.cores, args.timeout, args.runner_args.split())
        if m.get("error"):
            failures[s] = m
            print(f"[bench] {LABELS[s]} failed: {m['error']} (log {m['log']})", file=sys.stderr)
            continue
        if m.get("request_errors"):
            failures[s] = {"error": f"{len(m['errors'])} requests answered with an error", "log": m["log"],
                           "request_errors": m["request_errors"]}
        results[s] = m
        print(f"[bench] {LABELS[s]}: {m['gen_s']:.1f}s generation, {m['score_s']:.1f}s scoring, wall {m['wall_s']:.1f}s",
              file=sys.stderr, flush=True)
    return results, failures


def all_ratios(figs: dict) -> dict:
    pairs = [("runner P=1 / HF", "runner1", "hf"), ("runner P=1 / CTranslate2", "runner1", "ct2"),
             ("runner P=2 / HF", "runner2", "hf"), ("runner P=2 / CTranslate2", "runner2", "ct2"),
             ("P=2 / P=1", "runner2", "runner1")]
    out = {f"{name} (gen tok/s)": ratio(figs, a, b, "gen_tokens_per_s") for name, a, b in pairs}
    out.update({f"{name} (score tok/s)": ratio(figs, a, b, "scored_tokens_per_s") for name, a, b in
                (pairs[0], pairs[1], pairs[4])})
    out.update({f"{name} (gen tok/s)": ratio(figs, a, b, "gen_tokens_per_s") for name, a, b in
                [("CTranslate2 / HF", "ct2", "hf"), ("runner bf16 / runner float32", "runner1-bf16", "runner1"),
                 ("runner bf16 / HF bf16", "runner1-bf16", "hf-bf16"),
                 ("runner int8 / runner float32", "runner1-int8", "runner1"),
                 ("runner int8 / CT2 int8", "runner1-int8", "ct2-int8"), ("runner int8 / HF", "runner1-int8", "hf"),
                 ("CT2 int8 / CTranslate2", "ct2-int8", "ct2")]})
    return out


def all_targets(ratios: dict, figs: dict, fid: dict, systems: list[str]) -> list[dict]:
    busy = ((figs.get("runner2") or {}).get("stage_busy") or {}).get("gen")
    peak = (figs.get("runner1") or {}).get("flops_fraction_of_peak")
    targets = [
        target("runner P=1 generated tok/s >= 2.0x HF", ratios["runner P=1 / HF (gen tok/s)"], 2.0),
        target("runner P=1 generated tok/s >= 1.2x CTranslate2", ratios["runner P=1 / CTranslate2 (gen tok/s)"], 1.2),
        target("runner P=2 generated tok/s >= 0.9x P=1", ratios["P=2 / P=1 (gen tok/s)"], 0.9),
        target("runner P=2 every stage busy >= 85% (generation)", min(busy) if busy else None, 0.85, unit="%"),
        target("runner P=1 scored prompt tok/s >= 1.5x HF", ratios["runner P=1 / HF (score tok/s)"], 1.5),
        target("runner P=1 scored prompt tok/s >= 1.2x CTranslate2", ratios["runner P=1 / CTranslate2 (score tok/s)"], 1.2),
        target("runner P=1 FLOP/s >= 35% of the matmul peak", peak, 0.35, unit="%"),
    ]
    top1 = lambda q, f: fid.get(f"{LABELS[q]} vs {LABELS[f]}", {}).get("top1_agreement")
    if any(s.endswith("-bf16") for s in systems):
        ours, plain = top1("runner1-bf16", "runner1"), top1("hf-bf16", "hf")
        targets += [
            target("runner bf16 generated tok/s >= 2.0x runner float32", ratios["runner bf16 / runner float32 (gen tok/s)"], 2.0),
            target("runner bf16 top-1 agreement minus its plain reference's (HF bf16)",
                   None if ours is None or plain is None else ours - plain, -0.02, unit=""),
        ]
    if any(s.endswith("-int8") for s in systems):
        ours, plain = top1("runner1-int8", "runner1"), top1("hf-int8", "hf")
        targets += [
            target("runner int8 generated tok/s >= 2.5x runner float32", ratios["runner int8 / runner float32 (gen tok/s)"], 2.5),
            target("runner int8 generated tok/s >= 1.2x CT2 int8", ratios["runner int8 / CT2 int8 (gen tok/s)"], 1.2),
            target("runner int8 top-1 agreement minus its plain reference's (HF int8 fake)",
                   None if ours is None or plain is None else ours - plain, -0.02, unit=""),
        ]
    return targets


def agreements(results: dict, plan: list[dict]) -> tuple[dict, str | None, int | None]:
    """Greedy agreement of every system with the reference (HF when it ran), and the reference's stop hits."""
    agreement = {}
    ref = "hf" if "hf" in results else next(iter(results), None)
    for s in results:
        if s != ref:
            agreement[f"{LABELS[s]} vs {LABELS[ref]}"] = compare(results[s], results[ref], plan)
    if "runner1" in results and "runner2" in results and ref != "runner1":
        agreement["runner P=2 vs runner P=1"] = compare(results["runner2"], results["runner1"], plan)
    stop_hits = None
    if ref:
        gen_plan = [p for p in plan if p["kind"] == "gen"]
        stop_hits = sum(1 for p, g in zip(gen_plan, results[ref]["gen"])
                        if g and p["body"].get("stop") and g["finish"] == "stop" and g["generated"] < p["body"]["max_tokens"])
    return agreement, ref, stop_hits


def describe(model_dir: Path, params: int, wdir: Path, plan: list[dict], prof: dict, stop_hits) -> tuple[dict, dict]:
    """The JSON's "model" and "workload" entries."""
    cfg = json.loads((model_dir / "config.json").read_text())
    gen_plan = [p for p in plan if p["kind"] == "gen"]
    model = {"dir": str(model_dir), "hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
             "heads": cfg["num_attention_heads"], "intermediate": cfg["intermediate_size"], "vocab": cfg["vocab_size"],
             "params": params + cfg["vocab_size"] * cfg["hidden_size"], "matmul_params": params, "dtype": "float32"}
    workload = {"dir": str(wdir), "requests": len(plan), "gen_requests": len(gen_plan),
                "score_requests": len(plan) - len(gen_plan),
                "stop_requests": sum(1 for p in gen_plan if p["body"].get("stop")), "stop_hits": stop_hits,
                "gen_prompt_tokens": sum(p["prompt_tokens"] for p in gen_plan),
                "scored_prompt_tokens": sum(p["prompt_tokens"] for p in plan if p["kind"] == "score"),
                "min_prompt": min(p["prompt_tokens"] for p in plan), "max_prompt": max(p["prompt_tokens"] for p in plan),
                "max_tokens": prof["max_tokens"], "batch_size_hf_ct2": BATCH}
    return model, workload


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        fn = worker_hf if args.worker.startswith("hf") else worker_ct2
        res = fn(Path(args.model_dir), Path(args.work_dir), args.cores, args.worker.partition("-")[2])
        Path(args.worker_out).write_text(json.dumps(res))
        return 0
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    from pipeline.loading.default_model import cache_root

    prof = PROFILES[args.profile]
    cache = Path(args.cache_dir) if args.cache_dir else cache_root() / "bench"
    wdir = Path(args.work_dir) if args.work_dir else REPO / "bench" / "results" / args.profile
    t0 = time.perf_counter()
    model_dir = build_model(cache, prof)
    plan = build_workload(model_dir, prof, wdir)["plan"]
    print(f"[bench] model {model_dir}, workload {wdir} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    params = matmul_params(model_dir)
    peaks = {str(args.cores): matmul_peak(args.cores), "1": matmul_peak(1)}
    results, failures = run_systems(args.systems_list, model_dir, wdir, args)
    # the peak again at the end: a busy moment at the start would understate it; keep the best
    peaks = {k: max(v, matmul_peak(int(k))) for k, v in peaks.items()}
    figs = {s: figures(m, plan, params, peaks[str(args.cores)]) for s, m in results.items()}
    agreement, ref, stop_hits = agreements(results, plan)
    fid = {f"{LABELS[q]} vs {LABELS[f]}": fidelity(results[q], results[f]) for q, f in PRECISION_PAIRS
           if q in results and f in results}
    ratios = all_ratios(figs)
    if "runner1-int8" in figs:
        sj = wdir / "runner1-int8" / "output_gen.jsonl.summary.json"
        if sj.exists():
            figs["runner1-int8"]["int8_kernels"] = json.loads(sj.read_text()).get("stage_precision")
    model, workload = describe(model_dir, params, wdir, plan, prof, stop_hits)
    out = {
        "command": " ".join([Path(sys.executable).name, "bench/throughput.py", *(sys.argv[1:] if argv is None else argv)]),
        "profile": args.profile, "cores": args.cores, "systems_requested": args.systems, "model": model,
        "workload": workload, "matmul_peak_flops": peaks, "systems": figs, "ratios": ratios,
        "targets": all_targets(ratios, figs, fid, args.systems_list),
        "agreement": agreement, "agreement_threshold": AGREE_THRESHOLD, "agreement_reference": ref, "fidelity": fid,
        "failures": {s: {k: f.get(k) for k in ("error", "log", "log_tail", "request_errors", "command")} for s, f in failures.items()},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(report(out))
    print(f"\nAll figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
