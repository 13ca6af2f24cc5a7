"""The shared real backend serves the embedded GGUF from its quantized blocks (`quantization: keep`, the default for
a GGUF); through real channels it gives the same tokens and logprobs as a backend that dequantized the model at
load; weight bytes in ModelInfo and in /metrics; the CLI flag that selects the mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

from tests.conftest import ENGINE
from tests.grpc_service.conftest import ServerThread, generate
from tests.grpc_service.test_backend_observability import scrape
from tests.helpers import free_port


@pytest.fixture(scope="module")
def dense_backend(embedded) -> Iterator[ServerThread]:
    """The embedded GGUF dequantized to fp32 at load (`quantization: none`); the shared real backend keeps its
    blocks (the default for a GGUF)."""
    from tpuserve.model.loader import load_model
    from tpuserve.sampler.engine import JaxEngine

    loaded = load_model(quantization="none")
    engine = JaxEngine(loaded, dataclasses.replace(ENGINE, slots=8))  # programs compile on first use
    server = ServerThread(engine, loaded.tokenizer, model_id=loaded.model_id, metrics_port=free_port())
    yield server
    server.close()


def _tokens(stub, text: str, max_tokens: int = 10) -> list[pb.Token]:
    responses = generate(
        stub,
        text=text,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        logprobs=pb.LogprobOptions(enabled=True, top_logprobs=5),
        timeout=300,
    )
    return [t for r in responses for t in r.tokens]


def test_kept_blocks_serve_the_dequantized_models_tokens_and_logprobs(real_backend, dense_backend) -> None:
    """(Batch invariance of the kept blocks: tests/sampler/test_batch_invariance.py, on the shared engine.)"""
    for text in ("The capital of France is", "def add(a, b):"):
        kept, dense = _tokens(real_backend.stub, text), _tokens(dense_backend.stub, text)
        assert [t.token_id for t in kept] == [t.token_id for t in dense] and len(kept) == 10
        for a, b in zip(kept, dense, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-5
            assert [x.token_id for x in a.top_logprobs] == [x.token_id for x in b.top_logprobs]


def test_weight_bytes_in_model_info_and_metrics(real_backend, dense_backend) -> None:
    kept = real_backend.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    dense = dense_backend.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (kept.quantization, dense.quantization) == ("keep", "none")
    assert dense.weight_bytes == 538_060_032  # 134.5 M parameters in fp32
    assert 0 < kept.weight_bytes <= 0.3 * dense.weight_bytes
    assert scrape(dense_backend.server.metrics_port)["tpuserve_backend_weight_bytes"] == dense.weight_bytes


def test_quantization_flag_reaches_the_engine_config() -> None:
    from tpuserve.cli.backend import parse_args

    _, engine = parse_args(["--quantization", "none"])
    assert engine.quantization == "none"
    _, engine = parse_args([])
    assert engine.quantization is None  # the source's default (model.loader)
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "int4"])
