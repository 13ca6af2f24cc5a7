"""The server around the servicer: health, reflection, cancellation, back-pressure, graceful stop, tokenizer RPCs."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc

from tests.grpc_service.conftest import ServerThread, generate
from tests.grpc_service.fake_engine import make_engine
from tests.helpers import free_port

SERVICE = "tpuserve.v1.TextGeneration"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_health_flips_to_serving_after_warmup_and_model_info_says_how_far(tokenizer):
    warmed = threading.Event()

    def warmup(progress):
        progress(1, 2, "prefill bucket 16", 0.5)
        warmed.wait(10)
        progress(2, 2, "decode 128 positions x 8 rows", 0.5)

    server = ServerThread(make_engine(tokenizer), tokenizer, wait_ready=False, warmup=warmup)
    info = lambda: server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).readiness
    try:
        assert health_of(server.channel) == NOT_SERVING and health_of(server.channel, SERVICE) == NOT_SERVING
        wait_until(lambda: info() == "warming up 1/2: prefill bucket 16")
        warmed.set()
        server.wait_ready()
        assert health_of(server.channel) == SERVING and health_of(server.channel, SERVICE) == SERVING
        wait_until(lambda: info() == "serving")
    finally:
        server.close()


def test_reflection_lists_the_service(served):
    db = ProtoReflectionDescriptorDatabase(served.channel)
    assert SERVICE in set(db.get_services())
    service = DescriptorPool(db).FindServiceByName(SERVICE)
    assert {"Generate", "Tokenize", "Detokenize", "RenderChat", "GetModelInfo"} <= set(
        service.methods_by_name
    )


def test_cancelling_50_streams_frees_every_slot(tokenizer):
    engine = make_engine(tokenizer, slots=64, max_seq_len=4096, delay_s=0.003)
    server = ServerThread(engine, tokenizer)
    try:
        request = pb.GenerateRequest(text="a long story", stopping=pb.StoppingCriteria(max_tokens=4000))
        calls = [server.stub.Generate(request, timeout=60) for _ in range(50)]
        for call in calls:
            assert next(call).tokens  # mid-generation
        assert len(engine.active_slots) == 50
        for call in calls:
            call.cancel()
        wait_until(lambda: server.orchestrator.free_slots == 64 and not engine.active_slots)
        inserted = sorted(slot for slot, _ in engine.inserts)
        assert sorted(engine.releases) == inserted and len(inserted) == 50
        responses = generate(server.stub, text="after", stopping=pb.StoppingCriteria(max_tokens=3))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        server.close()


def test_deadline_frees_the_slot(tokenizer):
    engine = make_engine(tokenizer, slots=2, max_seq_len=4096, delay_s=0.003)
    server = ServerThread(engine, tokenizer)
    try:
        with pytest.raises(grpc.RpcError) as info:
            generate(server.stub, timeout=0.3, text="slow", stopping=pb.StoppingCriteria(max_tokens=4000))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: server.orchestrator.free_slots == 2 and not engine.active_slots)
    finally:
        server.close()


def hold_the_only_slot(server: ServerThread, engine) -> grpc.Future:
    """A request that keeps the 1-slot engine busy for ~2 s (800 tokens, 4 per 10 ms call); it has its slot."""
    request = pb.GenerateRequest(text="hold the slot", stopping=pb.StoppingCriteria(max_tokens=800))
    holder = server.stub.Generate(request, timeout=30)
    wait_until(lambda: len(engine.inserts) == 1)
    return holder


def test_queued_request_past_its_deadline_never_takes_a_slot(tokenizer):
    """End to end over gRPC: whichever notices first — grpc.aio cancelling the call at its deadline, or the engine
    thread's own deadline check (test_orchestrator.py) — the request gets no slot, and it is logged and counted
    as DEADLINE_EXCEEDED, not as a client cancel."""
    engine = make_engine(tokenizer, slots=1, max_seq_len=4096, delay_s=0.01)
    server = ServerThread(engine, tokenizer, metrics_port=free_port())
    try:
        holder = hold_the_only_slot(server, engine)
        with pytest.raises(grpc.RpcError) as info:
            generate(server.stub, timeout=0.3, text="late", stopping=pb.StoppingCriteria(max_tokens=4))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert list(holder)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        after = generate(server.stub, text="next", stopping=pb.StoppingCriteria(max_tokens=4))
        assert after[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(engine.inserts) == 2, "the expired request took a slot"  # the holder and "next" only
        requests = server.server.metrics.requests
        wait_until(lambda: requests.labels("DEADLINE_EXCEEDED")._value.get() == 1)
    finally:
        server.close()


def test_max_queue_wait_answers_resource_exhausted_before_a_slot(tokenizer):
    engine = make_engine(tokenizer, slots=1, max_seq_len=4096, delay_s=0.01)
    server = ServerThread(engine, tokenizer, max_queue_wait_s=0.2, metrics_port=free_port())
    try:
        holder = hold_the_only_slot(server, engine)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            generate(server.stub, text="waits too long", stopping=pb.StoppingCriteria(max_tokens=4))
        waited = time.monotonic() - t0
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queue_wait = 0.2 s" in info.value.details()
        assert 0.2 <= waited < 1.5, waited  # answered soon after the limit, not when the slot frees (~2 s)
        assert list(holder)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(engine.inserts) == 1
        dropped = server.server.metrics.dropped.labels("RESOURCE_EXHAUSTED")._value.get()
        assert dropped == 1
    finally:
        server.close()


def test_full_queue_is_resource_exhausted(tokenizer):
    engine = make_engine(tokenizer, slots=1)
    engine.gate = threading.Event()
    server = ServerThread(engine, tokenizer, max_queue=2)
    try:
        request = pb.GenerateRequest(text="queue", stopping=pb.StoppingCriteria(max_tokens=3))
        running = server.stub.Generate(request, timeout=30)
        wait_until(lambda: len(engine.inserts) == 1)  # holds the only slot; the engine waits at the gate
        queued = [server.stub.Generate(request, timeout=30) for _ in range(2)]
        wait_until(lambda: server.orchestrator.queued == 2)
        with pytest.raises(grpc.RpcError) as info:
            generate(server.stub, text="one too many")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "capacity" in info.value.details()
        engine.gate.set()
        for call in [running, *queued]:
            assert list(call)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        engine.gate.set()
        server.close()


def test_graceful_stop_drains_in_flight_streams(tokenizer):
    engine = make_engine(tokenizer, slots=4, max_seq_len=4096, delay_s=0.002)
    server = ServerThread(engine, tokenizer)
    try:
        call = server.stub.Generate(
            pb.GenerateRequest(text="finish me", stopping=pb.StoppingCriteria(max_tokens=800)), timeout=30
        )
        first = next(call)
        stopping = asyncio.run_coroutine_threadsafe(server.server.shutdown(drain_timeout_s=20), server.loop)
        wait_until(lambda: health_of(server.channel) == NOT_SERVING)
        with pytest.raises(grpc.RpcError) as info:
            generate(server.stub, text="too late")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(call)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(first.tokens) + sum(len(r.tokens) for r in rest) == 800
        assert stopping.result(20) is True
    finally:
        server.close()


def test_drain_timeout_cancels_what_is_left(tokenizer):
    engine = make_engine(tokenizer, slots=4, max_seq_len=4096, delay_s=0.003)
    server = ServerThread(engine, tokenizer)
    try:
        call = server.stub.Generate(
            pb.GenerateRequest(text="too long", stopping=pb.StoppingCriteria(max_tokens=4000)), timeout=30
        )
        next(call)
        assert server.call(server.server.shutdown(drain_timeout_s=0.2)) is False
        last = list(call)[-1]
        assert last.finished and last.finish_reason == pb.FINISH_REASON_CANCELLED
        assert engine.active_slots == []
    finally:
        server.close()


def test_tokenizer_rpcs_and_model_info(served, tokenizer):
    stub = served.stub
    text = "Hello <|im_end|> 😀"
    got = stub.Tokenize(pb.TokenizeRequest(text=text))
    assert list(got.token_ids) == tokenizer.encode(text)
    assert list(got.token_bytes) == [tokenizer.token_bytes[i] for i in got.token_ids]
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=got.token_ids)).text == text
    skipped = stub.Detokenize(pb.DetokenizeRequest(token_ids=got.token_ids, skip_special_tokens=True)).text
    assert "<|im_end|>" not in skipped
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**6]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(
        "token_ids: "
    )

    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    rendered = stub.RenderChat(pb.RenderChatRequest(chat=chat))
    prompt, ids = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert (rendered.prompt, list(rendered.token_ids)) == (prompt, ids)
    assert list(stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids) == ids
    no_opener = pb.ChatMessages(messages=chat.messages, add_generation_prompt=False)
    assert not stub.RenderChat(pb.RenderChatRequest(chat=no_opener)).prompt.endswith("assistant\n")
    with pytest.raises(grpc.RpcError) as info:
        stub.RenderChat(pb.RenderChatRequest(chat=pb.ChatMessages()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == "fake-smollm2" and info.vocab_size == tokenizer.vocab_size
    assert (info.context_length, info.max_top_logprobs, info.slots, info.max_n) == (256, 20, 16, 16)
    assert list(info.eos_token_ids) == list(tokenizer.eos_ids) and info.created > 0


SERVE_SCRIPT = """
import asyncio, sys
from tests.grpc_service.fake_engine import make_engine
from tpuserve.grpc_service.server import serve
from tpuserve.model.embedded import default_model_path
from tpuserve.model.tokenizer import load_tokenizer
tokenizer = load_tokenizer(default_model_path())
engine = make_engine(tokenizer, slots=4, max_seq_len=4096, delay_s=0.002)
sys.exit(asyncio.run(serve(engine, tokenizer, "fake", "127.0.0.1", int(sys.argv[1]), drain_timeout_s=20)))
"""


def test_serve_exits_0_on_sigterm_after_draining():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, str(port)], cwd=root)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            wait_until(lambda: health_of(channel, SERVICE) == SERVING, timeout=30)
            call = pb_grpc.TextGenerationStub(channel).Generate(
                pb.GenerateRequest(text="drain me", stopping=pb.StoppingCriteria(max_tokens=600)), timeout=30
            )
            next(call)
            proc.send_signal(signal.SIGTERM)
            assert list(call)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
