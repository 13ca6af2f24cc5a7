"""Request fields shared by both endpoints -> proto `SamplingParams` / `StoppingCriteria`."""

from __future__ import annotations

from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default


def sampling(temperature: float | None, top_p: float | None, seed: int | None) -> pb.SamplingParams:
    params = pb.SamplingParams(temperature=DEFAULT_TEMPERATURE if temperature is None else temperature)
    if top_p is not None:
        params.top_p = top_p
    if seed is not None:
        params.seed = seed % 2**64  # the spec's int64 seed as the proto's uint64, bijectively
    return params


def stopping(max_tokens: int | None, stop: list[str]) -> pb.StoppingCriteria:
    criteria = pb.StoppingCriteria(stop=[s for s in stop if s])
    if max_tokens is not None:
        criteria.max_tokens = max_tokens
    return criteria
