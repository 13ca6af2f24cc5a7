"""The gRPC backend's settings: `ServerSettings` (the keys of a YAML file's `server:` section) beside the
engine's `EngineConfig` (the `engine:` section), the backend's flags (`parser`), and `parse_args`: the flags
on the defaults, for a run of this layer on its own (`python -m tpuserve.grpc_service`). `tpuserve grpc` and
`tpuserve serve` (cli/backend.py) also read the `--config` file, with these flags on top. No JAX here:
`tpuserve serve` checks the backend's command line with it before starting anything."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from tpuserve.sampler.config import EngineConfig

ENGINE_FLAGS = (
    "model",
    "quantization",
    "max_queue",
    "max_n",
    "max_prompt_tokens",
    "max_queue_wait",
    "compilation_cache_dir",
    "rescore_exact",
)

T = TypeVar("T")


@dataclass(frozen=True)
class ServerTLS:
    """Serve gRPC over TLS with `cert_file` (PEM chain) and `key_file`; with `client_ca_file`, clients must
    present a certificate signed by it (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        pair = (pathlib.Path(self.key_file).read_bytes(), pathlib.Path(self.cert_file).read_bytes())
        ca = pathlib.Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ServerSettings:
    """The backend process's settings; the YAML `server:` keys are these fields, the flags their long names."""

    host: str = "0.0.0.0"
    port: int = 50051
    # Prometheus /metrics HTTP port on `host`; 0 = off. None (unset): off for `tpuserve grpc`, GRPC_PORT + 1
    # under `tpuserve serve`.
    metrics_port: int | None = None
    log_prompts: bool = False
    log_format: str = "json"
    drain_timeout: float = 30.0  # seconds in-flight requests get on SIGTERM
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # One model across several processes (hosts of a TPU slice): JAX's distributed runtime. coordinator: process
    # 0's HOST:PORT; all three unset: one process, or on a multi-host Cloud TPU VM slice (TPU_WORKER_HOSTNAMES
    # lists several hosts) what jax.distributed.initialize() detects. Process 0 serves; the others follow.
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # a process silent this long (dead, stopped): NOT_SERVING, UNAVAILABLE, all exit 1
    peer_timeout: float = 30.0
    init_timeout: float = 300.0  # seconds every process waits for the others (and the coordinator) at start
    # The names the model answers to (vLLM's --served-model-name: the first is its id, the others aliases); unset:
    # the model file's or directory's name. A weight update never changes them.
    served_model_name: tuple[str, ...] | None = None
    # UpdateWeights' bearer key (docs/weight-updates.md); unset: $TPUSERVE_ADMIN_KEY, and without it updates are off
    admin_key: str | None = dataclasses.field(default=None, repr=False)
    weight_version: str = "default"  # the version of the weights served at start (answers carry it)

    def __post_init__(self) -> None:
        if self.served_model_name is not None:
            names = (
                (self.served_model_name,)
                if isinstance(self.served_model_name, str)
                else self.served_model_name
            )
            object.__setattr__(self, "served_model_name", tuple(names))
            if not names or any(not n.strip() for n in names):
                raise ValueError("--served-model-name needs one or more non-empty names")
        if not self.weight_version:
            raise ValueError("--weight-version must not be empty")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, not {self.log_format!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both --tls-cert-file and --tls-key-file")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        group = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in group) and any(v is None for v in group):
            raise ValueError("--coordinator, --num-processes and --process-id go together (none: one process, "
                             "or what jax.distributed detects on a Cloud TPU slice)")  # fmt: skip
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"--num-processes must be at least 1, not {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or 1):
            raise ValueError(f"--process-id must be in 0..{(self.num_processes or 1) - 1} (--num-processes "
                             f"{self.num_processes}), not {self.process_id}")  # fmt: skip
        if self.coordinator is not None and not _is_host_port(self.coordinator):
            raise ValueError(f"--coordinator must be HOST:PORT, not {self.coordinator!r}")
        for name in ("peer_timeout", "init_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds")

    def tls(self) -> ServerTLS | None:
        """TLS when a certificate is set, else None (plaintext)."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return ServerTLS(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)


DEFAULTS = ServerSettings()  # what the flags' help says when a flag is not given
ENGINE_DEFAULTS = EngineConfig()


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def add_quantization_flag(p: argparse.ArgumentParser) -> None:
    """--quantization (engine.quantization), here and on `tpuserve serve`, which hands it to the backend."""
    p.add_argument(
        "--quantization",
        default=None,
        choices=("none", "keep", "int8", "w8a8"),
        help="weights in memory: none (all in dtype), keep (a GGUF's quantized blocks), int8 (per channel), "
        "w8a8 (int8 per channel times int8 activations: integer products, other logprobs); "
        "default: the source's (GGUF: see docs/engine.md)",
    )


ADMIN_KEY_ENV = "TPUSERVE_ADMIN_KEY"


def add_names_flags(p: argparse._ActionsContainer) -> None:
    """--served-model-name and --admin-key, here and on `tpuserve serve`, which hands them to the backend."""
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names the model answers to (the first is its id); default: the model's file or "
                        "directory name")  # fmt: skip
    p.add_argument("--admin-key", default=None,
                   help=f"bearer key of the weight-update endpoints (default ${ADMIN_KEY_ENV}; unset: off)")  # fmt: skip


def add_rescore_flag(p: argparse._ActionsContainer) -> None:
    """--rescore-exact (engine.rescore_exact), here and on `tpuserve serve`."""
    p.add_argument("--rescore-exact", action="store_true", default=None,
                   help="sampled logprobs equal a re-score (echo) bit for bit, for RL; prefill is slower "
                        "(docs/engine.md)")  # fmt: skip


def parser(prog: str = "python -m tpuserve.grpc_service") -> argparse.ArgumentParser:
    """The backend's flags (`dest` = the field's name, None when not given): the server's and ENGINE_FLAGS."""
    p = argparse.ArgumentParser(prog=prog, description="Serve a model over gRPC (tpuserve.v1).")
    p.add_argument("--host", default=None, help=f"default {DEFAULTS.host}")
    p.add_argument("--port", type=int, default=None, help=f"default {DEFAULTS.port}")
    p.add_argument("--model", default=None, help="GGUF file, HF model directory or Orbax checkpoint")
    add_quantization_flag(p)
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help=f"requests waiting for a slot (then RESOURCE_EXHAUSTED); default {ENGINE_DEFAULTS.max_queue}",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=None,
        help=f"most samples per request (capped at the slots); default {ENGINE_DEFAULTS.max_n}",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt accepted (default: context length)",
    )
    p.add_argument(
        "--compilation-cache-dir",
        default=None,
        help="JAX's persistent compilation cache (default $XDG_CACHE_HOME/tpuserve; 'none' = off)",
    )
    p.add_argument(
        "--max-queue-wait",
        type=float,
        default=None,
        help="seconds a request may wait for a slot, then RESOURCE_EXHAUSTED (default: no limit)",
    )
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this HTTP port (0 = off)"
    )
    p.add_argument(
        "--log-prompts",
        action="store_true",
        default=None,
        help="include prompts in the per-request log lines",
    )
    p.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=None,
        help=f"default {DEFAULTS.log_format} (the tpuserve command; a run of this module alone logs text)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help=f"seconds in-flight requests get on SIGTERM (default {DEFAULTS.drain_timeout:g})",
    )
    p.add_argument(
        "--tls-cert-file", default=None, help="serve gRPC over TLS with this PEM certificate (chain)"
    )
    p.add_argument("--tls-key-file", default=None, help="the PEM private key of --tls-cert-file")
    p.add_argument(
        "--tls-client-ca-file",
        default=None,
        help="require client certificates signed by this CA (mutual TLS)",
    )
    g = p.add_argument_group("weights and names (docs/weight-updates.md)")
    add_names_flags(g)
    add_rescore_flag(g)
    g.add_argument("--weight-version", default=None,
                   help=f"the version of the weights served at start (default {DEFAULTS.weight_version})")  # fmt: skip
    g = p.add_argument_group(
        "several processes (one model across the hosts of a TPU slice; docs/multiprocess.md)"
    )
    g.add_argument(
        "--coordinator", default=None, metavar="HOST:PORT", help="process 0's address (jax.distributed)"
    )
    g.add_argument("--num-processes", type=int, default=None, help="processes in the group")
    g.add_argument(
        "--process-id", type=int, default=None, help="this process's index; 0 serves, the others follow"
    )
    g.add_argument("--peer-timeout", type=float, default=None,
                   help="seconds a silent process is waited for, then every process exits 1 "
                        f"(default {DEFAULTS.peer_timeout:g})")  # fmt: skip
    g.add_argument("--init-timeout", type=float, default=None,
                   help="seconds to wait for the coordinator and the other processes at start "
                        f"(default {DEFAULTS.init_timeout:g})")  # fmt: skip
    return p


def parse_args(argv: Sequence[str] | None) -> tuple[ServerSettings, EngineConfig]:
    """The flags that were given on the defaults (no settings file: `tpuserve grpc --config` reads one). A bad
    setting exits with a usage error naming it."""
    p = parser()
    ns = p.parse_args(argv)
    try:
        return _given(ServerSettings(), ns), _given(EngineConfig(), ns)
    except ValueError as e:
        p.error(str(e))


def _given(defaults: T, ns: argparse.Namespace) -> T:
    """`defaults` with the flags in `ns` that are its fields and were given (not None)."""
    names = [f.name for f in dataclasses.fields(defaults)]  # type: ignore[arg-type]
    given = {k: getattr(ns, k) for k in names if getattr(ns, k, None) is not None}
    return dataclasses.replace(defaults, **given)  # type: ignore[type-var]
