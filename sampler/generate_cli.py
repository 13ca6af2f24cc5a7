"""`tpuserve generate [--model PATH] [--max-tokens N] [--temperature T] [--chat] PROMPT`: one completion on the
engine, without a server (a quick check that a model loads and generates)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tpuserve.model.config import ModelLoadError
from tpuserve.model.loader import load_model
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.engine import JaxEngine


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpuserve generate", description=__doc__)
    p.add_argument("prompt")
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    args = p.parse_args(argv)
    try:
        loaded = load_model(args.model)
    except ModelLoadError as e:
        p.exit(2, f"tpuserve generate: {e}\n")
    tok = loaded.tokenizer
    ids = (
        tok.render_chat([{"role": "user", "content": args.prompt}])[1]
        if args.chat
        else tok.encode(args.prompt)
    )
    # the served engine's settings (EngineConfig) on one slot, long enough for this prompt and its tokens
    engine = JaxEngine(loaded, slots=1, max_seq_len=len(ids) + args.max_tokens + 8)
    params = SlotParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, stop_ids=tok.eos_ids
    )
    first = engine.insert(engine.prefill(ids), 0, params)
    out, done = [first.token_id], first.done
    while not done:
        step = engine.decode()
        for n in range(step.ids.shape[0]):
            if step.valid[n, 0]:
                out.append(int(step.ids[n, 0]))
                done = done or bool(step.done[n, 0])
    sys.stdout.write(tok.decode(out, skip_special_tokens=True) + "\n")
    return 0
