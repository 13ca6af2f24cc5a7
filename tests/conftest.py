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

# The engine every real-model test shares: as served (EngineConfig: 64 slots, so batch invariance is checked next
# to 63 other requests; one request decodes on 2 rows, 8 steps a call) on shorter sequences, with prefix-cache
# pages of 16 tokens (tests share prompt prefixes across requests), prompts over 32 tokens in chunks of 64.
ENGINE = dataclasses.replace(EngineConfig(), max_seq_len=256, min_prefill_bucket=32, prefill_chunk=64)

# The fast tier (`make test-fast`, `pytest -m "not slow"`): every layer through fakes and tiny models. A test is
# slow when it needs the embedded model (these session fixtures load and warm it: about a minute before the first
# such test) or belongs to a module that starts processes, compiles for several devices or runs a load of its own.
REAL_MODEL_FIXTURES = {
    "embedded",
    "embedded_dense",  # tests/model/test_quant.py: the embedded model dequantized at load
    "embedded_orbax",
    "engine",
    "together_engine",
    "hf_reference",
    "real_backend",
    "real_backend_address",
}
SLOW_MODULES = {
    "tests/grpc_service/test_multihost.py",  # process groups over jax.distributed
    "tests/sampler/test_compile_cache.py",  # cold and warm starts of real backends
    "tests/sampler/test_sharding.py",  # meshes of 4 CPU devices
    "tests/http_gateway/test_faults.py",  # backend and gateway processes killed and restarted
    "tests/http_gateway/test_load.py",
    "tests/http_gateway/test_families_end_to_end.py",  # tiny random models of each family, compiled and served
    "tests/http_gateway/test_gateway_openapi_fuzz.py",
    "tests/model/test_serving_without_torch.py",  # a venv-like subprocess with torch hidden
    "tests/bench/test_device_smoke.py",
    "tests/cli/test_serve_command.py",  # `tpuserve serve` processes
    "tests/test_examples.py",  # each example in a process of its own
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: needs the embedded model or processes of its own (not in test-fast)"
    )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The figures the tests measured (`figure`), in one section after the results: fidelity against
    transformers, drift of the quantized modes, load and multihost figures. pytest captures what a passing test
    prints, so a figure printed there would not show."""
    lines = [
        value
        for outcome in ("passed", "failed")
        for report in terminalreporter.stats.get(outcome, [])
        if report.when == "call"
        for name, value in report.user_properties
        if name == "figure"
    ]
    if lines:
        terminalreporter.section("figures measured by the tests")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def figure(request: pytest.FixtureRequest):
    """figure(line): a measured figure this test reports; `make test` prints it in its summary (above)."""

    def record(line: str) -> None:
        request.node.user_properties.append(("figure", line))

    return record


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = pathlib.Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()
        callspec = getattr(item, "callspec", None)
        real_gateway = callspec is not None and callspec.params.get("gateway") == "real"  # tests/http_gateway
        if (
            module in SLOW_MODULES
            or real_gateway
            or REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def embedded():
    from tpuserve.model.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def embedded_orbax(tmp_path_factory) -> pathlib.Path:
    """The embedded model as an Orbax checkpoint (fp32, with its tokenizer), written once by `tpuserve convert
    embedded DIR` for the tests that restore one (sharding, weight updates, multihost). Read-only: a test that
    changes a checkpoint writes its own."""
    from tpuserve.cli.main import main as cli_main

    out = tmp_path_factory.mktemp("orbax") / "smollm2"
    assert cli_main(["convert", "embedded", str(out)]) == 0
    return out


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
