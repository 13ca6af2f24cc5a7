"""The HF transformers baseline: `generate` at batch 1 on the same GGUF (transformers dequantizes it to fp32),
torch on 2 threads, timed as a user meets it: prompt text in -> last token out (tokenization and prefill
included). Sampled at temperature 1 (no top-k/top-p), `min_new_tokens` = `max_new_tokens`, so every request
makes exactly the tokens asked for."""

from __future__ import annotations

import gc
import time

TORCH_THREADS = 2


class HFGenerate:
    def __init__(self, gguf_path: str, threads: int = TORCH_THREADS) -> None:
        import pathlib

        import torch
        import transformers

        path = pathlib.Path(gguf_path)
        torch.set_num_threads(threads)
        self.threads = threads
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        self.generate("Hello", new_tokens=4, seed=0)  # first-call costs outside the measurements

    def generate(self, prompt: str, new_tokens: int, seed: int) -> tuple[float, int]:
        """(seconds from prompt text to the last token, tokens made) for one request."""
        import torch

        start = time.perf_counter()
        with torch.no_grad():
            torch.manual_seed(seed)
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=self.tokenizer.eos_token_id,
            )
        seconds = time.perf_counter() - start
        return seconds, int(out.shape[1] - ids.shape[1])

    def close(self) -> None:
        del self.model
        gc.collect()
