"""configs/k8s/*.yaml (the 2-host TPU v5e-16 LeaderWorkerSet, its ConfigMap, the gateway): every document parses,
and each tpuserve command line in them, with its `$(VAR)` references expanded as Kubernetes would (from the
container's declared env; LWS's values made up), passes the real `tpuserve grpc` / `tpuserve gateway` parsers
with the ConfigMap's settings file. Nothing here talks to a cluster: the manifests were never applied to one."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
import yaml
from tpuserve.cli import backend as backend_cli
from tpuserve.cli import gateway as gateway_cli

K8S = pathlib.Path(__file__).resolve().parents[2] / "configs" / "k8s"
CHIPS = 16  # a v5e-16 slice: 4x4
TPU = "google.com/tpu"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# What LWS injects into a group's pods (made up but plausible); the worker index is per template.
LWS_VALUES = {"LWS_LEADER_ADDRESS": "leader-0.tpuserve", "LWS_GROUP_SIZE": "2"}


def _documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


DOCS = _documents()


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] == kind]


def _lws_templates() -> list[tuple[str, dict[str, Any], int]]:
    """(name, pod template, LWS worker index of its pods) for the leader and worker templates of each LWS."""
    found = []
    for lws in _of_kind("LeaderWorkerSet"):
        t = lws["spec"]["leaderWorkerTemplate"]
        found.append(("leader", t["leaderTemplate"], 0))
        found.append(("worker", t["workerTemplate"], 1))
    return found


def _expand(text: str, env: list[dict[str, Any]], values: dict[str, str]) -> str:
    """`text` with `$(VAR)` expanded as the kubelet does: VAR must be declared in the container's `env`."""
    declared = {e["name"] for e in env}

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        assert name in declared, f"$({name}) is not declared in the container's env {sorted(declared)}"
        assert name in values, f"no test value for $({name})"
        return values[name]

    return VAR.sub(one, text)


def _tpuserve_args(container: dict[str, Any], subcommand: str) -> list[str] | None:
    """The args after `tpuserve SUBCOMMAND` in the container's command + args, or None if it runs no such."""
    line = [str(a) for a in container.get("command", []) + container.get("args", [])]
    for i in range(len(line) - 1):
        if line[i].rsplit("/", 1)[-1] == "tpuserve" and line[i + 1] == subcommand:
            return line[i + 2 :]
    return None


def _config_file(
    args: list[str], pod: dict[str, Any], container: dict[str, Any], tmp: pathlib.Path
) -> list[str]:
    """`args` with --config FILE pointing at a copy of the ConfigMap key that the pod mounts at FILE."""
    assert "--config" in args
    i = args.index("--config") + 1
    path = pathlib.PurePosixPath(args[i])
    (mount,) = [m for m in container["volumeMounts"] if pathlib.PurePosixPath(m["mountPath"]) == path.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (cm,) = [c for c in _of_kind("ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"]]
    local = tmp / path.name
    local.write_text(cm["data"][path.name])
    return [*args[:i], str(local), *args[i + 1 :]]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"]["containers"]


def test_the_manifests_hold_the_expected_kinds() -> None:
    assert DOCS, f"no YAML documents in {K8S}"
    kinds = {d["kind"] for d in DOCS}
    assert {"LeaderWorkerSet", "Deployment", "Service", "ConfigMap"} <= kinds
    for d in DOCS:
        assert d.get("apiVersion") and d["metadata"].get("name"), d
    (lws,) = _of_kind("LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"


@pytest.mark.parametrize(("role", "template", "index"), [pytest.param(*t, id=t[0]) for t in _lws_templates()])
def test_each_lws_pod_runs_a_valid_multihost_backend(role: str, template: dict, index: int, tmp_path) -> None:
    lws = _of_kind("LeaderWorkerSet")[0]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    pod = template["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    backends = [c for c in _containers(template) if _tpuserve_args(c, "grpc") is not None]
    assert len(backends) == 1, f"{role}: one `tpuserve grpc` container"
    (c,) = backends
    chips = int(c["resources"]["requests"][TPU])
    assert int(c["resources"]["limits"][TPU]) == chips
    assert size * chips == CHIPS, f"{size} pods x {chips} chips is not the {CHIPS} chips of the slice"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == 50051, f"{role}: {probe}"

    values = {**LWS_VALUES, "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}
    args = [_expand(a, c.get("env", []), values) for a in _tpuserve_args(c, "grpc")]
    server, engine = backend_cli.parse_args(_config_file(args, pod, c, tmp_path))

    assert server.num_processes == size == 2
    assert server.process_id == index
    assert server.coordinator == "leader-0.tpuserve:8476"
    assert server.port == 50051 and server.metrics_port == 9090
    assert server.peer_timeout > 0 and server.init_timeout > 0
    assert engine.model_parallel * engine.data_parallel == CHIPS
    assert engine.dtype == "bfloat16"
    assert engine.model == "/models/llama3-70b-orbax"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/models" in mounts


def test_env_values_refer_only_to_variables_declared_before_them() -> None:
    """The kubelet expands `$(VAR)` in an env value only from the variables above it (else it stays as is)."""
    for role, template, _ in _lws_templates():
        for c in _containers(template):
            seen: set[str] = set()
            for e in c.get("env", []):
                for name in VAR.findall(str(e.get("value", ""))):
                    assert name in seen, f"{role}: env {e['name']} refers to $({name}) before it is declared"
                seen.add(e["name"])


def test_only_the_leader_is_scraped_and_served() -> None:
    (leader, worker) = [t for _, t, _ in _lws_templates()]
    notes = leader["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == "9090" and notes["prometheus.io/path"] == "/metrics"
    assert "prometheus.io/scrape" not in worker["metadata"].get("annotations", {})
    lws_name = _of_kind("LeaderWorkerSet")[0]["metadata"]["name"]
    services = {s["metadata"]["name"]: s["spec"] for s in _of_kind("Service")}
    leader_services = [
        name
        for name, s in services.items()
        if s["selector"].get("leaderworkerset.sigs.k8s.io/worker-index") == "0"
    ]
    assert len(leader_services) == 1
    spec = services[leader_services[0]]
    assert spec["selector"]["leaderworkerset.sigs.k8s.io/name"] == lws_name
    assert [(p["port"], p["targetPort"]) for p in spec["ports"]] == [(50051, 50051)]


def test_the_gateway_runs_valid_flags_against_the_leader_service(monkeypatch) -> None:
    monkeypatch.delenv("TPUSERVE_API_KEY", raising=False)
    (deploy,) = _of_kind("Deployment")
    template = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (c,) = [c for c in _containers(template) if _tpuserve_args(c, "gateway") is not None]
    assert TPU not in c.get("resources", {}).get("requests", {})
    args = [_expand(a, c.get("env", []), {}) for a in _tpuserve_args(c, "gateway")]
    found = gateway_cli.parse_args(args)

    leader_service = [
        s["metadata"]["name"]
        for s in _of_kind("Service")
        if s["spec"]["selector"].get("leaderworkerset.sigs.k8s.io/worker-index") == "0"
    ]
    assert found.backend == (f"{leader_service[0]}:50051",)
    assert found.port == 8000 and found.host == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert c["livenessProbe"]["httpGet"]["port"] == 8000
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == "8000"

    (service,) = [
        s for s in _of_kind("Service") if s["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    ]
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(80, 8000)]
