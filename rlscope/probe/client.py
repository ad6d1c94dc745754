"""The OpenAI-compatible client of `rlscope probe`: bounded concurrency, retries, usage, failures.

Built on the `openai` package (the `rlscope[probe]` extra, never a core dependency), which
retries 408, 409, 429, 5xx, timeouts and dropped connections with exponential backoff and
jitter (0.5 s doubling to 8 s, honouring `Retry-After`): `retries` such retries per request.
A Breaker per server gives up on one that answers nothing for a while, whatever the retries.
The API key comes from an environment variable and is never printed, logged or stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from rlscope.errors import RlscopeError

#: The optional extra that brings the client.
EXTRA = "probe"
#: The key servers without authentication accept (vLLM, llama-server, transformers serve).
NO_KEY = "EMPTY"
#: How a chat request asks to continue its trailing assistant message instead of answering it:
#: vLLM's and SGLang's parameters (llama-server continues a trailing assistant message anyway;
#: transformers serve 5.25 rejects unknown fields, so it cannot).
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
#: Seconds without an answer from a server being asked before `rlscope probe` gives up on it.
GIVE_UP_AFTER = 60.0
#: Seconds the connection that tells how a server stopped answering may take.
CONNECT_SECONDS = 2.0


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise RlscopeError(
            "rlscope probe needs the `openai` client package",
            hint=f"pip install 'rlscope[{EXTRA}]'  (or: pip install openai)",
        ) from None
    return openai


@dataclass
class Usage:
    """What the requests cost and how they failed."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failures: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int
    completion_tokens: int


class Breaker:
    """Trips when a server has answered nothing for `stall` seconds while it was asked: requests
    outstanding (a hung engine, or openai's retries against a port that refuses) or failing
    (refused, timed out, 5xx). Any HTTP answer below 500 counts as an answer (a 429 too: a
    rate-limited server is there). The clock starts at the last answer, or when the server is
    asked again after it answered and the client had nothing in flight, so a client busy elsewhere
    or a server slow but answering never trips it."""

    def __init__(self, stall: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall, self._clock = stall, clock
        self.outstanding = 0
        #: how the requests failed since the last answer ("connection", "timeout", "HTTP 503")
        self.failure: str | None = None
        self.since = clock()

    @contextlib.contextmanager
    def asking(self) -> Iterator[None]:
        """Around a request, its retries included."""
        if self.outstanding == 0 and self.failure is None:
            self.since = self._clock()
        self.outstanding += 1
        try:
            yield
        finally:
            self.outstanding -= 1

    def answered(self) -> None:
        self.since, self.failure = self._clock(), None

    def failed(self, how: str) -> None:
        self.failure = how

    @property
    def tripped(self) -> bool:
        asked = self.outstanding > 0 or self.failure is not None
        return asked and self._clock() - self.since >= self.stall


class ServerGone(Exception):
    """A server's breaker tripped: `how` it stopped answering, for the message."""

    def __init__(self, url: str, how: str) -> None:
        super().__init__(f"{url}: {how}")
        self.url, self.how = url, how


class Backend(Protocol):
    """What answers probes: a server (Endpoint) or a model in process (rlscope.probe.local)."""

    usage: Usage

    async def complete(self, prompt: str, **sampling: Any) -> Reply | None: ...

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Reply | None: ...


class Endpoint:
    """One OpenAI-compatible server and model, at most `concurrency` requests in flight (shared
    by every Endpoint given the same `limit`), its answers and failures told to `breaker`."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key_env: str,
        limit: asyncio.Semaphore,
        usage: Usage,
        timeout: float,
        retries: int,
        breaker: Breaker,
    ) -> None:
        openai = _openai()
        self.url, self.model, self.usage, self._limit = url, model, usage, limit
        self.breaker = breaker
        self._errors = openai
        self._client = openai.AsyncOpenAI(
            base_url=url,
            api_key=os.environ.get(api_key_env) or NO_KEY,
            timeout=timeout,
            max_retries=retries,
            # every attempt's answer, openai's retries included (a 429 retried for minutes is
            # a server that answers)
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [self._heard]}),
        )

    async def _heard(self, response: Any) -> None:
        if response.status_code >= 500:
            self.breaker.failed(f"HTTP {response.status_code}")
        else:
            self.breaker.answered()

    async def close(self) -> None:
        await self._client.close()

    async def complete(self, prompt: str, **sampling: Any) -> Reply | None:
        """/v1/completions: the text generated after `prompt`; None on failure (counted)."""
        return await self._call(
            self._client.completions.create,
            lambda r: r.choices[0].text or "",
            model=self.model,
            prompt=prompt,
            **sampling,
        )

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Reply | None:
        """/v1/chat/completions: the assistant's reply; with a trailing assistant message, its
        continuation (`continue_final_message`, as vLLM and transformers serve take it)."""
        continuing = bool(messages) and messages[-1].get("role") == "assistant"
        return await self._call(
            self._client.chat.completions.create,
            lambda r: r.choices[0].message.content or "",
            model=self.model,
            messages=messages,
            extra_body=CONTINUE if continuing else None,
            **sampling,
        )

    async def _call(self, create: Any, text_of: Any, **request: Any) -> Reply | None:
        openai = self._errors
        async with self._limit:
            self.usage.requests += 1
            try:
                with self.breaker.asking():
                    response = await create(**request)
            except openai.APITimeoutError:
                self._failed("timeout")
                return None
            except openai.APIConnectionError:
                self._failed("connection")
                return None
            except openai.APIStatusError as exc:
                self.usage.failures[f"HTTP {exc.status_code}"] += 1
                return None
        self.breaker.answered()
        usage = getattr(response, "usage", None)
        reply = Reply(
            text_of(response),
            int(getattr(usage, "prompt_tokens", 0) or 0),
            int(getattr(usage, "completion_tokens", 0) or 0),
        )
        self.usage.prompt_tokens += reply.prompt_tokens
        self.usage.completion_tokens += reply.completion_tokens
        return reply

    def _failed(self, how: str) -> None:
        self.usage.failures[how] += 1
        self.breaker.failed(how)

    async def gone(self) -> ServerGone:
        """How the server stopped answering, for its tripped breaker: a new connection tells a
        port that refuses from an engine that accepts and never answers."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        after = f"for {self.breaker.stall:g} s"
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, port), CONNECT_SECONDS
            )
        except ConnectionRefusedError:
            return ServerGone(self.url, f"connection refused {after}")
        except TimeoutError:
            return ServerGone(self.url, f"connections time out {after}")
        except OSError as exc:
            return ServerGone(self.url, f"{exc.strerror or type(exc).__name__} {after}")
        writer.close()
        failure = self.breaker.failure
        if failure is not None and failure.startswith("HTTP"):
            return ServerGone(self.url, f"{failure} to every request {after}")
        return ServerGone(self.url, f"no answer {after}, though it accepts connections")

    async def check(self, chat: bool, *, continuing: bool = True) -> None:
        """The server answers, offers the model, and serves the endpoint the probes need
        (`/completions`, or `/chat/completions`, `continuing` an assistant turn); an RlscopeError
        saying what to do otherwise."""
        openai = self._errors
        try:
            # Once, not retried: a server that is not there is said at once, not after backoff.
            with self.breaker.asking():
                page = await self._client.with_options(max_retries=0).models.list()
            offered = [m.id for m in page.data]
        except (openai.APIConnectionError, openai.APITimeoutError):
            raise RlscopeError(
                f"{self.url}: no server answers",
                hint="start the server (vLLM: vllm serve MODEL; llama.cpp: llama-server -m "
                "FILE; transformers serve) and pass its /v1 URL to --endpoint",
            ) from None
        except openai.APIStatusError as exc:
            raise RlscopeError(
                f"{self.url}: GET /models answered HTTP {exc.status_code}",
                hint="--endpoint is the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1",
            ) from None
        if self.model not in offered:
            raise RlscopeError(
                f"{self.url}: the server does not offer model {self.model!r}",
                hint="it offers: " + (", ".join(offered) or "nothing"),
            )
        path = "/chat/completions" if chat else "/completions"
        try:
            with self.breaker.asking():
                if chat:
                    turn = [{"role": "assistant", "content": "0"}] if continuing else []
                    await self._client.chat.completions.create(
                        model=self.model,
                        messages=[{"role": "user", "content": "0"}, *turn],
                        max_tokens=1,
                        extra_body=CONTINUE if continuing else None,
                    )
                else:
                    await self._client.completions.create(
                        model=self.model, prompt="0", max_tokens=1
                    )
        except openai.NotFoundError:
            raise RlscopeError(
                f"{self.url}: the server does not serve {path}",
                hint="probes of text prompts need /v1/completions, of chat messages "
                "/v1/chat/completions; use a server that offers it (vLLM, llama-server and "
                "transformers serve offer both)",
            ) from None
        except openai.APIStatusError as exc:
            if not (chat and continuing) or exc.status_code >= 500:
                raise RlscopeError(f"{self.url}{path}: HTTP {exc.status_code}: {exc}") from None
            raise RlscopeError(
                f"{self.url}: the server cannot continue an assistant turn over {path} "
                f"(HTTP {exc.status_code}), which probes of chat messages need",
                hint="log the rendered `prompt` with the rollouts (probes then go through "
                "/v1/completions), or use a server that continues the turn: vLLM or SGLang "
                "(continue_final_message), llama-server (a trailing assistant message); "
                "transformers serve cannot",
            ) from None
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:
            raise RlscopeError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
