"""The `multihost` row group of `make bench` (issue 14): one model across two JAX processes, as
`make serve-multihost` runs it, against the same model in one process, same engine settings (model_parallel 4,
16 slots, a 512-token context; the embedded model unless `--config` names another), same run.

  2 processes  process 0 `JAX_NUM_CPU_DEVICES=2 tpuserve serve` (gateway + gRPC; its config's `server:` names a
               coordinator on a free port, num_processes 2, process_id 0) and process 1
               `JAX_NUM_CPU_DEVICES=2 tpuserve grpc --process-id 1` alongside: 2 CPU devices each, the model split
               4 ways across both, JAX's collectives between the processes over gloo (TCP on this machine)
  1 process    `JAX_NUM_CPU_DEVICES=4 tpuserve serve`, no process group: the same 4-way split in one process

  multihost          16 concurrent streamed /v1/completions (~15-token prompts, temperature 1, seeded) x 32 tokens
                     (8 with --quick), first request sent -> last token received, prefill included: tok/s,
                     2 processes over 1 process (>= 0.7x)
  multihost_single   DIAGNOSTIC: one stream x 16 tokens (8 with --quick), request sent -> last token: tok/s of each

Only one of the two servers is loaded at a time (each is started, measured and stopped; an idle process group
still costs this 2-core machine), and the repetitions alternate ABBA-wise (2p, 1p | 1p, 2p | 2p, 1p ...) so a
server measured at the end of one repetition is measured again, still loaded, at the start of the next: one
start per repetition instead of two. Medians over at most 2 repetitions (`--reps`, capped: every start
compiles for a minute or more, warm compilation cache or not). Both processes' logs are in the work directory.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from bench import clients, servers, workload
from bench.rows import COMPLETIONS, log, median
from bench.table import DIAGNOSTIC, FAILED, Row, Target, judged, not_run

ENGINE = {"model_parallel": 4, "slots": 16, "max_seq_len": 512}
STREAMS = 16
TARGET = Target(">=", 0.7)
MAX_REPS = 2
SIDES = ("2p", "1p")  # the measured side, then the baseline
TITLE = {"2p": "2 processes x 2 devices", "1p": "1 process x 4 devices"}
# NPROC sizes XLA's CPU thread pools (else the machine's cores, 2 here): with 4 in-process devices on 2 cores the
# 1-process server deadlocked within two rounds of 16 streams (an in-process all-gather waited for a 4th participant
# queued behind the 3 blocked in it: "Expected 4 threads to join the rendezvous", abort after 40 s); NPROC=4 did
# too, NPROC=8 ran clean. The 2-process group (2 local participants per process) needs no such setting.
BASELINE_ENV = {"JAX_NUM_CPU_DEVICES": "4", "NPROC": "8"}
BOUND = (
    "what bounds it: every layer's model-parallel all-reduces cross between the two processes over gloo (TCP on "
    "this machine) and the leader broadcasts each step's inputs to the follower; the 1-process server's "
    "collectives stay in one process's memory"
)


def _configs(workdir: pathlib.Path, base: str | None) -> dict[str, str]:
    """`multihost-2p.yaml` (a `server:` group section for 2 processes, coordinator on a free port) and
    `multihost-1p.yaml` (no group): `base`'s settings (or the defaults) with ENGINE on top of its `engine:`."""
    doc: dict[str, Any] = yaml.safe_load(pathlib.Path(base).read_text()) if base else {}
    engine = {**(doc.get("engine") or {}), **ENGINE}
    rest = {k: v for k, v in doc.items() if k not in ("engine", "server")}
    group_keys = ("coordinator", "num_processes", "process_id")
    server = {k: v for k, v in (doc.get("server") or {}).items() if k not in group_keys}
    group = {**server, "coordinator": f"127.0.0.1:{servers.free_port()}", "num_processes": 2, "process_id": 0}
    group.setdefault("init_timeout", 300.0)
    out = {}
    for name, section in (("2p", group), ("1p", server)):
        path = workdir / f"multihost-{name}.yaml"
        path.write_text(
            yaml.safe_dump({**rest, "engine": engine, **({"server": section} if section else {})})
        )
        out[name] = str(path)
    return out


@dataclass
class Group:
    """One side: the serving process (gateway + backend) and, for 2 processes, the follower."""

    name: str
    leader: servers.Server
    followers: list[servers.Server] = field(default_factory=list)
    ready_s: float | None = None
    follower_exits: list[int | None] = field(default_factory=list)

    @property
    def all(self) -> list[servers.Server]:
        return [self.leader, *self.followers]

    def logs(self) -> str:
        return ", ".join(str(s.log_path) for s in self.all)

    def wait_ready(self, timeout_s: float) -> float:
        """Poll the leader's /health until 200; raises if any process exits first or time runs out."""
        start = time.monotonic()
        while True:
            for s in self.all:
                if s.proc is not None and s.proc.poll() is not None:
                    tails = "\n".join(f"--- {x.name}\n{x.log_tail(15)}" for x in self.all)
                    raise RuntimeError(f"{s.name} exited with {s.proc.returncode} during start-up:\n{tails}")
            status, _ = asyncio.run(clients.get_text(self.leader.base_url, "/health", timeout=2.0))
            if status == 200:
                self.ready_s = time.monotonic() - start
                return self.ready_s
            if time.monotonic() - start > timeout_s:
                tails = "\n".join(f"--- {x.name}\n{x.log_tail(15)}" for x in self.all)
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{tails}")
            time.sleep(1.0)

    def stop(self) -> None:
        """SIGTERM to the leader (it drains, then tells the followers to exit 0); a follower still there 30 s
        later gets SIGTERM, then SIGKILL."""
        self.leader.stop()
        for f in self.followers:
            if f.proc is None:
                continue
            try:
                f.proc.wait(30)
            except subprocess.TimeoutExpired:
                log(f"{f.name} still running 30 s after the leader stopped: stopping it")
                f.stop()
            self.follower_exits.append(f.proc.returncode)


def _start(pool: servers.Servers, workdir: pathlib.Path, side: str, config: str, rep: int) -> Group:
    if side == "1p":
        leader = servers.tpuserve(workdir, config, name=f"tpuserve-multihost-1p-{rep}", env=BASELINE_ENV)
        group = Group(side, leader)
    else:
        env = {"JAX_NUM_CPU_DEVICES": "2"}
        port = servers.free_port_pair()
        follower = servers.Server(
            name=f"tpuserve-multihost-2p-follower-{rep}",
            base_url=f"http://127.0.0.1:{port}",  # gRPC, not HTTP: never polled
            argv=[servers.tpuserve_bin(), "grpc", "--config", config, "--process-id", "1"]
            + ["--host", "127.0.0.1", "--port", str(port)],
            log_path=workdir / f"tpuserve-multihost-2p-follower-{rep}.log",
            env=env,
        )
        leader = servers.tpuserve(workdir, config, name=f"tpuserve-multihost-2p-leader-{rep}", env=env)
        group = Group(side, leader, [follower])
    for s in group.all:  # the follower first: the leader's start waits for the group anyway
        pool.start(s)
    log(f"multihost: {TITLE[side]} starting (logs {group.logs()})")
    group.wait_ready(1200)
    log(f"multihost: {TITLE[side]} ready after {group.ready_s:.0f} s")
    return group


def _batch(group: Group, bodies: list[dict[str, Any]]) -> clients.Batch:
    if not group.leader.wait_idle():
        log(f"multihost: {TITLE[group.name]} still busy after 120 s; measuring anyway")
    batch = clients.run(lambda: clients.concurrent(group.leader.base_url, COMPLETIONS, bodies))
    if batch.errors:
        raise RuntimeError(f"{TITLE[group.name]}: {len(batch.errors)} of {len(bodies)} streams failed, e.g. "
                           f"{batch.errors[0]}")  # fmt: skip
    return batch


def _measure(group: Group, model: str, rep: int, single_tokens: int, tokens: int) -> dict[str, Any]:
    flavour = workload.Flavour(model)
    # warm-up outside the measurement: connections, first-request costs, the 16-row batch once
    _batch(group, workload.completions(flavour, STREAMS, 2, first=900))
    before = group.leader.compiles()
    log(f"multihost: {TITLE[group.name]}, 1 stream x {single_tokens} tokens, repetition {rep + 1}")
    one = _batch(group, workload.completions(flavour, 1, single_tokens, first=100 * rep))
    log(f"multihost: {TITLE[group.name]}, {STREAMS} streams x {tokens} tokens, repetition {rep + 1}")
    many = _batch(group, workload.completions(flavour, STREAMS, tokens, first=100 * rep + 1))
    after = group.leader.compiles()
    log(f"multihost: {TITLE[group.name]}: {many.tok_s:.1f} tok/s at {STREAMS} streams "
        f"({many.tokens} tokens in {many.wall:.1f} s), {one.tok_s:.2f} tok/s at 1")  # fmt: skip
    return {
        "single_tok_s": one.tok_s, "single_tokens": one.tokens, "single_s": one.wall,
        "many_tok_s": many.tok_s, "many_tokens": many.tokens, "many_s": many.wall,
        "compiles": None if before is None or after is None else after - before,
    }  # fmt: skip


def multihost_rows(
    config: str | None, workdir: pathlib.Path, reps: int, quick: bool, raw: dict, external: bool
) -> list[Row]:
    single_tokens, tokens = (8, 8) if quick else (16, 32)
    name = (f"one model over 2 processes x 2 CPU devices vs 1 process x 4 (model_parallel 4): {STREAMS} streams "
            f"x {tokens} tokens, tok/s (wall, prefill incl.)")  # fmt: skip
    if external:
        return [not_run("multihost", name, TARGET, "needs servers this run starts (not --tpuserve-url)")]
    reps = max(1, min(reps, MAX_REPS))
    paths = _configs(workdir, config)
    samples: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    info: dict[str, Any] = {"configs": paths, "ready_s": {s: [] for s in SIDES}, "follower_exits": []}
    raw["multihost"] = {"samples": samples, **info}
    order = [s for rep in range(reps) for s in (SIDES if rep % 2 == 0 else SIDES[::-1])]
    model = None
    with servers.Servers() as pool:
        group: Group | None = None
        for i, side in enumerate(order):
            rep = i // 2
            if group is None or group.name != side:
                if group is not None:
                    group.stop()
                    info["follower_exits"] += group.follower_exits
                group = _start(pool, workdir, side, paths[side], rep)
                info["ready_s"][side].append(round(group.ready_s, 1))
                if model is None:
                    url = group.leader.base_url
                    _, text = clients.run(lambda: clients.get_text(url, "/v1/models"))  # noqa: B023
                    model = json.loads(text)["data"][0]["id"]
            samples[side].append(_measure(group, model, rep, single_tokens, tokens))
        if group is not None:
            group.stop()
            info["follower_exits"] += group.follower_exits
    med = {s: {k: median([x[k] for x in samples[s]]) for k in ("many_tok_s", "single_tok_s")} for s in SIDES}
    ratio = med["2p"]["many_tok_s"] / med["1p"]["many_tok_s"] if med["1p"]["many_tok_s"] else None
    notes = []
    short = [f"{TITLE[s]} made {x['many_tokens']} of {STREAMS * tokens}" for s in SIDES for x in samples[s]
             if x["many_tokens"] < STREAMS * tokens]  # fmt: skip
    if short:
        notes.append("streams ended early (EOS): " + "; ".join(short))
    compiles = {s: [x["compiles"] for x in samples[s]] for s in SIDES}
    if any(c for cs in compiles.values() for c in cs if c):
        notes.append(f"XLA compiles during the measurement: {compiles}")
    ready = ", ".join(f"{TITLE[s]} {'/'.join(f'{t:.0f}' for t in info['ready_s'][s])} s" for s in SIDES)
    notes.append(f"medians of {reps} repetition(s), servers in ABBA order; start-up to /health 200: {ready}")
    notes.append("the 1-process baseline runs with NPROC=8 (XLA CPU thread pools; it deadlocks in an in-process "
                 "all-gather on 2 cores without)")  # fmt: skip
    bad_exits = [c for c in info["follower_exits"] if c != 0]
    row = judged("multihost", name, f"{med['2p']['many_tok_s']:.1f} tok/s",
                 f"1 process: {med['1p']['many_tok_s']:.1f} tok/s", ratio, TARGET)  # fmt: skip
    if row.result != "PASS":
        notes.append(BOUND)
    row = Row(
        row.key, row.name, row.measured, row.baseline, row.ratio, row.target, row.result, "; ".join(notes)
    )
    if bad_exits:
        row = Row(row.key, row.name, row.measured, row.baseline, row.ratio, row.target, FAILED,
                  f"the follower exited {bad_exits} after the leader's SIGTERM (expected 0); {row.note}")  # fmt: skip
    s2, s1 = med["2p"]["single_tok_s"], med["1p"]["single_tok_s"]
    diag = Row("multihost", f"DIAGNOSTIC one model over 2 processes vs 1 process: 1 stream x {single_tokens} "
               "tokens, request → last token", f"{s2:.2f} tok/s", f"1 process: {s1:.2f} tok/s",
               s2 / s1 if s1 else None, "", DIAGNOSTIC)  # fmt: skip
    return [row, diag]
