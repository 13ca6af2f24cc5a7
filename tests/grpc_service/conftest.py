"""A real grpc.aio server (in a background thread with its own event loop) over the fake engine and the
embedded model's real tokenizer; tests talk to it through a real channel with the sync client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import pytest
from tpuserve.grpc_service.server import GrpcServer, start_server
from tpuserve.model.embedded import default_model_path
from tpuserve.model.tokenizer import Tokenizer, load_tokenizer
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc

from tests.grpc_service.fake_engine import FakeEngine, make_engine

FAIL_PREFILL_TEXT = "please fail the prefill"


class ServerThread:
    """start_server(...) on a private event loop; `stub` is a sync client on a real channel."""

    def __init__(
        self,
        engine: FakeEngine,
        tokenizer: Tokenizer,
        wait_ready: bool = True,
        model_id: str = "fake-smollm2",
        **kw,
    ) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-loop", daemon=True)
        self.thread.start()
        kw.setdefault("prefill_budget", None)  # one chunk a turn while streams decode
        self.server: GrpcServer = self.call(start_server(engine, tokenizer, model_id, **kw))
        self.address = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        if wait_ready:
            self.wait_ready()

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self, timeout: float = 30.0) -> None:
        async def ready() -> None:
            await self.server.ready

        self.call(ready(), timeout)

    @property
    def orchestrator(self):
        return self.server.orchestrator

    def close(self) -> None:
        self.channel.close()
        if self.server.orchestrator._thread is not None and self.server.orchestrator._thread.is_alive():
            self.call(self.server.shutdown(drain_timeout_s=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def served(tokenizer: Tokenizer) -> Iterator[ServerThread]:
    """The shared server: 16 slots, S = 256, N = 4; prompts that start with FAIL_PREFILL_TEXT fail."""
    engine = make_engine(tokenizer, slots=16, max_seq_len=256, steps_per_call=4)
    bad = tuple(tokenizer.encode(FAIL_PREFILL_TEXT))
    engine.fail_prefill = lambda tokens: tuple(tokens[: len(bad)]) == bad
    server = ServerThread(engine, tokenizer)
    yield server
    server.close()


def generate(stub: pb_grpc.TextGenerationStub, timeout: float = 30.0, **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=timeout))
