"""The checks of ``bench/gpu_check.py`` after its environment part: each takes the run's
:class:`~bench.gpu_check.Check` and returns its figures with ``ok`` and ``failures`` (one line each);
an exception is recorded by the caller. A check of several cases records each case's own error and
goes on with the next.

The runner runs in this process (the Python API's ``LLM``, or ``dist_inference_runner.run`` for file
mode); at P = 2 its second stage is a worker process on the same device (``--dist-backend gloo``).
"""

from __future__ import annotations

import gc
import json
import re
import time
from pathlib import Path

import torch

from bench.gpu_check_models import (FAMILIES, Reference, Sample, compare, fp8_activation_hooks, fp8_checkpoint,
                                    int8_reference, llama_1b, tiny_model, verdict)

DTYPES = ("bfloat16", "float16")
RUN_DTYPE = "bfloat16"  # the compute dtype of the checks that are not about dtypes, as GPU users run
STEPS = {"gpu": 32, "cpu": 8}  # greedy tokens compared per prompt
PROMPT_LENGTHS = {"gpu": (5, 13, 22, 40, 77, 150), "cpu": (5, 21)}
# file mode: 256 requests of 32..512 prompt tokens (log-uniform), 128 greedy tokens each; transformers'
# generate in batches of 64, left-padded
FILE_WORKLOAD = {"gpu": dict(requests=256, shortest=32, longest=512, max_tokens=128, hf_batch=64),
                 "cpu": dict(requests=12, shortest=4, longest=40, max_tokens=8, hf_batch=6)}


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def prompts(lengths, seed: int = 1, high: int = 1000) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids 3..high: the local tokenizer's, past its specials)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (n,), generator=g).tolist() for n in lengths]


def runner_greedy(model: str, ps: list[list[int]], steps: int, **flags) -> list[tuple[list[int], list[float], bool]]:
    """The runner at P = 1 (the Python API, this process): (tokens, logprobs, ended at EOS) per prompt."""
    from dist_inference_runner import LLM, SamplingParams

    with LLM(model, no_progress=True, **flags) as llm:
        results = llm.generate(ps, SamplingParams(max_tokens=steps, temperature=0, logprobs=1))
    out = []
    for r in results:
        if r.error is not None:
            raise RuntimeError(f"request {r.index} failed: {r.error}")
        c = r.choices[0]
        out.append((c.token_ids, c.token_logprobs, c.finish_reason == "stop"))
    return out


def case_line(name: str, case: dict) -> str:
    if "error" in case:
        return f"{name}: {case['error']}"
    return (f"{name}: mean error {case['mean_error']} (tolerance {case['mean_tolerance']}), max {case['max_error']} "
            f"(tolerance {case['max_tolerance']}), divergences {case['divergences']}")


def parity(ck) -> dict:
    """Each family in bfloat16 and float16 at P = 1 against transformers in the same dtype on the same
    device, both against transformers' float32 model (see ``verdict``)."""
    steps, ps = STEPS[ck.scale], prompts(PROMPT_LENGTHS[ck.scale])
    cases: dict[str, dict] = {}
    for family in FAMILIES:
        ref = None
        try:
            ref = Reference(tiny_model(ck.work / family, family, ck.scale), ck.device)
            for dtype in DTYPES:
                name = f"{family}/{dtype}"
                try:
                    ours = runner_greedy(ref.model_dir, ps, steps, dtype=dtype)
                    theirs = [ref.greedy(p, steps, getattr(torch, dtype)) for p in ps]
                    cases[name] = verdict([compare(ref, p, o, t) for p, o, t in zip(ps, ours, theirs)])
                except Exception as e:  # noqa: BLE001 - this case's failure; the next runs
                    cases[name] = {"ok": False, "error": short(e)}
        except Exception as e:  # noqa: BLE001 - building the model failed
            cases[family] = {"ok": False, "error": short(e)}
        finally:
            if ref is not None:
                ref.close()
    failures = [case_line(n, c) for n, c in cases.items() if not c["ok"]]
    passed = sum(c["ok"] for c in cases.values())
    return {"ok": not failures, "headline": f"{passed}/{len(cases)} cases", "steps": steps,
            "prompt_lengths": list(PROMPT_LENGTHS[ck.scale]), "cases": cases, "failures": failures}


# -- file mode -----------------------------------------------------------------------------------------
def workload(w: dict, seed: int = 0) -> list[dict]:
    """Greedy requests of log-uniform prompt lengths in [shortest, longest], ids past the specials."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = torch.log(torch.tensor(float(w["shortest"]))), torch.log(torch.tensor(float(w["longest"])))
    lengths = torch.exp(lo + (hi - lo) * torch.rand(w["requests"], generator=g)).round().long().tolist()
    return [{"prompt": torch.randint(3, 1000, (n,), generator=g).tolist(), "max_tokens": w["max_tokens"],
             "temperature": 0, "return_token_ids": True} for n in lengths]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_file(model: str, requests: Path, output: Path, flags: list[str]) -> tuple[int, float, dict, list[dict]]:
    """File mode in this process (``dist_inference_runner.run``, P = 1): (exit code, seconds of the call,
    the summary, the output lines)."""
    import dist_inference_runner
    from pipeline.config.options import parse_options

    args = ["--model-name", model, "--infer-data", str(requests), "--output-path", str(output), "--no-progress",
            "--overwrite", "--status-file", "none", *flags]
    t0 = time.perf_counter()
    code = dist_inference_runner.run(parse_options(args))
    seconds = time.perf_counter() - t0
    summary = json.loads(Path(f"{output}.summary.json").read_text()) if Path(f"{output}.summary.json").exists() else {}
    lines = [json.loads(x) for x in output.read_text().splitlines()] if output.exists() else []
    return code, seconds, summary, lines


def free_memory() -> None:
    """What the last runs left (their stages, caches, models) given back, the device's cache too."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_generate(model_dir: str, requests: list[dict], batch: int, dtype: torch.dtype, device: torch.device) -> dict:
    """transformers' ``generate``, greedy, in batches of ``batch`` in file order, left-padded, each batch to
    its largest ``max_tokens``: generated tokens (up to EOS or the request's ``max_tokens``) per second of
    the generate calls, the peak GPU memory and each request's tokens."""
    from transformers import AutoModelForCausalLM

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad, eos = model.config.pad_token_id or 0, model.config.eos_token_id
    seconds, useful, tokens = 0.0, 0, []
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        width = max(len(r["prompt"]) for r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(chunk):
            ids[j, width - len(r["prompt"]):], mask[j, width - len(r["prompt"]):] = torch.tensor(r["prompt"]), 1
        ids, mask = ids.to(device), mask.to(device)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(r["max_tokens"] for r in chunk),
                             do_sample=False, pad_token_id=pad, eos_token_id=eos)
        sync(device)
        seconds += time.perf_counter() - t0
        for j, r in enumerate(chunk):
            new = out[j, width:].tolist()[: r["max_tokens"]]
            new = new[: new.index(eos)] if eos in new else new
            tokens.append(new)
            useful += len(new)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    del model
    return {"tokens_per_s": round(useful / seconds, 1), "generated_tokens": useful, "generate_seconds": round(seconds, 2),
            "peak_gpu_mb": None if peak is None else round(peak, 1), "tokens": tokens}


def file_mode(ck) -> dict:
    """A 1B-class Llama (bfloat16, drawn on the device) through file mode, against transformers'
    batched generate on the same device: tokens/s, peak memory against the weights, first result."""
    w = FILE_WORKLOAD[ck.scale]
    t0 = time.perf_counter()
    model, weight_bytes = llama_1b(ck.work / "llama-1b", ck.scale, ck.device)
    built = time.perf_counter() - t0
    reqs = workload(w)
    path = write_jsonl(ck.work / "file-mode.jsonl", reqs)
    code, call_s, summary, lines = run_file(model, path, ck.work / "file-mode.out.jsonl", ["--dtype", RUN_DTYPE])
    free_memory()  # the runner's stage and caches, before transformers loads its copy
    failures = [] if code == 0 else [f"the runner exited {code}"]
    errors = [x["error"]["message"] for x in lines if "error" in x]
    if len(lines) != len(reqs) or errors:
        failures.append(f"{len(lines)} lines for {len(reqs)} requests, {len(errors)} errors: {errors[:2]}")
    hf = hf_generate(model, reqs, w["hf_batch"], getattr(torch, RUN_DTYPE), ck.device)
    ours = [x["result"]["choices"][0].get("token_ids") or [] for x in lines if "result" in x]
    same = sum(a == b for a, b in zip(ours, hf["tokens"]))
    wall, first = summary.get("wall_seconds"), summary.get("first_result_seconds")
    load = call_s - wall if wall is not None else None
    tps = summary.get("completion_tokens_per_second")
    gpu_peak = (summary.get("stage_gpu_peak_mb") or [None])[0]
    mb = weight_bytes / 2**20
    fig = {"model": {"shape": "Llama-3.2-1B" if ck.scale == "gpu" else "toy", "weights_mb": round(mb, 1),
                     "build_seconds": round(built, 1)},
           "workload": {k: v for k, v in w.items()},
           "runner": {"tokens_per_s": tps, "completion_tokens": summary.get("completion_tokens"),
                      "wall_seconds": wall, "load_seconds": None if load is None else round(load, 2),
                      "time_to_first_result_s": None if first is None or load is None else round(load + first, 2),
                      "peak_gpu_mb": gpu_peak, "peak_gpu_over_weights": None if gpu_peak is None else round(gpu_peak / mb, 2),
                      "kv_cells_peak": summary.get("kv_cells_peak"), "stage_busy": summary.get("stage_busy"),
                      "last_rank_peak_rss_mb": summary.get("last_rank_peak_rss_mb")},
           "hf": {k: v for k, v in hf.items() if k != "tokens"},
           "same_tokens_as_hf": f"{same}/{len(reqs)} requests (bf16 near-ties may differ; not a pass criterion)"}
    fig["hf"]["peak_gpu_over_weights"] = None if hf["peak_gpu_mb"] is None else round(hf["peak_gpu_mb"] / mb, 2)
    fig["tokens_per_s_vs_hf"] = round(tps / hf["tokens_per_s"], 2) if tps and hf["tokens_per_s"] else None
    if not summary.get("completion_tokens"):
        failures.append("no generated tokens in the summary")
    if ck.cuda and not gpu_peak:
        failures.append("the summary has no stage_gpu_peak_mb on a GPU")
    fig["headline"] = f"{fig['tokens_per_s_vs_hf']}x HF tok/s, first result {fig['runner']['time_to_first_result_s']} s"
    return {"ok": not failures, **fig, "failures": failures}


# -- two stages on one device ----------------------------------------------------------------------
def pipeline_requests(ck, steps: int) -> tuple[list[dict], list[list[int]]]:
    """Greedy generations of mixed lengths, two sharing a 40-token prefix (the prefix cache), longer
    than the prefill chunk (chunked prefill), and one echo scoring request; and their prompts."""
    ps = prompts((9, 70, 21) if ck.scale == "cpu" else (9, 33, 70, 21, 140, 300), seed=7)
    shared = prompts((40,), seed=8)[0]
    ps += [shared + prompts((5,), seed=9)[0], shared + prompts((12,), seed=10)[0]]
    reqs = [{"prompt": p, "max_tokens": steps, "temperature": 0, "logprobs": 1, "return_token_ids": True} for p in ps]
    reqs.append({"prompt": ps[2], "max_tokens": 0, "echo": True, "logprobs": 1, "return_token_ids": True})
    return reqs, ps


def api_file(model: str, requests: Path, output: Path, pipeline_size: int = 1, **flags) -> tuple[dict, list[dict]]:
    """``LLM.generate_file`` (file mode's writer and summary through the Python API; at P = 2 a worker
    process holds the second stage): (summary, output lines)."""
    from dist_inference_runner import LLM

    with LLM(model, pipeline_size, no_progress=True, overwrite=True, **flags) as llm:
        llm.generate_file(str(requests), str(output))
    return json.loads(Path(f"{output}.summary.json").read_text()), [json.loads(x) for x in output.read_text().splitlines()]


def in_process_file(model: str, requests: Path, output: Path, flags: list[str]) -> tuple[dict, list[dict]]:
    """File mode at P = 2 with both ranks threads of this process (``--in-process``): (summary, output lines)."""
    code, _, summary, lines = run_file(model, requests, output, [*flags, "--in-process", "--pipeline-group-size", "2"])
    if code != 0:
        raise RuntimeError(f"--in-process P = 2 exited {code}")
    return summary, lines


def choice_of(line: dict) -> tuple[list[int], list[float], bool]:
    c = line["result"]["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"] == "stop"


def two_stages(ck) -> dict:
    """P = 2 with both stages on this device, two ways: two processes over gloo (activations through host
    memory) and two threads of this process (``--in-process``, in-memory links); each stage's weights,
    KV cache and prefix pool on the device. Each against P = 1, all measured against transformers'
    float32 model: the same greedy tokens (up to near-ties) and logprobs as close as P = 1's."""
    steps = STEPS[ck.scale]
    model = tiny_model(ck.work / "llama-p2", "llama", ck.scale, seed=3)
    reqs, ps = pipeline_requests(ck, steps)
    path = write_jsonl(ck.work / "p2.jsonl", reqs)
    flags = ["--dtype", RUN_DTYPE, "--prefill-chunk", "32", "--timeout", "120"]
    code, _, one, p1 = run_file(model, path, ck.work / "p1.out.jsonl", flags)
    if code != 0 or len(p1) != len(reqs) or any("error" in x for x in p1):
        raise RuntimeError(f"P = 1: exit code {code}, {len(p1)} lines: {[x.get('error') for x in p1][:2]}")
    ref = Reference(model, ck.device)
    cases = {}
    try:
        ways = {"gloo, 2 processes": lambda: api_file(model, path, ck.work / "p2.out.jsonl", 2, dist_backend="gloo",
                                                      dtype=RUN_DTYPE, prefill_chunk=32, timeout=120),
                "in-process, 2 threads": lambda: in_process_file(model, path, ck.work / "p2-local.out.jsonl", flags)}
        for name, run in ways.items():
            try:
                cases[name] = against_p1(ck, ref, ps, p1, *run(), len(reqs))
            except Exception as e:  # noqa: BLE001 - this way's failure; the next runs
                cases[name] = {"ok": False, "error": short(e)}
    finally:
        ref.close()
    failures = [n + ": " + "; ".join(c.get("failures") or [c.get("error", "")]) for n, c in cases.items() if not c["ok"]]
    return {"ok": not failures, "headline": f"{sum(c['ok'] for c in cases.values())}/{len(cases)} ways agree with P = 1",
            "p1_tokens_per_s": one.get("completion_tokens_per_second"), "cases": cases, "failures": failures}


def against_p1(ck, ref: Reference, ps: list[list[int]], p1: list[dict], summary: dict, p2: list[dict], n: int) -> dict:
    """One P = 2 run's output lines and summary against P = 1's lines (see :func:`two_stages`)."""
    failures = []
    if len(p2) != n or any("error" in x for x in p2):
        failures.append(f"{sum('error' in x for x in p2)} errors, {len(p2)} lines for {n}")
    samples = [compare(ref, p, choice_of(b), choice_of(a)) for p, a, b in zip(ps, p1, p2)]
    echo = [x["result"]["choices"][0]["logprobs"]["token_logprobs"][1:] for x in (p1[-1], p2[-1])]
    tf = ref.logprobs(ps[2][:1], ps[2][1:])
    errs = [[abs(lp - float(tf[i, t])) for i, (t, lp) in enumerate(zip(ps[2][1:], e))] for e in echo]
    samples.append(Sample(errs[1], errs[0], None, None))  # the echo scores: P = 2 against P = 1's
    agreement = verdict(samples)
    if not agreement["ok"]:
        failures.append(case_line("against P = 1", agreement))
    gpu = summary.get("stage_gpu_peak_mb") or []
    if ck.cuda and (len(gpu) != 2 or not all(gpu)):
        failures.append(f"stage_gpu_peak_mb {gpu}: both stages should hold memory on the GPU")
    if summary.get("pipeline_size") != 2:
        failures.append(f"the summary says pipeline_size {summary.get('pipeline_size')}")
    return {"ok": not failures, "agreement": agreement, "tokens_per_s": summary.get("completion_tokens_per_second"),
            "stage_gpu_peak_mb": gpu, "kv_cells_peak": summary.get("kv_cells_peak"),
            "cached_prompt_tokens": summary.get("cached_prompt_tokens"), "failures": failures}


# -- quantized checkpoints -----------------------------------------------------------------------------
def quantized_variants(ck, base: str) -> dict[str, tuple]:
    """name -> (checkpoint, runner flags, reference folder, reference hooks, tolerance factor). int8's and
    FP8's kernels also round the activations (int8: per token; FP8: as the checkpoint says, which the
    reference hooks reproduce), so their bounds are twice as wide."""
    from tests.quant_checkpoints import awq, gptq  # AutoGPTQ's / AutoAWQ's layouts; torch and safetensors only

    w = ck.work / "quant"
    fp8, fp8_ref = fp8_checkpoint(base, w / "fp8", w / "fp8-ref")
    g, g_ref = gptq(base, w / "gptq", w / "gptq-ref", bits=4, group=32)
    a, a_ref = awq(base, w / "awq", w / "awq-ref", group=32)
    return {"int8": (base, ["--quantize", "int8"], int8_reference(base, w / "int8-ref"), None, 2.0),
            "fp8": (fp8, [], fp8_ref, fp8_activation_hooks, 2.0),
            "gptq-int4": (g, [], g_ref, None, 1.0),
            "awq-int4": (a, [], a_ref, None, 1.0)}


def quantized(ck) -> dict:
    """int8 (``--quantize int8``), FP8 (compressed-tensors), GPTQ and AWQ int4 at P = 1 in bfloat16 on the
    device against transformers on the dequantized weights: tokens and logprobs (``verdict``), the
    kernels each stage chose at load."""
    steps, ps = STEPS[ck.scale], prompts(PROMPT_LENGTHS[ck.scale], seed=11)
    base = tiny_model(ck.work / "llama-q", "llama", ck.scale, seed=4)
    reqs = [{"prompt": p, "max_tokens": steps, "temperature": 0, "logprobs": 1, "return_token_ids": True} for p in ps]
    path = write_jsonl(ck.work / "quant.jsonl", reqs)
    cases = {}
    for name, (model, flags, ref_dir, hooks, factor) in quantized_variants(ck, base).items():
        ref = None
        try:
            code, _, summary, lines = run_file(model, path, ck.work / f"quant-{name}.out.jsonl",
                                               ["--dtype", RUN_DTYPE, *flags])
            if code != 0 or len(lines) != len(reqs) or any("error" in x for x in lines):
                raise RuntimeError(f"exit code {code}, {len(lines)} lines: {[x.get('error') for x in lines][:2]}")
            ref = Reference(ref_dir, ck.device, hooks)
            samples = [compare(ref, p, choice_of(x), ref.greedy(p, steps, getattr(torch, RUN_DTYPE)))
                       for p, x in zip(ps, lines)]
            cases[name] = {**verdict(samples, factor), "model": lines[0]["result"]["model"],
                           "kernels": [st.get("kernels") for st in summary.get("stage_precision", [])]}
        except Exception as e:  # noqa: BLE001 - this variant's failure; the next runs
            cases[name] = {"ok": False, "error": short(e)}
        finally:
            if ref is not None:
                ref.close()
    failures = [case_line(n, c) for n, c in cases.items() if not c["ok"]]
    return {"ok": not failures, "headline": f"{sum(c['ok'] for c in cases.values())}/{len(cases)} formats",
            "cases": cases, "failures": failures}


# -- structured outputs --------------------------------------------------------------------------------
LABEL = {"type": "object", "additionalProperties": False, "required": ["label", "score"],
         "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                        "score": {"type": "integer", "minimum": 0, "maximum": 100}}}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
CHOICES = ["yes", "no", "maybe"]


def label_ok(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"label", "score"} and v["label"] in LABEL["properties"]["label"]["enum"]
            and isinstance(v["score"], int) and 0 <= v["score"] <= 100)


def structured(ck) -> dict:
    """Constrained requests at P = 1 on the device (the grammar's mask applied to the device's logits):
    a JSON schema (greedy and sampled), a regex and a choice; each answer must satisfy its constraint."""
    from dist_inference_runner import LLM

    model = tiny_model(ck.work / "llama-s", "llama", ck.scale, seed=5)
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL}}}
    cases = {"json": ({**schema, "temperature": 0}, label_ok),
             "json-sampled": ({**schema, "temperature": 1.0, "seed": 3}, label_ok),
             "regex": ({"structured_outputs": {"regex": DATE}, "temperature": 0}, lambda t: bool(re.fullmatch(DATE, t))),
             "choice": ({"structured_outputs": {"choice": CHOICES}, "temperature": 0}, lambda t: t in CHOICES)}
    reqs = [{"prompt": f"Request {i}: answer as {name}:", "max_tokens": 64, **fields}
            for i, (name, (fields, _)) in enumerate(cases.items())]
    with LLM(model, no_progress=True, dtype=RUN_DTYPE) as llm:
        results = llm.generate(reqs)
    out, failures = {}, []
    for (name, (_, check)), r in zip(cases.items(), results):
        text = r.text if r.error is None else None
        out[name] = {"text": text, "finish_reason": r.finish_reason if r.error is None else None, "error": r.error}
        if text is None or not check(text):
            failures.append(f"{name}: {r.error or repr(text)} does not satisfy its constraint")
    return {"ok": not failures, "headline": f"{len(cases) - len(failures)}/{len(cases)} constrained",
            "cases": out, "failures": failures}


PARTS = {"parity": parity, "file_mode": file_mode, "two_stages": two_stages, "quantized": quantized,
         "structured": structured}
