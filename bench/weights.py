"""The `weights` row group of `make bench`: new weights without a restart (docs/weight-updates.md) against a
restart, on the embedded model as an Orbax checkpoint (fp32, written by `tpuserve convert`'s code).

  weight_update   POST /v1/admin/update_weights of that checkpoint while the server is idle, request in -> answer
                  (load beside the served weights, check, swap), median of 3, over the seconds a restart of
                  `tpuserve serve` on the same checkpoint takes from launch to /health 200 (its second start:
                  the compilation cache warm, as a restart finds it). Target <= 0.2.
The answers after the updates must be the ones before (the same weights), else the row fails."""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import httpx

from bench import clients, servers
from bench.rows import COMPLETIONS, log, median
from bench.table import FAILED, Row, Target, judged, not_run

ADMIN_KEY = "bench-admin-key"
NAME = "weight update (Orbax, idle) vs a restart to /health 200"
TARGET = Target("<=", 0.2)


def _greedy(base_url: str, model: str) -> list[Any]:
    body = {
        "model": model,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": 2,
    }
    r = httpx.post(base_url + COMPLETIONS, json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


def weight_rows(config: str | None, workdir: pathlib.Path, reps: int, raw: dict, external: bool) -> list[Row]:
    if external:
        return [not_run("weight_update", NAME, TARGET, "needs servers this run starts (not --tpuserve-url)")]
    from tpuserve.model.loader import convert  # JAX in this process only for this group

    checkpoint = workdir / "embedded-orbax"
    log("weights: writing the embedded model as an Orbax checkpoint")
    convert(None, checkpoint)
    paths = servers.config_variants(workdir, config, "weights", {"orbax": {"model": str(checkpoint)}})
    env = {"XDG_CACHE_HOME": str(workdir / "xdg-cache-weights"), "TPUSERVE_ADMIN_KEY": ADMIN_KEY}
    restart_s = []
    with servers.Servers() as pool:
        for attempt in ("first start", "restart"):
            log(f"weights: {attempt} of tpuserve serve on the checkpoint")
            server = pool.start(servers.tpuserve(workdir, paths["orbax"], name=f"tpuserve-weights-{len(restart_s)}",
                                                 env=env))  # fmt: skip
            restart_s.append(server.wait_ready(1200))
            if attempt == "first start":
                server.stop()
        _, text = clients.run(lambda: clients.get_text(server.base_url, "/v1/models"))
        model = json.loads(text)["data"][0]["id"]
        before = _greedy(server.base_url, model)
        update_s = []
        for rep in range(max(reps, 3)):
            server.wait_idle()
            start = time.perf_counter()
            r = httpx.post(server.base_url + "/v1/admin/update_weights", timeout=600,
                           headers={"authorization": f"Bearer {ADMIN_KEY}"},
                           json={"model_path": str(checkpoint), "weight_version": f"bench-{rep}"})  # fmt: skip
            update_s.append(time.perf_counter() - start)
            if r.status_code != 200 or not r.json().get("success"):
                return [
                    Row(
                        "weight_update",
                        NAME,
                        "—",
                        "—",
                        None,
                        TARGET.text(),
                        FAILED,
                        f"update: {r.text[:300]}",
                    )
                ]
        if _greedy(server.base_url, model) != before:
            return [Row("weight_update", NAME, "—", "—", None, TARGET.text(), FAILED,
                        "the answers changed after updating to the same weights")]  # fmt: skip
    raw["weights"] = {"update_s": update_s, "start_s": restart_s}
    update, restart = median(update_s), restart_s[1]
    return [judged("weight_update", NAME, f"{update:.2f} s", f"restart: {restart:.1f} s (first start {restart_s[0]:.1f} s)",
                   update / restart, TARGET)]  # fmt: skip
