"""One model across two JAX processes, as `make serve-multihost` runs it: process 0 under `tpuserve serve`
(gateway + gRPC), process 1 `tpuserve grpc --process-id 1`, 2 CPU devices each, model_parallel 4 across both,
collectives over gloo. Against a one-process server on 4 CPU devices with the same settings: the same greedy
tokens, logprobs within the tensor-parallel tolerance. SIGTERM on the leader drains and stops both processes;
a killed follower gives 503s and every process exits non-zero, none hangs. Bad group flags fail at start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import yaml
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc

from tests.helpers import free_port, wait_until

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
ADMIN_KEY = "group-admin-key"
TP_TOL = 5e-5  # docs/engine.md "Numerical fidelity": row-parallel products sum in another order
ENGINE = {
    "slots": 4,
    "max_seq_len": 128,
    "steps_per_call": 4,
    "min_prefill_bucket": 32,
    "prefill_chunk": 32,
    "min_attend_bucket": 128,
    "min_batch_bucket": 4,
    "model_parallel": 4,
    "warm_up": False,
}  # compiled on first use: only what these requests need


def write_config(tmp_path, name: str, server: dict | None = None, model: str | None = None) -> str:
    path = tmp_path / name
    engine = {**ENGINE, "model": model}
    path.write_text(yaml.safe_dump({"engine": engine, **({"server": server} if server else {})}))
    return str(path)


class Group:
    """`tpuserve serve` (process 0 of `processes`) on `devices` CPU devices per process, plus the followers."""

    def __init__(
        self,
        tmp_path,
        processes: int,
        devices: int,
        peer_timeout: float = 30.0,
        model: str | None = None,
        wait: bool = True,
    ) -> None:
        """Starts the processes and, with `wait`, waits until the leader serves (else call `serving()`)."""
        self.port, self.grpc_port, coord = free_port(), free_port(), f"127.0.0.1:{free_port()}"
        server = (
            {
                "coordinator": coord,
                "num_processes": processes,
                "process_id": 0,
                "peer_timeout": peer_timeout,
                "init_timeout": 120.0,
            }
            if processes > 1
            else None
        )
        config = write_config(tmp_path, f"group{processes}.yaml", server, model)
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "TPUSERVE_ADMIN_KEY": ADMIN_KEY}
        self.logs: dict[str, list[str]] = {}
        self.followers = [
            self._start(
                f"follower{i}",
                [
                    sys.executable,
                    "-m",
                    "tpuserve.cli",
                    "grpc",
                    "--config",
                    config,
                    "--process-id",
                    str(i),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(free_port()),
                    "--log-format",
                    "text",
                ],
                env,
            )
            for i in range(1, processes)
        ]
        self.leader = self._start(
            "leader",
            [
                sys.executable,
                "-m",
                "tpuserve.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--grpc-port",
                str(self.grpc_port),
                "--config",
                config,
            ],
            env,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        if wait:
            self.serving()

    def serving(self) -> None:
        """Waits until the leader's /health answers 200 (a process that exits or 600 s without it: the test
        fails), then reads the served model's name."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.processes):
                self.stop()
                pytest.fail(f"a process exited during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            self.stop()
            pytest.fail(f"not serving within 600 s:\n{self.log_tail()}")
        self.model = httpx.get(f"{self.base}/v1/models", timeout=10).json()["data"][0]["id"]

    def active_slots(self) -> float:
        """The leader backend's slots holding a sample (its metrics: GRPC_PORT + 1, `tpuserve serve`'s default);
        -1 when a scrape fails on its connection (seen once with the machine loaded: polled again)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.grpc_port + 1}/metrics", timeout=5).text
        except httpx.TransportError:
            return -1.0
        line = next(x for x in text.splitlines() if x.startswith("tpuserve_backend_active_slots "))
        return float(line.split()[1])

    def _start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        lines = self.logs.setdefault(name, [])
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        return proc

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [self.leader, *self.followers]

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(f"--- {k}\n" + "".join(v[-n:]) for k, v in self.logs.items())

    def complete(self, prompt: str, **body) -> dict:
        r = httpx.post(
            f"{self.base}/v1/completions",
            timeout=300,
            json={
                "model": self.model,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 5,
                **body,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            time.sleep(0.2)
        return [p.poll() for p in self.processes]

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def reference(group: Group) -> list[dict]:
    """The one-process server on 4 devices: each prompt's greedy completion with top-5 logprobs; then stopped."""
    try:
        group.serving()
        return [group.complete(p) for p in PROMPTS]
    finally:
        group.leader.send_signal(signal.SIGTERM)
        group.wait(60)
        group.stop()


def test_two_processes_serve_like_one_and_stop_together_on_sigterm(tmp_path, request, figure):
    """From an Orbax checkpoint (`tpuserve convert`, tests/conftest.py), which each process restores with the target
    sharding: only its own shards. The reference reads the GGUF's blocks, which dequantize bit-identically
    (test_quant.py). The reference server starts first and answers while the checkpoint is written (unless an
    earlier test wrote it) and the group starts (the suite's time); the group is asked once the reference stopped."""
    one = Group(tmp_path, processes=1, devices=4, wait=False)
    group = None
    try:
        orbax = request.getfixturevalue("embedded_orbax")
        group = Group(tmp_path, processes=2, devices=2, model=str(orbax), wait=False)
        expected = reference(one)
        group.serving()
        with grpc.insecure_channel(f"127.0.0.1:{group.grpc_port}") as channel:
            info = pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert info.num_processes == 2 and list(info.mesh_shape) == [1, 4], info
        worst = 0.0
        answers = [group.complete(prompt) for prompt in PROMPTS]
        for prompt, got, ref in zip(PROMPTS, answers, expected, strict=True):
            assert got["tokens"] == ref["tokens"], (prompt, got["tokens"], ref["tokens"])
            worst = max(worst, float(np.abs(np.subtract(got["token_logprobs"], ref["token_logprobs"])).max()))
            for a, b in zip(got["top_logprobs"], ref["top_logprobs"]):
                common = set(a) & set(b)
                assert len(common) >= 4  # a near-tie at the 5th place may swap
                worst = max(worst, max(abs(a[t] - b[t]) for t in common))
        figure(
            f"multihost: 2 processes x 2 devices vs 1 process x 4: greedy tokens equal, max |Δ logprob| {worst:.1e}"
        )
        assert worst <= TP_TOL
        # a weight update is loaded and swapped on every process (the same checkpoint: the same answers after)
        r = httpx.post(f"{group.base}/v1/admin/update_weights", timeout=300,
                       headers={"authorization": f"Bearer {ADMIN_KEY}"},
                       json={"model_path": str(orbax), "weight_version": "v2"})  # fmt: skip
        assert r.status_code == 200 and r.json()["weight_version"] == "v2", r.text
        assert group.complete(PROMPTS[0]) == answers[0]
        for name, lines in group.logs.items():
            assert any("weights swapped: serving version 'v2'" in line for line in lines), (
                name,
                group.log_tail(),
            )
        # SIGTERM while a request runs: it completes, then both processes exit 0
        done: list[httpx.Response] = []
        body = {"model": group.model, "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0}
        t = threading.Thread(
            target=lambda: done.append(httpx.post(f"{group.base}/v1/completions", json=body, timeout=300))
        )
        t.start()
        started = wait_until(lambda: bool(done) or group.active_slots() >= 1, timeout=60, step=0.05)
        assert started, "the request never started"
        group.leader.send_signal(signal.SIGTERM)
        t.join(300)
        assert done and done[0].status_code == 200, done and done[0].text
        assert done[0].json()["usage"]["completion_tokens"] == 16
        assert group.wait(90) == [0, 0], group.log_tail()
    finally:
        one.stop()
        if group is not None:
            group.stop()


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_lost_follower_gives_503_and_the_leader_exits_1(tmp_path, fault, figure):
    """killed (SIGKILL): the collectives usually fail at once. stopped (SIGSTOP): they wait, and the watchdog ends
    the group after --peer-timeout (10 s here), before JAX's own heartbeats would (SIGABRT)."""
    group = Group(tmp_path, processes=2, devices=2, peer_timeout=10.0)
    try:
        # one request first compiles the programs the two below take: otherwise the first one's compile (39 s seen
        # on a loaded machine) can hold the second's start until the first is done, and two never run together
        group.complete(PROMPTS[0], max_tokens=2, logprobs=None)
        results: list[httpx.Response] = []
        body = {"model": group.model, "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0}
        threads = [
            threading.Thread(
                target=lambda: results.append(
                    httpx.post(f"{group.base}/v1/completions", json=body, timeout=120)
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        assert wait_until(lambda: group.active_slots() >= 2, timeout=60, step=0.05), (
            "the requests never started"
        )
        started = time.monotonic()
        os.killpg(group.followers[0].pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        for t in threads:
            t.join(120)
        assert [r.status_code for r in results] == [503, 503], [r.text for r in results]
        assert all(r.json()["error"]["code"] == "service_unavailable" for r in results)
        assert all("the group" in r.json()["error"]["message"] for r in results), [r.text for r in results]
        code = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = group.leader.wait(60)
        took = time.monotonic() - started
        figure(f"multihost: follower {fault}: 503s, the leader exited {code} after {took:.1f} s")
        assert code == 1, group.log_tail()
        # killed: the collective in flight usually fails at once (exit after ~2.5 s, the grace included); in about
        # one full-suite run in four here it blocked instead and the watchdog ended the group after --peer-timeout
        # (12.5-12.7 s seen; cause not found). Either way the clients got their 503s and the leader exited 1.
        assert took < 25
        if fault == "killed":
            assert group.followers[0].wait(5) == -signal.SIGKILL
    finally:
        group.stop()


def run_backend(*args: str, devices: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices)}
    return subprocess.run(
        [sys.executable, "-m", "tpuserve.cli", "grpc", "--log-format", "text", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_inconsistent_group_flags_fail_at_start_naming_the_flag(tmp_path):
    bad_id = run_backend("--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2")
    assert bad_id.returncode == 2 and "--process-id must be in 0..1" in bad_id.stderr
    alone = run_backend("--num-processes", "2")
    assert (
        alone.returncode == 2
        and "--coordinator, --num-processes and --process-id go together" in alone.stderr
    )
    config = write_config(tmp_path, "big.yaml")  # model_parallel 4 on this process's 2 devices
    big = run_backend("--config", config, "--port", str(free_port()))
    assert (
        big.returncode == 2
        and "engine.model_parallel 4 x engine.data_parallel 1 needs 4 devices" in big.stderr
    )
    start = time.monotonic()  # a coordinator nobody runs: process 1 gives up after --init-timeout
    lost = run_backend(
        "--coordinator",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--init-timeout",
        "5",
        "--port",
        str(free_port()),
    )
    assert (
        lost.returncode == 2
        and "--coordinator 127.0.0.1:" in lost.stderr
        and "--init-timeout 5" in lost.stderr
    )
    assert time.monotonic() - start < 60
