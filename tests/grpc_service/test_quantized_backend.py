"""The real backend serving the embedded GGUF from its quantized blocks (`quantization: keep`), through a real
channel: the same tokens and logprobs as the shared backend that dequantized it at load, its weight bytes in
ModelInfo and in /metrics, and the CLI flag that selects the mode."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

from tests.conftest import ENGINE_SETTINGS
from tests.grpc_service.conftest import ServerThread, generate
from tests.grpc_service.test_backend_observability import scrape
from tests.helpers import free_port, wait_until


@pytest.fixture(scope="module")
def kept_backend(embedded) -> Iterator[ServerThread]:
    from tpuserve.model.loader import load_model
    from tpuserve.sampler.engine import JaxEngine

    loaded = load_model(quantization="keep")
    engine = JaxEngine(loaded, **{**ENGINE_SETTINGS, "slots": 16})  # programs compile on first use
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


def test_kept_blocks_serve_the_dequantized_models_tokens_and_logprobs(kept_backend, real_backend) -> None:
    for text in ("The capital of France is", "def add(a, b):"):
        kept, dense = _tokens(kept_backend.stub, text), _tokens(real_backend.stub, text)
        assert [t.token_id for t in kept] == [t.token_id for t in dense] and len(kept) == 10
        for a, b in zip(kept, dense, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-5
            assert [x.token_id for x in a.top_logprobs] == [x.token_id for x in b.top_logprobs]


def test_kept_blocks_are_batch_invariant(kept_backend) -> None:
    """Dequantizing inside the programs keeps decode batch-invariant: the same greedy request alone (the 8-row
    bucket) and beside 9 running streams (it sits in slot 9: the 16-row bucket) gives the same bits."""
    alone = _tokens(kept_backend.stub, "Once upon a time")
    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(_tokens, kept_backend.stub, f"Story {i}:", 40) for i in range(9)]
        assert wait_until(lambda: kept_backend.orchestrator.free_slots <= 16 - 9, timeout=120)
        crowded = _tokens(kept_backend.stub, "Once upon a time")
        assert all(len(f.result()) == 40 for f in others)
    assert [(t.token_id, t.logprob) for t in crowded] == [(t.token_id, t.logprob) for t in alone]
    assert [[(x.token_id, x.logprob) for x in t.top_logprobs] for t in crowded] == [
        [(x.token_id, x.logprob) for x in t.top_logprobs] for t in alone
    ]


def test_weight_bytes_in_model_info_and_metrics(kept_backend, real_backend) -> None:
    kept = kept_backend.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    dense = real_backend.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (kept.quantization, dense.quantization) == ("keep", "none")
    assert dense.weight_bytes == 538_060_032  # 134.5 M parameters in fp32
    assert 0 < kept.weight_bytes <= 0.3 * dense.weight_bytes
    assert scrape(kept_backend.server.metrics_port)["tpuserve_backend_weight_bytes"] == kept.weight_bytes


def test_quantization_flag_reaches_the_engine_config() -> None:
    from tpuserve.cli.backend import parse_args

    _, engine = parse_args(["--quantization", "keep"])
    assert engine.quantization == "keep"
    _, engine = parse_args([])
    assert engine.quantization is None  # the source's default (model.loader)
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "int4"])
