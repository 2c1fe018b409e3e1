"""Fuzz the runner for as long as you like: the generated requests of tests/unit/tasks/test_request_fuzz.py
(tests/fuzz_requests.py) against whole runs (the driver, in files) and a running server. One command:

    python bench/fuzz.py --minutes 60                   # both targets, half the time each
    python bench/fuzz.py --minutes 5 --target server --json /tmp/fuzz.json

The model is the embedded default one (``examples/tiny-llama-default``; ``--model-name`` for another).
The driver target writes each generated list of lines (completion bodies, Batch API lines of both
endpoints with chat messages of every shape, any JSON, broken lines) to a file and runs it with
P = 1 in this process; every input line must get exactly one output line, an error naming its field or
a result. The server target starts one server on 127.0.0.1 and posts generated bodies to
/v1/completions and /v1/chat/completions; every answer must be 200 with choices, 400 naming a
field or 404 for an unknown model, and the server must stay up. Hypothesis draws the examples
(``--seed`` fixes them); a violation or a dead process stops the run, prints the example and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import fuzz_requests as gen  # noqa: E402

DEFAULT_MODEL = REPO / "examples" / "tiny-llama-default"


class TimeUp(Exception):
    """The time given to a target is over (not a failure)."""


def _settings():
    return settings(max_examples=10**9, deadline=None, database=None, phases=(Phase.generate,),
                    suppress_health_check=list(HealthCheck))


def fuzz_driver(model: str, until: float, work: Path, stats: dict, rng_seed: int) -> None:
    from tests.utils import run_inprocess

    @seed(rng_seed)
    @_settings()
    @given(lines=st.lists(gen.lines(), min_size=1, max_size=40))
    def one_file(lines):
        if time.monotonic() > until:
            raise TimeUp
        src, out = work / "in.jsonl", work / "out.jsonl"
        src.write_bytes(b"".join(line.replace(b"\n", b" ") + b"\n" for line in lines))
        out.unlink(missing_ok=True)
        expected = sum(1 for x in src.read_bytes().split(b"\n") if x.strip())
        assert run_inprocess(["--model-name", model, "--infer-data", str(src), "--output-path", str(out),
                              "--no-progress", "--budget", "8192", "--overwrite"]) == 0
        answers = [json.loads(x) for x in out.read_bytes().split(b"\n") if x.strip()]
        assert len(answers) == expected, (len(answers), expected)
        for a in answers:
            err = a.get("error")
            stats["driver_errors" if err is not None else "driver_results"] += 1
        stats["driver_files"] += 1

    try:
        one_file()
    except TimeUp:
        pass


def fuzz_server(model: str, until: float, work: Path, stats: dict, rng_seed: int) -> None:
    from tests.servers import KEY, ProcessServer, httpx

    # a process of its own: a request that kills the server shows as a death, not as the fuzzer's own crash
    server = ProcessServer(["--model-name", model, "--served-model-name", "tiny", "--max-pending", "40",
                            "--max-request-bytes", "200000"], 1, work).start()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    @seed(rng_seed)
    @_settings()
    @given(chat=st.booleans(), data=st.data())
    def one_request(chat, data):
        body = data.draw(gen.bodies(chat=chat, cheap=True))
        if time.monotonic() > until:  # after the draw: a test case that stops drawing early is "flaky" to Hypothesis
            raise TimeUp
        r = httpx.post(server.url("/v1/chat/completions" if chat else "/v1/completions"),
                       content=json.dumps(body).encode(), headers=headers, timeout=300)
        stats["server_status"][str(r.status_code)] = stats["server_status"].get(str(r.status_code), 0) + 1
        assert r.status_code in (200, 400, 404), r.text
        answer = r.json()
        if r.status_code == 200:
            assert answer["choices"]
        else:
            assert answer["error"]["message"] and (answer["error"]["param"] in gen.FIELDS + ("stream", None))
        assert server.proc.poll() is None, "the server died"

    try:
        one_request()
    except TimeUp:
        pass
    finally:
        alive = server.proc.poll() is None
        server.kill()
    assert alive, "the server died"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="total time (split between the targets)")
    ap.add_argument("--target", choices=("driver", "server", "both"), default="both")
    ap.add_argument("--model-name", default=str(DEFAULT_MODEL))
    ap.add_argument("--seed", type=int, default=0, help="Hypothesis seed (the same seed draws the same examples)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    targets = ["driver", "server"] if args.target == "both" else [args.target]
    share = args.minutes * 60 / len(targets)
    stats = {"driver_files": 0, "driver_results": 0, "driver_errors": 0, "server_status": {}, "failure": None}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
            for k, target in enumerate(targets):
                work = Path(tmp) / target
                work.mkdir()
                until = t0 + share * (k + 1)
                (fuzz_driver if target == "driver" else fuzz_server)(args.model_name, until, work, stats, args.seed)
    except Exception as e:  # a violation: Hypothesis printed the example
        stats["failure"] = f"{type(e).__name__}: {str(e)[:2000]}"
    stats["minutes"] = round((time.monotonic() - t0) / 60, 2)
    print(json.dumps(stats, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(stats, indent=1))
    return 1 if stats["failure"] else 0


if __name__ == "__main__":
    sys.exit(main())
