"""One reinforcement-learning step in the serving process, no files in between: tpuserve samples a completion,
the trainer scores the same tokens with the same model code (JAX), takes an optax step that makes the sample
more likely (a REINFORCE step with reward 1), and the server swaps the new arrays in (`GrpcServer.update_weights`,
docs/weight-updates.md). The server then reports the sample's logprobs under the new weights, and every answer
carries the new version.

    .venv-test/bin/python examples/rl_weight_update.py [--learning-rate 1e-4]

Prints one JSON line: the version before and after, the sample's mean logprob as served before and after the
step (echo with max_tokens 0: the server's own re-score) and the trainer's own mean logprob before the step."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tpuserve.grpc_service.server import start_server
from tpuserve.model.llama import Llama, init_cache, module_params
from tpuserve.model.loader import load_model
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc
from tpuserve.sampler.config import EngineConfig
from tpuserve.sampler.engine import JaxEngine

PROMPT = "Write one word that rhymes with cat:"
PAGE = 16


def sequence_logprobs(params: dict[str, jax.Array], cfg, ids: jax.Array) -> jax.Array:
    """Teacher-forced logprob of each token of `ids` after the first, under `params` (canonical names and shapes:
    what `load_model` returns and the server takes): one forward over a fresh cache."""
    model = Llama(cfg, module_params(cfg, params, scan_layers=True))
    length = -(-ids.shape[0] // PAGE) * PAGE
    tokens = jnp.zeros((1, length), jnp.int32).at[0, : ids.shape[0]].set(ids)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    hidden, _ = model(tokens, positions, init_cache(cfg, 1, length, page=PAGE), attend_len=length)
    logprobs = jax.nn.log_softmax(model.logits(hidden)[0, : ids.shape[0] - 1])
    return jnp.take_along_axis(logprobs, ids[1:, None], axis=-1)[:, 0]


async def served_logprobs(stub, ids: list[int]) -> tuple[list[float], str]:
    """The server's re-score of `ids` (prompt logprobs, max_tokens 0) and the version that computed it."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stopping=pb.StoppingCriteria(max_tokens=0),
                                 logprobs=pb.LogprobOptions(enabled=True, prompt_logprobs=True))  # fmt: skip
    msgs = [m async for m in stub.Generate(request)]
    prompt = next(m for m in msgs if m.prompt_tokens)
    return [t.logprob for t in prompt.prompt_tokens[1:]], msgs[-1].weight_version


async def main(learning_rate: float) -> dict:
    loaded = load_model(quantization="none")  # fp32 arrays: the trainer's parameters, and the server's
    engine = JaxEngine(
        loaded, EngineConfig(slots=2, max_seq_len=128, prefill_chunk=64, min_prefill_bucket=16)
    )
    server = await start_server(engine, loaded.tokenizer, "smol", port=0, weight_version="step-0")
    await server.ready
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        sample = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(temperature=1.0, seed=7),
                                    stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True),
                                    logprobs=pb.LogprobOptions(enabled=True), return_prompt_token_ids=True)  # fmt: skip
        msgs = [m async for m in stub.Generate(sample)]
        prompt_ids = list(next(m for m in msgs if m.prompt_token_ids).prompt_token_ids)
        completion = [t.token_id for m in msgs for t in m.tokens]
        ids = prompt_ids + completion
        before, version_before = await served_logprobs(stub, ids)

        # the trainer: REINFORCE with reward 1 on the sampled completion (the prompt's tokens are not trained)
        params = {name: jnp.asarray(a) for name, a in loaded.params.items()}
        weights = jnp.arange(len(ids) - 1) >= len(prompt_ids) - 1

        def loss(p):
            return -jnp.sum(sequence_logprobs(p, loaded.config, jnp.asarray(ids)) * weights) / weights.sum()

        optimizer = optax.adam(learning_rate)
        state = optimizer.init(params)
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)

        ok, message, _ = await server.update_weights("step-1", params=params)
        if not ok:
            raise SystemExit(f"update refused: {message}")
        after, version_after = await served_logprobs(stub, ids)
    await server.shutdown(1.0)
    tail = slice(len(prompt_ids) - 1, None)  # the completion's tokens
    return {
        "completion": loaded.tokenizer.decode(completion),
        "version_before": version_before,
        "version_after": version_after,
        "served_mean_logprob_before": float(np.mean(before[tail])),
        "trainer_mean_logprob_before": float(-value),
        "served_mean_logprob_after": float(np.mean(after[tail])),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    result = asyncio.run(main(parser.parse_args().learning_rate))
    json.dump(result, sys.stdout)
    print()
