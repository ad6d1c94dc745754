"""A tiny reasoning policy made from scratch for the tests that serve a real model.

`python tiny_reasoner.py OUT_DIR` (torch, transformers, tokenizers; no hub download) writes into
OUT_DIR a small Qwen-style causal LM (Qwen3ForCausalLM, 3 layers, hidden 128: see build_model),
its word-level tokenizer with a chat template and a response template, a generation config that
samples, and `manifest.json` (what it is, steps, loss, seconds, accuracies). `AutoTokenizer`,
`AutoModelForCausalLM` and `transformers serve OUT_DIR` load it. It does nothing if
OUT_DIR/manifest.json was written by this very script (same hash). ~1 min on one thread.

Two prompt families, texts of words separated by single spaces:

- chain-dependent: `Add 3 4 5 .` -> `<think> 3 + 4 = 7 , 7 + 5 = 12 </think> <answer> 12 </answer>`
  (operands 0..9), in a share of them (STATED) with the result stated at the end of the chain
  (`... 7 + 5 = 12 so the result is 12 </think>`). The answer is copied from the chain: the model
  is too small and trained too briefly to add three numbers in one token, so with the chain cut
  (`<think> </think> <answer>`) its answer is almost always wrong.
- chain-independent: `Copy 7 .` -> `<think> filler filler </think> <answer> 7 </answer>` (1 to 3
  fillers, numbers 0..27): the answer is the prompt's, and cutting the chain leaves it as it was.

Per family the script measures the answer's accuracy given the true chain (teacher-forced up to
`<answer>`, the next word greedy), given the empty chain, and in the model's own completion of the
prompt (greedy, and sampled at temperature 1), writes them to the manifest, and exits 1 if the
design does not hold (design_holds). Before training and again once saved, it checks that the
tokenizer as `AutoTokenizer` and `transformers serve` load it gives every training text back
exactly, also cut after any word (check_round_trip): a from-scratch word-level tokenizer loses
words and spaces silently otherwise.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
import time
from itertools import product
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SEED = 0
STEPS = 400
BATCH = 64
LR = 3e-3
WARMUP = 50
#: operands of `Add` are 0..MAX_OPERAND; sums reach 3 * MAX_OPERAND, the largest number word
MAX_OPERAND = 9
MAX_NUMBER = 3 * MAX_OPERAND
#: share of `Add` chains that end by stating the result
STATED = 0.3
#: share of the training examples that are `Add` (the rest `Copy`)
ADD_SHARE = 0.75
EVAL_PER_FAMILY = 200
CONTEXT = 128

SPECIALS = ["<pad>", "</s>", "<s>", "<unk>"]
WORDS = [
    "Add",
    "Copy",
    ".",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "+",
    "=",
    ",",
    "so",
    "the",
    "result",
    "is",
    "filler",
    *map(str, range(MAX_NUMBER + 1)),
]
#: How a space is spelled inside a token (the byte-level alphabet's, which GPT-2, Llama 3 and
#: Qwen share): each word but a text's first carries the space before it, `Ġ12`.
SPACE = "Ġ"
#: user content then the assistant's text, one space between messages, nothing else: a trailing
#: assistant message is continued as it stands, whatever `add_generation_prompt` says.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %} {% endif -%}"
    "{{- message['content'] | trim -}}"
    "{%- endfor -%}"
)
#: How `transformers serve` splits a chat answer into `reasoning_content` and `content` (its
#: fallback for Qwen model types expects Qwen's own markers, and leaves the prompt and `</s>` in
#: the content). Anchored at the end of the prompt: only the generated text is parsed.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"\Z",
    "fields": {
        "reasoning_content": {
            "open_pattern": r"\s*<think>\s*",
            "close_pattern": r"\s*</think>\s*",
            "content": "text",
        },
        "content": {"close": "</s>", "content": "text"},
    },
}


def script_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


# ---- the task -------------------------------------------------------------------------------


def add_example(a: int, b: int, c: int, stated: bool) -> dict[str, Any]:
    s1, s2 = a + b, a + b + c
    chain = f"{a} + {b} = {s1} , {s1} + {c} = {s2}" + (f" so the result is {s2}" if stated else "")
    return {"family": "add", "prompt": f"Add {a} {b} {c} .", "chain": chain, "answer": str(s2)}


def copy_example(n: int, fillers: int) -> dict[str, Any]:
    chain = " ".join(["filler"] * fillers)
    return {"family": "copy", "prompt": f"Copy {n} .", "chain": chain, "answer": str(n)}


def sample_example(rng: random.Random) -> dict[str, Any]:
    if rng.random() < ADD_SHARE:
        a, b, c = (rng.randint(0, MAX_OPERAND) for _ in range(3))
        return add_example(a, b, c, rng.random() < STATED)
    return copy_example(rng.randint(0, MAX_NUMBER), rng.randint(1, 3))


def all_examples() -> list[dict[str, Any]]:
    """Every example the task has (the round trip is checked on each)."""
    adds = [
        add_example(a, b, c, stated)
        for a, b, c in product(range(MAX_OPERAND + 1), repeat=3)
        for stated in (False, True)
    ]
    copies = [copy_example(n, k) for n in range(MAX_NUMBER + 1) for k in (1, 2, 3)]
    return adds + copies


def up_to_answer(prompt: str, chain: str) -> str:
    """The text before the answer: the prompt, the chain (empty: `<think> </think>`), `<answer>`."""
    think = f"<think> {chain} </think>" if chain else "<think> </think>"
    return f"{prompt} {think} <answer>"


def completion(example: dict[str, Any]) -> str:
    return up_to_answer("", example["chain"]).lstrip() + f" {example['answer']} </answer>"


def full_text(example: dict[str, Any]) -> str:
    return f"{example['prompt']} {completion(example)}"


# ---- the tokenizer --------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word level, each word one token, the space before a word part of its token: `decode` of
    the ids after any cut gives the text after the cut, leading space included, as a real BPE
    tokenizer's does, so that a prompt plus a server's completion text is the exact full text."""
    words = [*WORDS, *(SPACE + w for w in WORDS), SPACE]  # a lone SPACE: runs of spaces
    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(" ", behavior="merged_with_next"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=CONTEXT,
        response_template=RESPONSE_TEMPLATE,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def check_round_trip(out: Path, texts: list[str]) -> str:
    """The tokenizer as `AutoTokenizer` and as `transformers serve` (`AutoProcessor`) load it from
    OUT_DIR, beside the model's config.json, gives every text back exactly: one id per word, no
    unknown token, no special token added; decoded with and without special tokens (and with the
    eos after it) it is the text again; cut after any word, the decoded ids before and after the
    cut are the text before and after it, and the text before encodes to the ids before (what a
    server's completion of a prompt relies on); the chat template renders the user's prompt and
    continues a trailing assistant message. Exits otherwise; returns the class the loaders chose."""
    names = set()
    for loader in (AutoTokenizer, AutoProcessor):
        tok = loader.from_pretrained(out)
        names.add(type(tok).__name__)
        round_trip(tok, texts, f"{loader.__name__} -> {type(tok).__name__}")
    return "/".join(sorted(names))


def round_trip(tok: Any, texts: list[str], loaded: str) -> None:
    failures: list[str] = []
    for text in texts:
        ids = tok(text)["input_ids"]
        if ids != tok(text, add_special_tokens=False)["input_ids"]:
            failures.append(f"special tokens added to {text!r}: {ids}")
        if tok.unk_token_id in ids:
            failures.append(f"unknown token in {text!r}: {tok.convert_ids_to_tokens(ids)}")
        if len(ids) != len(text.split(" ")):
            failures.append(f"{len(ids)} ids for the {len(text.split(' '))} words of {text!r}")
        for skip in (False, True):
            back = tok.decode(ids, skip_special_tokens=skip)
            if back != text:
                failures.append(f"{text!r} -> {back!r} (skip_special_tokens={skip})")
        with_eos = tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True)
        if with_eos != text:
            failures.append(f"{text!r} + eos -> {with_eos!r}")
        for cut in range(1, len(ids)):
            before, after = tok.decode(ids[:cut]), tok.decode(ids[cut:])
            if before + after != text or tok(before)["input_ids"] != ids[:cut]:
                failures.append(f"{text!r} cut after {cut} words: {before!r} + {after!r}")
                break
        if len(failures) > 10:
            break
    user = {"role": "user", "content": "Add 3 4 5 ."}
    rendered = tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    if rendered != "Add 3 4 5 .":
        failures.append(f"chat template renders {rendered!r}")
    prefix = {"role": "assistant", "content": "<think> 3 + 4 = 7 , </think> <answer>"}
    rendered = tok.apply_chat_template([user, prefix], tokenize=False, add_generation_prompt=True)
    if rendered != "Add 3 4 5 . <think> 3 + 4 = 7 , </think> <answer>":
        failures.append(f"chat template renders {rendered!r}")
    if failures:
        raise SystemExit(f"tokenizer round trip failed ({loaded}):\n" + "\n".join(failures[:10]))


# ---- the model ------------------------------------------------------------------------------


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    """Qwen3, not Qwen2: transformers 5 loads the tokenizer of a `qwen2` model as `Qwen2Tokenizer`
    whatever tokenizer_config.json says, rebuilding a byte-level BPE from this word-level
    vocabulary, which drops words and spaces; for `qwen3` it honours the saved class. The two
    architectures differ only in Qwen3's q/k norms and Qwen2's q/k/v biases."""
    hidden, heads = 128, 4
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=hidden // heads,
        max_position_embeddings=CONTEXT,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def batch(
    tokenizer: PreTrainedTokenizerFast, examples: list[dict[str, Any]]
) -> dict[str, torch.Tensor]:
    """Right-padded ids of prompt + completion + eos; the loss on the completion and eos only."""
    rows, labels = [], []
    for example in examples:
        ids = tokenizer(full_text(example))["input_ids"] + [tokenizer.eos_token_id]
        prompt = len(tokenizer(example["prompt"])["input_ids"])  # a prefix of ids (checked)
        rows.append(ids)
        labels.append([-100] * prompt + ids[prompt:])
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    }


def train(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> list[float]:
    rng = random.Random(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def rate(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    model.train()
    losses = []
    for _ in range(STEPS):
        inputs = batch(tokenizer, [sample_example(rng) for _ in range(BATCH)])
        loss = model(**inputs).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return losses


# ---- measuring ------------------------------------------------------------------------------


def next_words(model: Any, tokenizer: Any, texts: list[str]) -> list[str]:
    """The greedy next word after each text."""
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits
    last = encoded["attention_mask"].sum(1) - 1
    ids = logits[torch.arange(len(texts)), last].argmax(-1).tolist()
    return [tokenizer.decode([i]).strip() for i in ids]


def own_completions(
    model: Any, tokenizer: Any, prompts: list[str], temperature: float = 0.0
) -> list[str]:
    """The model's completion of each prompt (greedy at temperature 0), decoded as a server
    does."""
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    tokenizer.padding_side = "right"
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=40, **sampling)
    new = out[:, encoded["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new, skip_special_tokens=True)


def parse_answer(text: str) -> str | None:
    words = text.split()
    if "<answer>" in words:
        after = words[words.index("<answer>") + 1 :]
        return after[0] if after else None
    return None


def share(got: list[Any], want: list[Any]) -> float:
    return sum(g == w for g, w in zip(got, want, strict=True)) / len(want)


def measure(model: Any, tokenizer: Any) -> dict[str, Any]:
    """Per family, on EVAL_PER_FAMILY examples: the answer's accuracy given the true chain, given
    the empty chain, and in the model's own completion of the prompt (greedy, and sampled at
    temperature 1); how often the own completion is the training text exactly (greedy) and how
    often it states the result (sampled)."""
    rng = random.Random(SEED + 1)
    results: dict[str, Any] = {}
    for family in ("add", "copy"):
        examples: list[dict[str, Any]] = []
        while len(examples) < EVAL_PER_FAMILY:
            example = sample_example(rng)
            if example["family"] == family:
                examples.append(example)
        answers = [e["answer"] for e in examples]
        prompts = [e["prompt"] for e in examples]
        full = next_words(
            model, tokenizer, [up_to_answer(e["prompt"], e["chain"]) for e in examples]
        )
        empty = next_words(model, tokenizer, [up_to_answer(p, "") for p in prompts])
        own = own_completions(model, tokenizer, prompts)
        torch.manual_seed(SEED)
        sampled = own_completions(model, tokenizer, prompts, 1.0)
        results[family] = {
            "examples": len(examples),
            "accuracy_full_chain": share(full, answers),
            "accuracy_empty_chain": share(empty, answers),
            "empty_chain_same_as_full": share(empty, full),
            "accuracy_own_completion": share([parse_answer(t) for t in own], answers),
            "own_completion_exact": share(own, [" " + completion(e) for e in examples]),
            "own_completion_sample": own[:3],
            "accuracy_sampled_t1": share([parse_answer(t) for t in sampled], answers),
            "sampled_states_result": share(
                [" so the result is " in t for t in sampled], [True] * len(sampled)
            ),
        }
    return results


def design_holds(accuracy: dict[str, Any]) -> list[str]:
    wrong = []
    if accuracy["add"]["accuracy_full_chain"] < 0.9:
        wrong.append("add: the full chain gives < 90% right answers")
    if accuracy["add"]["accuracy_empty_chain"] > 0.4:
        wrong.append("add: the empty chain gives > 40% right answers")
    if accuracy["copy"]["accuracy_full_chain"] < 0.95:
        wrong.append("copy: the full chain gives < 95% right answers")
    if accuracy["copy"]["accuracy_empty_chain"] < 0.9:
        wrong.append("copy: the empty chain gives < 90% right answers")
    return wrong


def main(out: Path) -> None:
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        try:
            if json.loads(manifest_path.read_text()).get("script_hash") == script_hash():
                print(f"{out}: up to date")
                return
        except ValueError:
            pass
    start = time.perf_counter()
    torch.manual_seed(SEED)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    tokenizer.save_pretrained(out)
    model.config.save_pretrained(out)  # the tokenizer is checked as it loads beside the model
    texts = [full_text(e) for e in all_examples()]
    check_round_trip(out, texts)
    tokenizer = AutoTokenizer.from_pretrained(out)  # train with what the server will load

    trained = time.perf_counter()
    losses = train(model, tokenizer)
    train_seconds = time.perf_counter() - trained
    # sampling by default, as real checkpoints ship: `transformers serve` turns sampling off for
    # a request's temperature 0 but never on, so with do_sample=False every temperature is greedy
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=40,
    )
    model.save_pretrained(out)
    tokenizer_class = check_round_trip(out, texts)  # again, in the final layout

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    accuracy = measure(reloaded, AutoTokenizer.from_pretrained(out))
    manifest = {
        "what": "tiny from-scratch Qwen3 reasoner (tests/trainers/tiny_reasoner.py): 'Add a b c .' "
        "answers copied from a <think> chain, 'Copy n .' answers independent of it",
        "script_hash": script_hash(),
        "tokenizer_class": tokenizer_class,
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": STEPS,
        "batch": BATCH,
        "final_loss": sum(losses[-20:]) / 20,
        "loss_every_100_steps": [round(x, 4) for x in losses[::100]],
        "train_seconds": round(train_seconds, 1),
        "seconds": round(time.perf_counter() - start, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "accuracy": accuracy,
    }
    text = json.dumps(manifest, indent=2)
    wrong = design_holds(accuracy)
    if wrong:
        raise SystemExit(
            "the tiny reasoner does not behave as designed:\n" + "\n".join(wrong) + "\n" + text
        )
    manifest_path.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: tiny_reasoner.py OUT_DIR")
    main(Path(sys.argv[1]))
