"""A transformers model answering probes in process: the training loop probes its own policy."""

from __future__ import annotations

from typing import Any

from rlscope.probe.client import Reply, Usage


class LocalModel:
    """`model.generate` on the text (the probe's context and intervention), greedy at temperature
    0, without a server; what the TRL callback's `probe_every` uses. The model is switched to
    eval mode for the generation and back. One generation at a time: the training process owns
    the device. Chat messages are rendered with the tokenizer's chat template, the last
    assistant message continued (`continue_final_message`)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.usage = Usage()

    async def complete(self, prompt: str, **sampling: Any) -> Reply | None:
        return self.generate(prompt, **sampling)

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Reply | None:
        continuing = bool(messages) and messages[-1].get("role") == "assistant"
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=not continuing,
            continue_final_message=continuing,
        )
        return self.generate(text, **sampling)

    def generate(
        self,
        prompt: str,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> Reply:
        import torch

        if seed is not None:
            torch.manual_seed(seed)
        ids = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        ids = ids.to(self.model.device)
        sampled = temperature > 0
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    do_sample=sampled,
                    **({"temperature": temperature} if sampled else {}),
                    stop_strings=stop or None,
                    tokenizer=self.tokenizer,
                    pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                )
        finally:
            self.model.train(was_training)
        new = out[0, ids.shape[1] :]
        self.usage.requests += 1
        self.usage.prompt_tokens += int(ids.shape[1])
        self.usage.completion_tokens += int(new.shape[0])
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Reply(text, int(ids.shape[1]), int(new.shape[0]))
