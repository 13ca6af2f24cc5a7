"""Weights updated in place (docs/weight-updates.md), on the embedded model's real weights: an Orbax checkpoint of
them (`tpuserve convert`'s writer) and a perturbed one (one layer's MLP output scaled), served by a real backend
over a real gRPC channel and through the real gateway.

- an update changes the answers and the version they carry (every message, ModelInfo, the OpenAI objects'
  system_fingerprint, /health); updating back gives the first answers again, bit for bit; nothing compiles;
- an update while 16 streams decode loses none: by default each finishes on the old weights (its tokens and
  logprobs those of the same request alone on them), with abort_in_flight each ends at once with ABORTED;
- a trainer's arrays (the in-process API) serve the same bits as the same weights from a file;
- a checkpoint that cannot replace the served weights (missing, another size) is refused with the reason, and
  the old weights keep serving; the admin key is checked."""

from __future__ import annotations

import threading

import grpc
import httpx
import jax
import numpy as np
import pytest
from tpuserve.model import checkpoint
from tpuserve.model.loader import load_model
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.sampler.engine import JaxEngine

from tests.grpc_service.conftest import ServerThread, generate
from tests.helpers import compiles, engine_config, require_extra
from tests.http_gateway.gateway_harness import GatewayServer

ADMIN_KEY = "admin-test-key"
AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)
PROMPT = "The three most useful kitchen tools are"
STREAMS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, embedded_orbax):
    """(base, perturbed, perturbed arrays, other-size) checkpoint paths: the embedded model in fp32 (`tpuserve
    convert`'s checkpoint, tests/conftest.py), and the same with layer 3's down projection scaled by 1.25; a 2-layer
    cut of it for a checkpoint of another size."""
    import dataclasses

    out = tmp_path_factory.mktemp("weights")
    base = load_model(embedded_orbax)
    params = {name: np.asarray(a) for name, a in base.params.items()}
    perturbed = dict(params)
    perturbed["w_down"] = params["w_down"].copy()
    perturbed["w_down"][3] *= 1.25
    checkpoint.save_checkpoint(out / "perturbed", base.config, perturbed, base.model_id, "perturbed", "none")
    small_cfg = dataclasses.replace(base.config, num_layers=2)
    small = {n: (a[:2] if a.ndim and a.shape[0] == base.config.num_layers else a) for n, a in params.items()}
    checkpoint.save_checkpoint(out / "two-layers", small_cfg, small, base.model_id, "two layers", "none")
    return embedded_orbax, out / "perturbed", perturbed, out / "two-layers"


@pytest.fixture(scope="module")
def served(checkpoints, embedded):
    """A real backend on the base checkpoint (16 slots, no warm-up: programs compile on first use), with an admin
    key, starting as version "base"."""
    base = load_model(checkpoints[0])
    engine = JaxEngine(
        base, engine_config(slots=STREAMS, max_seq_len=256, prefill_chunk=64, min_prefill_bucket=32)
    )
    server = ServerThread(engine, embedded.tokenizer, model_id="smol", admin_key=ADMIN_KEY, weight_version="base",
                          served_model_names=["smol", "smol-alias"])  # fmt: skip
    yield server
    server.close()


def _request(seed: int | None = None, max_tokens: int = 8, prompt: str = PROMPT) -> dict:
    sampling = (
        pb.SamplingParams(temperature=0.0) if seed is None else pb.SamplingParams(temperature=1.0, seed=seed)
    )
    return {
        "text": prompt,
        "sampling": sampling,
        "stopping": pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        "logprobs": pb.LogprobOptions(enabled=True, top_logprobs=5),
    }


def _answer(msgs: list[pb.GenerateResponse]) -> tuple[list, str]:
    """(every token's id, logprob and top-5 alternatives, in order; the one weight_version all messages carry)."""
    versions = {m.weight_version for m in msgs}
    assert len(versions) == 1, versions
    tokens = [(t.token_id, t.logprob, [(a.token_id, a.logprob) for a in t.top_logprobs])
              for m in msgs for t in m.tokens]  # fmt: skip
    return tokens, versions.pop()


def _update(served, path, version: str, abort: bool = False) -> pb.UpdateWeightsResponse:
    request = pb.UpdateWeightsRequest(model_path=str(path), weight_version=version, abort_in_flight=abort)
    return served.stub.UpdateWeights(request, metadata=AUTH, timeout=300)


def test_update_changes_answers_and_updating_back_gives_them_again_bit_for_bit(served, checkpoints):
    base, perturbed, _, _ = checkpoints
    before, version = _answer(generate(served.stub, **_request()))
    seeded_before, _ = _answer(generate(served.stub, **_request(seed=3)))
    assert version == "base" and served.stub.GetModelInfo(pb.GetModelInfoRequest()).weight_version == "base"
    with compiles() as compiled:
        answer = _update(served, perturbed, "step-1")
        assert answer.success and answer.weight_version == "step-1" and answer.num_aborted == 0, answer
        after, version = _answer(generate(served.stub, **_request()))
        assert version == "step-1"
        assert [lp for _, lp, _ in after] != [lp for _, lp, _ in before]
        info = served.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.weight_version == "step-1" and info.model_id == "smol"  # the name stays
        assert list(info.served_model_names) == ["smol", "smol-alias"]
        assert _update(served, base, "base-again").success
        again, version = _answer(generate(served.stub, **_request()))
        seeded_again, _ = _answer(generate(served.stub, **_request(seed=3)))
    assert compiled == []
    assert version == "base-again"
    assert again == before and seeded_again == seeded_before


def _streams(served, requests: list[dict]) -> tuple[list, list[threading.Thread], threading.Event]:
    """Start the requests, each on its own thread -> (each one's messages or gRPC error once its thread ends, the
    threads, an event set once every stream has its first token or has ended)."""
    results: list = [None] * len(requests)
    first = [threading.Event() for _ in requests]
    started = threading.Event()

    def run(i: int) -> None:
        msgs = []
        try:
            for msg in served.stub.Generate(pb.GenerateRequest(**requests[i]), timeout=300):
                msgs.append(msg)
                if msg.tokens and not first[i].is_set():
                    first[i].set()
                    if all(f.is_set() for f in first):
                        started.set()
            results[i] = msgs
        except grpc.RpcError as e:
            results[i] = e
        finally:
            first[i].set()
            if all(f.is_set() for f in first):
                started.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(requests))]
    for t in threads:
        t.start()
    return results, threads, started


@pytest.mark.parametrize("abort", [False, True], ids=["finish-first", "abort-in-flight"])
def test_an_update_while_16_streams_decode_loses_none(served, checkpoints, abort):
    """16 streams of 64 tokens (seeded and greedy) decode when new weights arrive: a trainer's arrays, which take
    a fraction of a second to place (from a file they would take seconds, and the streams could end first)."""
    base, _, arrays, _ = checkpoints
    assert _update(served, base, "base").success
    requests = [
        _request(seed=i if i % 2 else None, max_tokens=64, prompt=f"{PROMPT} {i}") for i in range(STREAMS)
    ]
    results, threads, started = _streams(served, requests)
    assert started.wait(300)
    update = served.server.update_weights("step-1", params=arrays, abort_in_flight=abort)
    ok, message, aborted = served.call(update, timeout=300)
    unfinished = sum(t.is_alive() for t in threads)  # when the swap was done
    for t in threads:
        t.join(300)
    assert ok, message
    ended = [r for r in results if isinstance(r, grpc.RpcError)]
    assert len(ended) + sum(isinstance(r, list) for r in results) == STREAMS
    if abort:
        assert aborted == len(ended) > 0
        for e in ended:
            assert e.code() == grpc.StatusCode.ABORTED and "step-1" in e.details()
    else:  # the swap waited for every stream
        assert aborted == 0 and not ended and unfinished == 0
    assert (
        _answer(generate(served.stub, **_request()))[1] == "step-1"
    )  # the next request meets the new weights
    # each stream that finished did so on the old weights: the same requests on them give the same bits (run
    # together again, and two alone: alone and beside others are the same, tests/sampler/test_batch_invariance.py);
    # the aborted ones have no answer to compare, so only the finished ones run again
    assert _update(served, base, "base").success
    finished = [i for i, msgs in enumerate(results) if not isinstance(msgs, grpc.RpcError)]
    assert len(finished) == STREAMS - len(ended)
    again, again_threads, _ = _streams(served, [requests[i] for i in finished])
    for t in again_threads:
        t.join(300)
    for i, msgs in zip(finished, again, strict=True):
        got, version = _answer(results[i])
        assert version == "base"
        assert got == _answer(msgs)[0]
    for i in (0, 1):
        if isinstance(results[i], list):
            assert _answer(results[i])[0] == _answer(generate(served.stub, **requests[i]))[0]


def test_a_trainers_arrays_serve_the_same_bits_as_the_same_weights_from_a_file(served, checkpoints):
    base, perturbed, arrays, _ = checkpoints
    assert _update(served, perturbed, "from-file").success
    from_file, _ = _answer(generate(served.stub, **_request(seed=5)))
    # the in-process API: the arrays on a device of their own placement, resharded onto the engine's
    on_device = {name: jax.device_put(a, jax.devices()[1]) for name, a in arrays.items()}
    ok, message, aborted = served.call(
        served.server.update_weights("from-arrays", params=on_device), timeout=300
    )
    assert ok and aborted == 0, message
    from_arrays, version = _answer(generate(served.stub, **_request(seed=5)))
    assert version == "from-arrays" and from_arrays == from_file
    assert _update(served, base, "base").success


def test_a_checkpoint_that_cannot_replace_the_weights_is_refused_and_serving_goes_on(served, checkpoints):
    base, _, _, two_layers = checkpoints
    assert _update(served, base, "base").success
    before, _ = _answer(generate(served.stub, **_request()))
    missing = _update(served, base.parent / "nowhere", "v-missing")
    assert not missing.success and "no such file" in missing.message and missing.weight_version == "base"
    other = _update(served, two_layers, "v-small")
    assert not other.success and other.weight_version == "base"
    assert "attn_norm" in other.message and "[2, 576]" in other.message, other.message  # the first tensor
    after, version = _answer(generate(served.stub, **_request()))
    assert version == "base" and after == before
    with pytest.raises(grpc.RpcError) as wrong_key:
        served.stub.UpdateWeights(pb.UpdateWeightsRequest(model_path=str(base)),
                                  metadata=(("authorization", "Bearer nope"),))  # fmt: skip
    assert wrong_key.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_over_http_the_admin_endpoint_updates_and_every_answer_carries_the_version(served, checkpoints):
    openai = require_extra("openai")
    base, perturbed, _, _ = checkpoints
    gateway = GatewayServer([served.address], admin_key=ADMIN_KEY).start()
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused")
        admin = httpx.Client(
            base_url=gateway.url, timeout=300, headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        body = {"model_path": str(perturbed), "weight_version": "step-2"}
        refused = httpx.post(gateway.url + "/v1/admin/update_weights", json=body, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        r = admin.post("/v1/admin/update_weights", json=body)
        assert r.status_code == 200, r.text
        assert r.json() | {"message": ""} == {"success": True, "message": "", "weight_version": "step-2",
                                              "num_aborted": 0}  # fmt: skip
        assert httpx.get(gateway.url + "/health").json()["weight_versions"] == {served.address: "step-2"}
        chat = client.chat.completions.create(model="smol-alias", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, logprobs=True)  # fmt: skip
        assert chat.system_fingerprint == "step-2"
        chunks = list(client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, stream=True))
        assert chunks and all(c.system_fingerprint == "step-2" for c in chunks)
        response = client.responses.create(model="smol", input="Hi", max_output_tokens=3)
        assert response.model_extra.get("system_fingerprint") == "step-2"
        bad = admin.post("/v1/admin/update_weights", json={"model_path": str(base.parent / "nowhere")})
        assert bad.status_code == 400 and bad.json()["success"] is False
        assert bad.json()["error"]["param"] == "model_path" and "no such file" in bad.json()["message"]
        assert admin.post("/v1/admin/update_weights", json={"model_path": 3}).status_code == 400
        assert admin.post(
            "/v1/admin/update_weights", json={"model_path": str(base), "weight_version": "base"}
        ).json()["success"]
    finally:
        gateway.stop()


def test_without_an_admin_key_there_is_no_update(tokenizer):
    """The fake engine's backend and a gateway without an admin key: UNIMPLEMENTED, and no route (404)."""
    from tests.grpc_service.fake_engine import make_engine

    server = ServerThread(make_engine(tokenizer, slots=2, max_seq_len=64), tokenizer)
    gateway = GatewayServer([server.address]).start()
    try:
        with pytest.raises(grpc.RpcError) as off:
            server.stub.UpdateWeights(pb.UpdateWeightsRequest(model_path="/x"), metadata=AUTH)
        assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
        r = httpx.post(gateway.url + "/v1/admin/update_weights", json={"model_path": "/x"},
                       headers={"authorization": f"Bearer {ADMIN_KEY}"})  # fmt: skip
        assert r.status_code == 404 and "error" in r.json()
    finally:
        gateway.stop()
        server.close()
