"""TLS between client, gateway and backend, with certificates from a throwaway CA (trustme):

- the gRPC backend (start_server with ServerTLS, over the fake engine) serves only TLS clients; with a client CA
  it also demands a client certificate (mutual TLS);
- a `tpuserve gateway` process configured from a YAML file (certificate paths under `gateway:`) serves HTTPS to
  the OpenAI SDK and reaches that backend over (mutual) TLS; plain HTTP to its port gets no answer;
- the backend's own YAML `server:` section carries its certificate paths."""

from __future__ import annotations

import ssl

import grpc
import httpx
import openai
import pytest
import yaml
from test_faults import start_gateway_process
from tpuserve.cli.backend import parse_args
from tpuserve.grpc_service.settings import ServerTLS
from tpuserve.model.embedded import default_model_path
from tpuserve.model.tokenizer import load_tokenizer
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc

from tests.grpc_service.conftest import ServerThread
from tests.grpc_service.fake_engine import make_engine
from tests.helpers import free_port, require_extra

trustme = require_extra("trustme")  # every test here needs its certificates

MODEL = "fake-smollm2"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """PEM files: the CA, the backend's and the gateway's server certificates, a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    files = {"ca": d / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for name, identity in (("server", "127.0.0.1"), ("client", "tpuserve-gateway")):
        cert = ca.issue_cert(identity, "localhost")
        files[f"{name}_cert"] = d / f"{name}.crt"
        files[f"{name}_key"] = d / f"{name}.key"
        cert.cert_chain_pems[0].write_to_path(str(files[f"{name}_cert"]))
        cert.private_key_pem.write_to_path(str(files[f"{name}_key"]))
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def tls_backend(pki):
    """The fake-engine backend on mutual TLS: it requires a client certificate signed by the CA."""
    tokenizer = load_tokenizer(default_model_path())
    engine = make_engine(tokenizer, slots=4, max_seq_len=256)
    tls = ServerTLS(pki["server_cert"], pki["server_key"], client_ca_file=pki["ca"])
    server = ServerThread(engine, tokenizer, model_id=MODEL, tls=tls)
    yield server
    server.close()


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def info_over(channel: grpc.Channel) -> pb.ModelInfo:
    return pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)


def test_backend_speaks_only_mutual_tls(tls_backend, pki):
    creds = grpc.ssl_channel_credentials(
        root_certificates=read(pki["ca"]),
        private_key=read(pki["client_key"]),
        certificate_chain=read(pki["client_cert"]),
    )
    with grpc.secure_channel(tls_backend.address, creds) as ch:
        assert info_over(ch).model_id == MODEL
    with grpc.insecure_channel(tls_backend.address) as ch, pytest.raises(grpc.RpcError) as plain:
        info_over(ch)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=read(pki["ca"]))
    with grpc.secure_channel(tls_backend.address, no_client_cert) as ch, pytest.raises(grpc.RpcError) as anon:
        info_over(ch)
    assert anon.value.code() == grpc.StatusCode.UNAVAILABLE


def gateway_config(tmp_path, pki, client_cert: bool) -> str:
    gateway = {
        "tls_cert_file": pki["server_cert"],
        "tls_key_file": pki["server_key"],
        "backend_tls_ca_file": pki["ca"],
    }
    if client_cert:
        gateway |= {"backend_tls_cert_file": pki["client_cert"], "backend_tls_key_file": pki["client_key"]}
    path = tmp_path / f"gateway-{client_cert}.yaml"
    path.write_text(yaml.safe_dump({"engine": {"slots": 4}, "gateway": gateway}))
    return str(path)


def test_gateway_serves_https_and_reaches_the_backend_over_mutual_tls(tls_backend, pki, tmp_path):
    port = free_port()
    config = gateway_config(tmp_path, pki, client_cert=True)
    proc = start_gateway_process([tls_backend.address], port, ("--config", config), ca_file=pki["ca"])
    try:
        verify = ssl.create_default_context(cafile=pki["ca"])
        with httpx.Client(verify=verify) as http:
            client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="none", http_client=http)
            out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=2)
            assert out.choices[0].finish_reason == "length"
            assert len(out.choices[0].logprobs.tokens) == 5
            # plain HTTP on the HTTPS port gets no HTTP answer
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            # a client that does not trust the CA refuses the connection
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"https://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        assert proc.wait(15) == 0


def test_gateway_without_a_client_certificate_is_refused_by_the_backend(tls_backend, pki, tmp_path):
    port = free_port()
    config = gateway_config(tmp_path, pki, client_cert=False)
    # /health is 503: the TLS handshake with the backend fails, so no backend is serving
    proc = start_gateway_process(
        [tls_backend.address], port, ("--config", config), ca_file=pki["ca"], health=503
    )
    try:
        verify = ssl.create_default_context(cafile=pki["ca"])
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=verify, timeout=10) as http:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable", r.text
    finally:
        proc.terminate()
        proc.wait(15)


def test_backend_yaml_server_section_carries_the_certificates(tmp_path, pki):
    path = tmp_path / "backend.yaml"
    server = {"port": 50999, "tls_cert_file": pki["server_cert"], "tls_key_file": pki["server_key"]}
    path.write_text(yaml.safe_dump({"engine": {"slots": 2}, "server": server, "gateway": {"port": 1}}))
    server, engine = parse_args(["--config", str(path), "--tls-client-ca-file", pki["ca"]])
    assert server.port == 50999 and engine.slots == 2
    assert server.tls() == ServerTLS(pki["server_cert"], pki["server_key"], pki["ca"])
    assert parse_args(["--port", "1"])[0].tls() is None
    path.write_text(yaml.safe_dump({"server": {"tls_cert_file": pki["server_cert"]}}))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path)])  # a certificate without its key
