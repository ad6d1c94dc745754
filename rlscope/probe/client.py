"""The OpenAI-compatible client of `rlscope probe`: bounded concurrency, retries, usage, failures.

Built on the `openai` package (the `rlscope[probe]` extra, never a core dependency), which
retries 408, 409, 429, 5xx, timeouts and dropped connections with exponential backoff and
jitter (0.5 s doubling to 8 s, honouring `Retry-After`): `retries` such retries per request.
The API key comes from an environment variable and is never printed, logged or stored.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlscope.errors import RlscopeError

#: The optional extra that brings the client.
EXTRA = "probe"
#: The key servers without authentication accept (vLLM, llama-server, transformers serve).
NO_KEY = "EMPTY"
#: How a chat request asks to continue its trailing assistant message instead of answering it:
#: vLLM's and SGLang's parameters (llama-server continues a trailing assistant message anyway;
#: transformers serve 5.25 rejects unknown fields, so it cannot).
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


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


class Backend(Protocol):
    """What answers probes: a server (Endpoint) or a model in process (rlscope.probe.local)."""

    usage: Usage

    async def complete(self, prompt: str, **sampling: Any) -> Reply | None: ...

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Reply | None: ...


class Endpoint:
    """One OpenAI-compatible server and model, at most `concurrency` requests in flight (shared
    by every Endpoint given the same `limit`)."""

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
    ) -> None:
        openai = _openai()
        self.url, self.model, self.usage, self._limit = url, model, usage, limit
        self._errors = openai
        self._client = openai.AsyncOpenAI(
            base_url=url,
            api_key=os.environ.get(api_key_env) or NO_KEY,
            timeout=timeout,
            max_retries=retries,
        )

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
                response = await create(**request)
            except openai.APITimeoutError:
                self.usage.failures["timeout"] += 1
                return None
            except openai.APIConnectionError:
                self.usage.failures["connection"] += 1
                return None
            except openai.APIStatusError as exc:
                self.usage.failures[f"HTTP {exc.status_code}"] += 1
                return None
        usage = getattr(response, "usage", None)
        reply = Reply(
            text_of(response),
            int(getattr(usage, "prompt_tokens", 0) or 0),
            int(getattr(usage, "completion_tokens", 0) or 0),
        )
        self.usage.prompt_tokens += reply.prompt_tokens
        self.usage.completion_tokens += reply.completion_tokens
        return reply

    async def check(self, chat: bool, *, continuing: bool = True) -> None:
        """The server answers, offers the model, and serves the endpoint the probes need
        (`/completions`, or `/chat/completions`, `continuing` an assistant turn); an RlscopeError
        saying what to do otherwise."""
        openai = self._errors
        try:
            # Once, not retried: a server that is not there is said at once, not after backoff.
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
            if chat:
                turn = [{"role": "assistant", "content": "0"}] if continuing else []
                await self._client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": "0"}, *turn],
                    max_tokens=1,
                    extra_body=CONTINUE if continuing else None,
                )
            else:
                await self._client.completions.create(model=self.model, prompt="0", max_tokens=1)
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
