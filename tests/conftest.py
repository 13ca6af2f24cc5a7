"""Session-scoped fixtures shared by the suite: the embedded model loaded once, one warmed engine, the PyTorch
reference. Four fake CPU devices are configured before JAX is imported, so sharding tests can build a mesh;
everything else runs on device 0."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# before JAX starts: the tests run on the XLA:CPU scheduler and the host memory settings the engine serves with
from tpuserve.sampler import host_memory, xla_flags

xla_flags.set_defaults()
host_memory.keep_freed_memory()

import dataclasses
import pathlib

import pytest
from tpuserve.sampler.config import EngineConfig

from tests.helpers import engine_config, require_extra

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# The engine every real-model test shares: as served (EngineConfig: 64 slots, so batch invariance is checked next
# to 63 other requests; one request decodes on 2 rows, 8 steps a call) on shorter sequences, with prefix-cache
# blocks of 32 tokens (tests share prompt prefixes across requests).
ENGINE = dataclasses.replace(EngineConfig(), max_seq_len=256, min_prefill_bucket=32, prefill_chunk=32)


@pytest.fixture(scope="session")
def embedded():
    from tpuserve.model.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def engine(embedded):
    from tpuserve.sampler.engine import JaxEngine

    eng = JaxEngine(embedded, ENGINE)
    eng.warm_up()
    return eng


@pytest.fixture(scope="session")
def together_engine(embedded):
    """An engine on `make serve`'s prefill settings (chunks of 128, sizes from 16), so short prompts are
    prefilled together (`prefill_together`); warmed up without the prompt-logprob programs."""
    from tpuserve.sampler.engine import JaxEngine

    cfg = engine_config(slots=16, max_seq_len=256, prefill_chunk=128, min_prefill_bucket=16)
    eng = JaxEngine(embedded, cfg)
    eng.warm_up(prompt_logprobs=False)
    return eng


@pytest.fixture(scope="session")
def hf_reference():
    """transformers + PyTorch on the same GGUF (test-only dependency): (model, tokenizer)."""
    torch = require_extra("torch")
    import transformers
    from tpuserve.model.embedded import default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, tok


@pytest.fixture(scope="session")
def real_backend(engine, embedded):
    """The real gRPC backend (grpc.aio server + orchestrator) over the shared warmed engine, on a free port."""
    from tests.grpc_service.conftest import ServerThread

    server = ServerThread(engine, embedded.tokenizer, model_id=embedded.model_id)
    yield server
    server.close()


@pytest.fixture(scope="session")
def real_backend_address(request: pytest.FixtureRequest) -> str:
    """The real backend's gRPC address: the in-process one above, or $TPUSERVE_TEST_BACKEND (HOST:PORT) to run the
    real-backend gateway checks against a running `tpuserve grpc`, e.g. the leader of `make serve-multihost`."""
    return os.environ.get("TPUSERVE_TEST_BACKEND") or request.getfixturevalue("real_backend").address
