"""The real OpenAI-compatible server the probe tests use (tests/probe_server.py): `transformers
serve` on 127.0.0.1 with the tiny reasoner (tests/trainers/tiny_reasoner.py). Its answers follow
the chain where the task needs the chain and not elsewhere, the OpenAI surface the probes rely on
behaves as probe_server's docstring says, and the server's log shows each request and survives a
stop and a restart on the same port. Slow: needs the TRL venv (`make test-slow`); the model is
built once (~1 min) and cached, then the module takes ~30 s."""

from __future__ import annotations

import threading
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
from probe_server import (
    HTTPFailure,
    Server,
    add_task,
    copy_task,
    first_word,
    get_json,
    group_processes,
    manifest,
    post_json,
    served,
    tiny_reasoner_dir,
    up_to_answer,
)

pytestmark = pytest.mark.slow

ADDS = [(3, 4, 5), (1, 8, 2), (9, 9, 7), (0, 6, 4), (5, 2, 8), (2, 7, 3), (6, 0, 9), (8, 5, 1)]
COPIES = [7, 19, 0, 26, 12, 3]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(tiny_reasoner_dir(), log=tmp_path_factory.mktemp("serve") / "serve.log") as up:
        yield up


def answer(server: Server, prompt: str) -> str | None:
    return first_word(server.complete(prompt, max_tokens=4)["choices"][0]["text"])


def chat(server: Server, messages: list[dict[str, str]], **params: object) -> dict:
    body = {"model": server.model, "messages": messages, "max_tokens": 32, "temperature": 0}
    return post_json(f"{server.url}/chat/completions", {**body, **params})


def test_built_as_designed() -> None:
    model_dir = tiny_reasoner_dir()
    assert tiny_reasoner_dir() == model_dir  # cached
    measured = manifest(model_dir)["accuracy"]
    assert measured["add"]["accuracy_full_chain"] >= 0.9
    assert measured["add"]["accuracy_empty_chain"] <= 0.4
    assert measured["copy"]["accuracy_full_chain"] >= 0.95
    assert measured["copy"]["accuracy_empty_chain"] >= 0.9
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (model_dir / name).is_file(), name


def test_answers_follow_the_chain_only_where_the_task_needs_it(server: Server) -> None:
    add = [add_task(*operands, stated=i % 3 == 0) for i, operands in enumerate(ADDS)]
    copy = [copy_task(n, fillers=1 + i % 3) for i, n in enumerate(COPIES)]
    for family, tasks, changed_at_least in (("add", add, len(add) - 1), ("copy", copy, 0)):
        full = [answer(server, up_to_answer(prompt, chain)) for prompt, chain, _ in tasks]
        empty = [answer(server, up_to_answer(prompt, "")) for prompt, _, _ in tasks]
        right = [a for a, (_, _, want) in zip(full, tasks, strict=True) if a == want]
        assert len(right) >= len(tasks) - 1, (family, full)
        changed = sum(f != e for f, e in zip(full, empty, strict=True))
        if family == "add":  # the empty chain changes the answers that the chain carries
            assert changed >= changed_at_least, (family, full, empty)
        else:  # and leaves the others
            assert changed == 0, (family, full, empty)
    # from the bare prompt the model writes its own chain, then the answer
    prompt, chain, want = add_task(3, 4, 5)
    text = server.complete(prompt)["choices"][0]["text"]
    assert text.startswith(f" <think> {chain}") and f"<answer> {want} </answer>" in text, text


def test_the_openai_surface_the_probes_use(server: Server) -> None:
    listed = get_json(f"{server.url}/models")["data"]
    assert [m["id"] for m in listed] == [server.model]

    # /v1/completions: raw prompt, the text with its leading space, usage, max_tokens, stop
    prompt, chain, want = add_task(1, 8, 2)
    full = up_to_answer(prompt, chain)
    done = server.complete(full)
    assert done["choices"][0]["text"] == f" {want} </answer>"
    assert done["choices"][0]["finish_reason"] == "stop"
    assert done["usage"]["prompt_tokens"] == len(full.split())
    assert done["usage"]["completion_tokens"] == 3  # " 11", " </answer>", eos
    cut = server.complete(full, max_tokens=1)["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (f" {want}", "length")
    stopped = server.complete(prompt, stop=["</think>"])["choices"][0]
    assert stopped["text"] == f" <think> {chain} </think>"  # the stop string is kept
    assert stopped["finish_reason"] == "stop"

    # seed: the same seed samples the same text; seeds differ (some chains state the result)
    sampled = [
        server.complete(prompt, temperature=1.0, seed=s)["choices"][0]["text"] for s in range(12)
    ]
    assert server.complete(prompt, temperature=1.0, seed=5)["choices"][0]["text"] == sampled[5]
    assert len(set(sampled)) > 1, sampled

    # /v1/chat/completions: the chain comes back as reasoning_content, a trailing assistant
    # message is continued (this template has no role markers), the server's own continuation
    # switches are refused
    user = {"role": "user", "content": prompt}
    message = chat(server, [user])["choices"][0]["message"]
    assert message["reasoning_content"] == chain
    assert message["content"] == f"<answer> {want} </answer>"
    prefix = {"role": "assistant", "content": "<think> 1 + 8 = 9 , </think> <answer>"}
    continued = chat(server, [user, prefix])["choices"][0]["message"]
    assert continued["content"] == "9 </answer>"  # the chain cut after its first step
    for refused in ({"continue_final_message": True}, {"add_generation_prompt": False}):
        with pytest.raises(HTTPFailure) as failure:
            chat(server, [user, prefix], **refused)
        assert failure.value.status == 422
    with pytest.raises(HTTPFailure) as failure:
        chat(server, [user, prefix], chat_template_kwargs={"continue_final_message": True})
    assert failure.value.status == 400

    with pytest.raises(HTTPFailure) as failure:
        post_json(f"{server.url}/completions", {"model": "other", "prompt": prompt})
    assert failure.value.status == 400 and "pinned" in failure.value.body

    # concurrent clients are all served (one generation at a time: see probe_server)
    answers: dict[int, str | None] = {}

    def ask(i: int) -> None:
        answers[i] = answer(server, up_to_answer(*add_task(*ADDS[i])[:2]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {i: add_task(*ADDS[i])[2] for i in range(4)}


def test_the_log_shows_each_request_and_the_server_restarts(server: Server) -> None:
    before = server.requests("POST", "/v1/completions")
    for n in COPIES[:3]:
        server.complete(up_to_answer(*copy_task(n)[:2]))
    assert server.requests("POST", "/v1/completions") == before + 3
    assert 'POST /v1/completions HTTP/1.1" 200' in server.log_text()

    url, process = server.url, server.process
    assert process is not None
    server.stop()
    assert not server.running
    assert group_processes(process.pid) == []  # nothing of its process group is left
    with pytest.raises(urllib.error.URLError):
        get_json(f"{server.base}/health", timeout=5)

    server.start()
    assert server.url == url and server.running
    assert answer(server, up_to_answer(*copy_task(21)[:2])) == "21"
    log = server.log_text()
    assert "probe_server: start 2" in log
    assert server.requests("POST", "/v1/completions") == before + 4  # the log goes on
    assert Path(server.log).is_file()
