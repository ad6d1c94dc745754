"""A real OpenAI-compatible server for the tests: `transformers serve` (transformers[serving], in
the TRL venv, RLSCOPE_TRL_PYTHON) on 127.0.0.1, serving the tiny reasoner that
tests/trainers/tiny_reasoner.py trains from scratch. Standard library only (urllib), no fakes.

    from probe_server import served, tiny_reasoner_dir, add_task, up_to_answer, post_json

    model_dir = tiny_reasoner_dir()          # built once, cached; pytest.skip without the TRL venv
    with served(model_dir, log=tmp_path / "serve.log") as server:
        server.url                           # "http://127.0.0.1:PORT/v1", the OpenAI base URL
        server.model                         # what requests pass as `model` (the dir's path)
        prompt, chain, answer = add_task(3, 4, 5)
        server.complete(up_to_answer(prompt, ""))["choices"][0]["text"]   # " 4 </answer>"
        post_json(f"{server.url}/chat/completions", {"model": server.model, "messages": [...]})
        server.requests("POST", "/v1/completions")   # how many the server's log shows
        server.stop(); server.start()        # down, then up again on the same port and log

What `transformers serve` 5.25 does, read in its source and tried on the tiny model
(tests/test_probe_server.py asserts the parts marked *):

- `/v1/completions` takes a raw text `prompt`, a string (a list is a 400), and applies no chat
  template.* It honours `max_tokens`* (without it: up to max(1024, the generation config's)),
  `temperature`: 0 is greedy*, but a temperature > 0 samples only if the model's
  generation_config.json has do_sample true (the request cannot turn sampling on; the tiny
  reasoner's samples), `seed` (torch's seed, set before the request's generation: same seed, same
  text)*, `stop` (as `generate(stop_strings=...)`: the stop string is KEPT at the end of `text`,
  unlike OpenAI, `finish_reason` "stop")*, `top_p`, `frequency_penalty` (as a repetition
  penalty), `suffix`, `stream`. It ignores `n`, `best_of`, `echo`, `logprobs`,
  `presence_penalty`, `user` (a warning in its log); a field outside OpenAI's schema is a 422.
- `text` is the new tokens decoded, special tokens skipped: it starts with the space that
  separates it from the prompt (" 12 </answer>"), so prompt + text is the full text.* `usage`
  has the prompt's and the completion's token counts (the eos counted).*
- `/v1/chat/completions` renders `messages` with the model's chat template, always with
  `add_generation_prompt=True`, and no switch of the server continues the assistant's turn:
  `continue_final_message` or `add_generation_prompt` as fields are a 422 (not in its schema)*;
  `chat_template_kwargs: {"continue_final_message": true}` is a 400 (incompatible with
  add_generation_prompt)*, `{"add_generation_prompt": false}` a 500 (a TypeError: the argument
  twice). A trailing assistant message is rendered as the template renders it: the tiny
  reasoner's template (contents joined by a space, no role markers) continues it*, a real one
  (Qwen's) closes it and opens a new assistant turn. Continuing the assistant's turn on
  `transformers serve` therefore takes `/v1/completions` with the prompt rendered by the client.
- Chat answers go through a response parser: `<think>...</think>` comes back apart as
  `message.reasoning_content`, the rest as `message.content`.* For every qwen2/qwen3 model type
  the server has a fallback parser for Qwen's own markers; the tiny reasoner ships its own
  (`response_template` in tokenizer_config.json) that parses the generated text only. With a
  trailing assistant message, `content` is the continuation alone ("9 </answer>").* `stop` works
  in chat too (the reasoning cut at "</think>" leaves `content` "").
- `/v1/models` lists the preloaded model alone, its `id` the FORCE_MODEL argument exactly as given
  (here the model dir's absolute path), `owned_by` "local".* A request's `model` must be that
  string or absent; another is a 400 ("Server is pinned to ...").*
- Concurrency: the model generates for one request at a time (`generate()` on one thread);
  concurrent requests are accepted and queued, and served one after another* (4 requests of 100
  tokens at once: done at 0.25, 0.48, 0.71, 0.92 s, one alone 0.2-0.3 s). `--continuous-batching`
  runs on CPU and batches them (the same 4 done together in 0.06 s), but takes ~60-70 s to start,
  ignores `stop` and `min_new_tokens`, and samples at temperature 0 when the generation config
  samples: the helpers here serve without it (`extra_args` can add it).
- Its log (stdout and stderr, `Server.log`, appended to across restarts) has uvicorn's access line
  per request, `INFO:     127.0.0.1:PORT - "POST /v1/completions HTTP/1.1" 200 OK`*, and with
  `--enable-log-requests` (set here) a line per generation with its settings.
- The model loads before the server listens; `/health` then answers 200. It runs as a process of
  its own (multiprocessing spawn), which `Server.stop()` ends with the rest of the group.*
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A Python with torch, transformers[serving] and TRL (`make test-slow` sets it).
TRL_PYTHON = os.environ.get("RLSCOPE_TRL_PYTHON", "")
TINY_REASONER = Path(__file__).parent / "trainers" / "tiny_reasoner.py"
HOST = "127.0.0.1"


def require_trl_python() -> str:
    """TRL_PYTHON, or the calling test skipped without it."""
    if not Path(TRL_PYTHON).is_file():
        import pytest

        pytest.skip("RLSCOPE_TRL_PYTHON (a Python with torch and transformers[serving])")
    return TRL_PYTHON


def cache_root() -> Path:
    """Where built models stay between test sessions: $RLSCOPE_TEST_MODELS, else
    $XDG_CACHE_HOME/rlscope-tests (~/.cache/rlscope-tests)."""
    if os.environ.get("RLSCOPE_TEST_MODELS"):
        return Path(os.environ["RLSCOPE_TEST_MODELS"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlscope-tests"


def tiny_reasoner_dir(timeout: float = 900) -> Path:
    """The tiny reasoner's directory (model, tokenizer, chat template, manifest.json), trained by
    tests/trainers/tiny_reasoner.py on TRL_PYTHON the first time (~1-2 min on one thread) and
    cached under cache_root() by the script's hash. Processes that ask at once (pytest-xdist
    workers) build it once: one builds into a temporary directory under a file lock and renames
    it into place; the others wait on the lock. Skips the test without TRL_PYTHON."""
    python = require_trl_python()
    digest = hashlib.sha256(TINY_REASONER.read_bytes()).hexdigest()[:16]
    root = cache_root()
    final = root / f"tiny-reasoner-{digest}"
    if (final / "manifest.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"tiny-reasoner-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "manifest.json").is_file():  # built while this process waited
            return final
        building = Path(tempfile.mkdtemp(prefix=f".tiny-reasoner-{digest}-", dir=root))
        try:
            done = subprocess.run(
                [python, str(TINY_REASONER), str(building)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
            )
            if done.returncode != 0 or not (building / "manifest.json").is_file():
                raise RuntimeError(
                    f"tiny_reasoner.py failed ({done.returncode}):\n{done.stderr[-4000:]}"
                )
            shutil.rmtree(final, ignore_errors=True)  # a stale half of one, without manifest
            building.chmod(0o755)  # mkdtemp's is 0o700
            os.rename(building, final)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return final


def manifest(model_dir: Path) -> dict[str, Any]:
    """What tiny_reasoner.py measured when it built `model_dir`."""
    return json.loads((model_dir / "manifest.json").read_text())


# ---- the tiny reasoner's texts (as tests/trainers/tiny_reasoner.py writes them; it needs torch,
# so it is not imported here) ----------------------------------------------------------------


def add_task(a: int, b: int, c: int, stated: bool = False) -> tuple[str, str, str]:
    """(prompt, chain, answer) of `Add a b c .` (operands 0..9): the answer depends on the chain."""
    s1, s2 = a + b, a + b + c
    chain = f"{a} + {b} = {s1} , {s1} + {c} = {s2}" + (f" so the result is {s2}" if stated else "")
    return f"Add {a} {b} {c} .", chain, str(s2)


def copy_task(n: int, fillers: int = 2) -> tuple[str, str, str]:
    """(prompt, chain, answer) of `Copy n .` (0..27): the answer does not depend on the chain."""
    return f"Copy {n} .", " ".join(["filler"] * fillers), str(n)


def up_to_answer(prompt: str, chain: str) -> str:
    """The prompt, the chain in `<think> ... </think>` (`<think> </think>` when empty), then
    `<answer>`: the model's next word is its answer."""
    think = f"<think> {chain} </think>" if chain else "<think> </think>"
    return f"{prompt} {think} <answer>"


def first_word(text: str) -> str | None:
    """The answer in a completion of up_to_answer(...) (" 12 </answer>" -> "12")."""
    words = text.split()
    return words[0] if words else None


# ---- HTTP, standard library only -------------------------------------------------------------


class HTTPFailure(RuntimeError):
    """A response other than 2xx, with its status and body."""

    def __init__(self, status: int, body: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {body[:2000]}")
        self.status, self.body = status, body


def _request(url: str, body: dict[str, Any] | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"} if data else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise HTTPFailure(error.code, error.read().decode(errors="replace"), url) from None


def get_json(url: str, timeout: float = 30) -> Any:
    return _request(url, None, timeout)


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> Any:
    """POSTs `body` as JSON, returns the JSON answer; HTTPFailure on a non-2xx status."""
    return _request(url, body, timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((HOST, port))
        except OSError:
            return True
        return False


def group_processes(pgid: int) -> list[int]:
    """The live processes (zombies aside: ended, waiting for init to reap them) of process group
    `pgid`, read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)"
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found.append(int(stat.parent.name))
    return found


# ---- the server ------------------------------------------------------------------------------


@dataclass
class Server:
    """`transformers serve MODEL_DIR` on 127.0.0.1:`port`, its output appended to `log`."""

    model_dir: Path
    port: int
    log: Path
    python: str = field(default_factory=require_trl_python)
    threads: int = 1
    startup_timeout: float = 120
    extra_args: Sequence[str] = ()
    process: subprocess.Popen[bytes] | None = None
    #: seconds the last start() took, process start to /health answering 200
    start_seconds: float | None = None
    starts: int = 0

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL: `{url}/completions`, `{url}/chat/completions`, `{url}/models`."""
        return f"{self.base}/v1"

    @property
    def model(self) -> str:
        """The model name the server knows (the `model` of a request, the id /v1/models lists)."""
        return str(self.model_dir)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "transformers.cli.transformers",
            "serve",
            self.model,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--log-level",
            "info",
            "--enable-log-requests",
            *self.extra_args,
        ]

    def start(self) -> None:
        """Starts the server and waits until /health answers 200; raises with the log's tail if
        the process dies or `startup_timeout` passes first (and leaves nothing running)."""
        if self.running:
            raise RuntimeError(f"the server on port {self.port} is already running")
        if _port_taken(self.port):
            raise RuntimeError(f"port {self.port} is taken by another process")
        self.starts += 1
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(self.threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
            "NO_COLOR": "1",
        }
        began = time.perf_counter()
        with open(self.log, "ab") as out:
            out.write(
                f"== probe_server: start {self.starts}: {' '.join(self.command())}\n".encode()
            )
            out.flush()
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, which stop() ends whole
            )
        deadline = began + self.startup_timeout
        while True:
            if self.process.poll() is not None:
                tail = self.log_text()[-3000:]
                self.stop()
                raise RuntimeError(
                    f"transformers serve exited ({self.process.returncode}) while starting; "
                    f"its log ({self.log}) ends:\n{tail}"
                )
            with contextlib.suppress(OSError, HTTPFailure, ValueError):
                if get_json(f"{self.base}/health", timeout=2).get("status") == "ok":
                    break
            if time.perf_counter() > deadline:
                tail = self.log_text()[-3000:]
                self.stop()
                raise RuntimeError(
                    f"transformers serve did not answer /health within {self.startup_timeout}s; "
                    f"its log ({self.log}) ends:\n{tail}"
                )
            time.sleep(0.25)
        self.start_seconds = time.perf_counter() - began

    def stop(self, timeout: float = 15) -> None:
        """Ends the server's process group (SIGTERM, then SIGKILL after `timeout`) and waits until
        its port is free again, so that start() can take it at once."""
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        # what the group has left (the model's process, multiprocessing's resource tracker),
        # until none is left, so that a test can assert that nothing of the server runs
        deadline = time.monotonic() + timeout
        while group_processes(process.pid) and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            time.sleep(0.1)
        while _port_taken(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def requests(self, method: str = "POST", path: str = "/v1/completions") -> int:
        """Requests to `path` the server's log shows (uvicorn's access lines, any status)."""
        line = re.compile(rf'"{re.escape(method)} {re.escape(path)}(\?[^ ]*)? HTTP/[\d.]+" \d{{3}}')
        return len(line.findall(self.log_text()))

    def complete(self, prompt: str, **params: Any) -> dict[str, Any]:
        """POST /v1/completions for `prompt` with this model; greedy and 32 tokens at most unless
        `params` say otherwise. The whole JSON answer."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 32, "temperature": 0.0}
        return post_json(f"{self.url}/completions", {**body, **params})


@contextlib.contextmanager
def served(
    model_dir: Path,
    port: int | None = None,
    *,
    log: Path | None = None,
    threads: int = 1,
    startup_timeout: float = 120,
    extra_args: Sequence[str] = (),
) -> Iterator[Server]:
    """`transformers serve model_dir` on 127.0.0.1 (a free port unless `port`), started and
    healthy on entry, its process group ended on exit. `log` defaults to a new temporary
    directory's serve.log (left behind to be read). Skips the test without TRL_PYTHON."""
    server = Server(
        model_dir=Path(model_dir).resolve(),
        port=port or free_port(),
        log=log or Path(tempfile.mkdtemp(prefix="rlscope-serve-")) / "serve.log",
        threads=threads,
        startup_timeout=startup_timeout,
        extra_args=tuple(extra_args),
    )
    try:
        server.start()
        yield server
    finally:
        server.stop()


def sampled_run(server: Server, path: Path, steps: int, per_step: int, seed: int = 0) -> Path:
    """A run of `steps` steps of `per_step` rollouts (half `Add`, half `Copy`), each the served
    model's own completion of its prompt (temperature 1), written with rlscope's RunWriter, the
    answer extracted as rlscope's importers do; a prompt is its own prompt_id."""
    import random

    from rlscope.importers.text import extract_answer
    from rlscope.writer import RunWriter

    rng = random.Random(seed)
    rollout_id = 0
    with RunWriter(path, run_id="tiny-reasoner", algorithm="GRPO") as writer:
        for step in range(steps):
            rows: dict[str, list[Any]] = {
                k: []
                for k in ("rollout_id", "step", "prompt_id", "reward", "correct", "response_len")
            }
            rows |= {"prompt": [], "response": [], "answer": []}
            tasks = [add_task(*(rng.randint(0, 9) for _ in range(3))) for _ in range(per_step // 2)]
            tasks += [copy_task(rng.randint(0, 27)) for _ in range(per_step - len(tasks))]
            for prompt, _, truth in tasks:
                reply = server.complete(prompt, max_tokens=48, temperature=1.0, seed=rollout_id)
                response = reply["choices"][0]["text"]
                answer = extract_answer(response)
                for key, value in (
                    ("rollout_id", rollout_id),
                    ("step", step),
                    ("prompt_id", prompt),
                    ("reward", float(answer == truth)),
                    ("correct", answer == truth),
                    ("response_len", len(response.split())),
                    ("prompt", prompt),
                    ("response", response),
                    ("answer", answer),
                ):
                    rows[key].append(value)
                rollout_id += 1
            writer.log_rollouts(rows)
    return path
