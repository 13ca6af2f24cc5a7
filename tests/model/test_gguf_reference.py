"""The embedded GGUF: teacher-forced logprobs vs transformers loading the same file; tokenizer ids agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tpuserve.model.llama import init_cache

from tests.helpers import require_extra

TEXT = (
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "The quick brown fox jumps over the lazy dog. Prices rose 3.5% to $1,234.56 on 2024-06-01.\n"
    "中文测试：你好，世界！机器学习正在改变我们的生活。日本語のテキストも少し。한국어 문장입니다.\n"
    "Emoji: 😀🎉👍🏽 🇫🇷 👨‍👩‍👧 — café naïve Ωμέγα Привет мир!\n"
    "<div class=\"x\">{'key': [1, 2, 3]}</div>\n\tTabs\tand   spaces   end."
)


def teacher_forced(model_loaded, ids: list[int]) -> np.ndarray:
    m = model_loaded.module()
    T = len(ids)
    hidden, _ = m(jnp.asarray([ids]), jnp.arange(T)[None], init_cache(model_loaded.config, 1, T), T)
    return np.asarray(jax.nn.log_softmax(m.logits(hidden[0]), axis=-1))


def test_embedded_logprobs_match_transformers(embedded, hf_reference, figure):
    torch = require_extra("torch")
    hf_model, hf_tok = hf_reference
    ids = embedded.tokenizer.encode(TEXT)
    assert ids == hf_tok(TEXT)["input_ids"]
    assert 180 <= len(ids) <= 320
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    ours = teacher_forced(embedded, ids)
    diff = np.abs(ours - ref).max()
    figure(
        f"embedded GGUF vs transformers: max |logprob diff| over {len(ids)} positions x {ref.shape[1]} vocab: {diff:.2e}"
    )
    assert diff < 2e-4
    assert (np.argsort(-ours, -1)[:, :5] == np.argsort(-ref, -1)[:, :5]).all()


def test_chat_template_ids_match_transformers(embedded, hf_reference):
    _, hf_tok = hf_reference
    messages = [{"role": "user", "content": "Hi! Write a haiku about 🌸."}, {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "Another, in 中文."}]  # fmt: skip
    ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = list(ref["input_ids"] if not isinstance(ref, list) else ref)
    _, ids = embedded.tokenizer.render_chat(messages)
    assert ids == ref
