"""What the benchmark sends: the sizes of each row (full and `--quick`), the prompts, and the request bodies.

Requests are sampled at temperature 1 with a seed per request, no top-k/top-p/min-p (llama-server's own sampler
defaults are switched off in its bodies). The OpenAI API has no `ignore_eos`, so tpuserve's prompts are ones
that SmolLM2 continues at length (stories, guides, essays) and the rows count the tokens that actually came:
a stream that stopped early is reported, never padded. llama-server gets its `ignore_eos` extension, so it
always makes the tokens asked for.

Every request of a run opens with a number of its own ("1000. Once upon a time, ..."), so no server has seen
its prompt before: llama-server keeps each slot's last prompt and evaluates only what a new one adds to the
longest match (a repeated 15-19-token prompt: 1 token, ~15-20 ms, against ~110-140 ms for a new one, measured
here), and a benchmark that repeats its prompts would time that cache instead of a prefill. The numbers count
per server (`Flavour.model`) from 1000, so both servers get the same texts up to the number and the same lengths
(SmolLM2 spells each digit as a token); the chat template's shared system turn is still a prefix either server
may reuse, as it would be for users."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

# 13-19 tokens each with the SmolLM2 tokenizer, 18-24 with the request's number; each continues for 256 tokens at
# temperature 1 for most seeds.
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg",
    "Here is a long story about a robot who learns to paint. Chapter one:",
    "In the following article we explain how rainbows form, step by step.\n\n",
    "The recipe for a traditional French onion soup begins with slowly caramelising",
    "Dear diary, today was the strangest day of my life. It started when",
    "A complete guide to growing tomatoes in a small garden, from seed to harvest:",
    "The old lighthouse keeper climbed the stairs every evening, and on the night of the storm",
]
CHAT_PROMPTS = [
    "Tell me a long story about a dragon who is afraid of the dark.",
    "Explain in detail how a steam engine works.",
    "Describe a walk through a busy market in Marrakesh.",
    "Write a detailed guide to planting a vegetable garden.",
]
SEED_BASE = 1000


@dataclass(frozen=True)
class Plan:
    """Sizes and repetitions of each row group; paired measurements alternate A, B, A, B, ... `reps` times and
    the rows report medians."""

    reps: int = 3
    single_tokens: int = 128  # one stream (vs HF generate batch 1 and vs llama-server)
    many_streams: int = 64  # concurrent streams ...
    many_tokens: int = 64  # ... of this many tokens each
    ttft_probes: int = 5  # idle TTFT: requests per endpoint per repetition
    ttft_tokens: int = 8
    load_streams: int = 63  # TTFT under load: streams decoding when the probe arrives ...
    load_tokens: int = 256  # ... each asked for this many tokens
    load_settle_s: float = 30.0  # the probe goes once every load stream has text, or after this long
    streams_counts: tuple[int, ...] = (1, 4, 16)  # TTFT while this many streams decode ...
    streams_probes: int = 4  # ... probes a round, one after the other, each closed at its first text ...
    streams_load_tokens: int = 300  # ... the load streams asked for this many (llama-server's slot: 384)
    lp_streams: int = 32  # logprobs on vs off
    lp_tokens: int = 64
    lp_k: int = 20
    engine_streams: int = 64  # in-process diagnostic (capped at the engine's slots)
    mixed_short: int = 60  # mixed load: short prompts ...
    mixed_long: int = 4  # ... and long ones, all at once
    mixed_long_words: int = 2650  # a long prompt's filler words: ~3,000 tokens (~1.13 a word)
    mixed_tokens: int = 64
    sys_warmups: int = 2  # shared system prompt: requests a round before the probes (fill the caches) ...
    sys_probes: int = 8  # ... and probes timed


FULL = Plan()
QUICK = Plan(
    reps=1,
    single_tokens=16,
    many_streams=8,
    many_tokens=8,
    ttft_probes=2,
    ttft_tokens=2,
    load_streams=7,
    load_tokens=32,
    load_settle_s=10.0,
    streams_counts=(1, 4),
    streams_probes=2,
    streams_load_tokens=64,
    lp_streams=4,
    lp_tokens=8,
    engine_streams=4,
    mixed_short=6,
    mixed_long=1,
    mixed_long_words=300,
    mixed_tokens=8,
    sys_warmups=1,
    sys_probes=2,
)


@dataclass(frozen=True)
class Flavour:
    """How one server is asked: its model id and the fields added to every body (llama-server's extensions)."""

    model: str
    extra: tuple[tuple[str, Any], ...] = ()


TPUSERVE = "tpuserve"
LLAMA = "llama-server"
LLAMA_EXTRA = (("ignore_eos", True), ("top_k", 0), ("min_p", 0.0), ("typical_p", 1.0))


_numbers: dict[str, itertools.count] = {}
# Where this run's numbers start: another run against the same server (`--llama-url`, `--tpuserve-url`) must not
# send the same prompts again, or llama-server's prompt cache answers them from the prompt its slot kept (a
# second run measured its one-stream TTFT at 36 ms against 83 ms in the first, fresh prompts).
_FIRST = random.Random().randrange(9000)


def unique(server: str, text: str) -> str:
    """`text` opened by the next number of `server`'s run (four digits, 1000-9999 from a random start, so every
    request of a prompt has the same length and no two runs send the same sequence of prompts)."""
    n = next(_numbers.setdefault(server, itertools.count()))
    return f"{1000 + (_FIRST + n) % 9000}. {text}"


def completion(flavour: Flavour, i: int, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """Request i of a run on /v1/completions (prompt i mod the list, seed SEED_BASE + i)."""
    body = {
        "model": flavour.model,
        "prompt": unique(flavour.model, PROMPTS[i % len(PROMPTS)]),
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": SEED_BASE + i,
    }
    return {**body, **dict(flavour.extra), **fields}


def chat(flavour: Flavour, i: int, max_tokens: int) -> dict[str, Any]:
    """Request i of a run on /v1/chat/completions."""
    body = {
        "model": flavour.model,
        "messages": [{"role": "user", "content": unique(flavour.model, CHAT_PROMPTS[i % len(CHAT_PROMPTS)])}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": SEED_BASE + i,
    }
    return {**body, **dict(flavour.extra)}


def completions(flavour: Flavour, count: int, max_tokens: int, first: int = 0, **fields: Any) -> list[dict]:
    return [completion(flavour, first + i, max_tokens, **fields) for i in range(count)]
