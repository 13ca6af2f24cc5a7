"""Engine outputs -> proto tokens (grpc_service/convert.py) on the embedded model's tokenizer: the request's k
alternatives in the engine's order with their raw bytes, special alternatives named, ids outside the vocabulary
dropped, and prompt token j taking logprob entry j - 1."""

from __future__ import annotations

import numpy as np
from tpuserve.grpc_service.convert import TokenConverter
from tpuserve.sampler.api import PromptLogprobs, TokenOut


def _out(ids: list[int], logprobs: list[float]) -> TokenOut:
    return TokenOut(ids[0], logprobs[0], np.array(ids, np.int32), np.array(logprobs, np.float32), False)


def test_generated_token_carries_the_first_k_alternatives_with_bytes_and_special_names(tokenizer) -> None:
    eos = tokenizer.eos_ids[0]
    hello = tokenizer.encode("hello")[0]
    ids = [hello, eos, -1, len(tokenizer.token_bytes), 42, 7]
    lps = [-0.5, -1.25, -2.0, -3.0, -4.0, -5.0]
    token = TokenConverter(tokenizer, logprobs=True, top=5).generated(3, _out(ids, lps))
    assert (token.index, token.token_id, token.logprob) == (3, hello, -0.5)
    assert token.token_bytes == tokenizer.token_bytes[hello]
    # the first 5 in order, less the two ids outside the vocabulary (the 6th is not promoted)
    assert [(t.token_id, t.logprob) for t in token.top_logprobs] == [(hello, -0.5), (eos, -1.25), (42, -4.0)]
    special = token.top_logprobs[1]
    assert (
        special.special and special.special_text == tokenizer.token_text(eos) and special.token_bytes == b""
    )
    assert (
        not token.top_logprobs[2].special and token.top_logprobs[2].token_bytes == tokenizer.token_bytes[42]
    )


def test_logprobs_off_or_k_0_carry_no_alternatives(tokenizer) -> None:
    out = _out([5, 6], [-0.1, -3.0])
    off = TokenConverter(tokenizer, logprobs=False, top=0).generated(0, out)
    assert not off.HasField("logprob") and len(off.top_logprobs) == 0
    k0 = TokenConverter(tokenizer, logprobs=True, top=0).generated(0, out)
    assert k0.HasField("logprob") and len(k0.top_logprobs) == 0


def test_prompt_token_j_takes_entry_j_minus_1(tokenizer) -> None:
    ids = (10, 11, 12)
    plp = PromptLogprobs(
        logprobs=np.array([-1.5, -2.5], np.float32),
        top_ids=np.array([[11, 9, 8], [30, 12, 31]], np.int32),
        top_logprobs=np.array([[-1.5, -2.0, -2.25], [-0.5, -2.5, -3.5]], np.float32),
    )
    tokens = TokenConverter(tokenizer, logprobs=True, top=2).prompt(ids, plp)
    assert [t.token_id for t in tokens] == list(ids)
    assert not tokens[0].HasField("logprob") and len(tokens[0].top_logprobs) == 0
    assert [t.logprob for t in tokens[1:]] == [-1.5, -2.5]
    assert [[(a.token_id, a.logprob) for a in t.top_logprobs] for t in tokens[1:]] == [
        [(11, -1.5), (9, -2.0)],
        [(30, -0.5), (12, -2.5)],
    ]
