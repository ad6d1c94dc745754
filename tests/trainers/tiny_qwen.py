"""The tiny from-scratch Qwen2 policy the CPU trainers share, and how they sample from it."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2Config


def tiny_config(vocab: int) -> Qwen2Config:
    """2 layers, hidden size 32, 4 heads (2 key-value heads); token 0 pads, token 1 ends."""
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
    )


def sample(model: Any, prompts: torch.Tensor, length: int, *, logits: bool = False) -> Any:
    """`length` new tokens per prompt from the model's own distribution (temperature 1, no top-k
    or top-p), with the raw logits of each step when asked."""
    with torch.no_grad():
        return model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=length,
            min_new_tokens=length,
            output_logits=logits,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
