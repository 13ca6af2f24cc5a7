"""A multi-process group (sampler/multihost.py): joining it, and the channel that carries the leader's engine
commands to every process.

What carries the commands: `jax.experimental.multihost_utils.broadcast_one_to_all`, a jitted broadcast over the
global devices, on fixed 4 KiB frames (one compiled program; a longer command spans several frames). It goes
through the same device queues as the engine's programs, so each command is ordered with the device work
around it on every process, with no transport of ours beside JAX's. Its cost: a command waits for the
device call already queued, then takes a collective of its own (about 4 ms between two idle CPU processes):
decode call k+1 is queued when call k ends rather than while it runs.

Faults: a process that dies fails the collectives it belonged to at once (gloo: connection reset); one that
stops answering leaves them waiting, so the leader sends a no-op command after a second of silence and every
process watches for `peer_timeout` seconds without a completed exchange. Either way `on_fault` runs (the
server turns health NOT_SERVING and ends every open request with UNAVAILABLE) and the process exits 1 shortly
after: a collective cannot be interrupted, and the scheduler restarts the group. JAX's own heartbeats
(`jax.distributed`) stop the processes too, a little later, if this does not.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
from tpuserve.sampler.api import EngineUnavailable

log = logging.getLogger(__name__)

FRAME = 4096  # bytes per broadcast; the first 4 of a command's first frame hold its length
HEARTBEAT_S = 1.0  # the leader's no-op after this much silence
EXIT_GRACE_S = 2.0  # after a fault: time for the error events to reach the clients, then exit 1


def initialize(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    init_timeout: float,
    peer_timeout: float,
) -> tuple[int, int]:
    """Join the process group before anything else touches JAX; -> (process id, number of processes).

    With no coordinator: one process, unless this is one host of a multi-host Cloud TPU VM slice
    (TPU_WORKER_HOSTNAMES lists several hosts), where jax.distributed.initialize() detects the rest itself.
    On CPU the collectives between processes run over gloo. A coordinator that does not answer within
    `init_timeout` raises RuntimeError naming --coordinator."""
    import jax

    if coordinator is None and "," not in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
        return 0, 1
    jax.config.update(
        "jax_cpu_collectives_implementation", "gloo"
    )  # CPU devices only; TPU/GPU have their own
    # JAX's heartbeats end the group (SIGABRT) too: set well past our watchdog's peer_timeout (JAX may notice a
    # stopped process only late in its timeout), so that ours reports the fault and exits first
    options = {"initialization_timeout": max(1, int(init_timeout)),
               "heartbeat_timeout_seconds": 2 * int(peer_timeout) + 30}  # fmt: skip
    log.info("joining the process group: --coordinator %s, --num-processes %s, --process-id %s (waiting up to "
             "--init-timeout %g s; past it JAX ends the process)", coordinator or "(detected)", num_processes,
             process_id, init_timeout)  # fmt: skip
    if coordinator is not None and process_id != 0:
        _wait_for(coordinator, init_timeout)  # else JAX aborts the process with a message that names no flag
    try:
        if coordinator is None:
            jax.distributed.initialize(**options)
        else:
            jax.distributed.initialize(coordinator, num_processes, process_id, **options)
    except Exception as e:
        raise RuntimeError(
            f"--coordinator {coordinator or '(detected)'}: the process group did not form within "
            f"--init-timeout {init_timeout:g} s ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
        ) from e
    return jax.process_index(), jax.process_count()


def _wait_for(address: str, timeout: float) -> None:
    """Until the coordinator accepts a TCP connection; RuntimeError naming the flags after `timeout` seconds."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"--coordinator {address}: nothing answered within --init-timeout {timeout:g} s "
                                   f"({e})") from e  # fmt: skip
            time.sleep(0.5)


class Channel:
    """The leader's commands to every process, in order, over `broadcast_one_to_all`, and the watchdog that
    turns silence or a failed exchange into a fault."""

    def __init__(self, peer_timeout: float, exit_on_fault: bool = True) -> None:
        import jax

        self.leader = jax.process_index() == 0
        self.num_processes = jax.process_count()
        self.peer_timeout = peer_timeout
        self.exit_on_fault = exit_on_fault
        self.lock = threading.RLock()  # a command and the local device work it stands for go out together
        self.on_fault: Callable[[str], None] | None = None
        self.fault: str | None = None
        self.last_ok = time.monotonic()  # the end of the last completed exchange
        self._watching = threading.Event()
        self._stop = threading.Event()

    def _exchange(self, frame: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        try:
            out = np.asarray(multihost_utils.broadcast_one_to_all(frame))
        except Exception as e:
            self.failed(f"a process of the group failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            raise EngineUnavailable(self.fault) from e
        self.last_ok = time.monotonic()
        return out

    def send(self, payload: bytes) -> None:
        """Leader: one command to every process (call with `lock` held, with the local work it stands for)."""
        if self.fault is not None:
            raise EngineUnavailable(self.fault)
        data = len(payload).to_bytes(4, "little") + payload
        for start in range(0, len(data), FRAME):
            frame = np.zeros(FRAME, np.uint8)
            part = np.frombuffer(data[start : start + FRAME], np.uint8)
            frame[: part.size] = part
            self._exchange(frame)

    def receive(self) -> bytes:
        """Follower: the next command."""
        empty = np.zeros(FRAME, np.uint8)
        first = self._exchange(empty)
        size = int.from_bytes(first[:4].tobytes(), "little")
        frames = [first]
        while len(frames) * FRAME < size + 4:
            frames.append(self._exchange(empty))
        return np.concatenate(frames).tobytes()[4 : 4 + size]

    def start_watching(self) -> None:
        """After warm-up (every process ran the same warm-up programs): the leader's heartbeats and the watchdog."""
        self.last_ok = time.monotonic()
        self._watching.set()
        threading.Thread(target=self._watch, name="group-watchdog", daemon=True).start()
        if self.leader:
            threading.Thread(target=self._beat, name="group-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S / 4):
            if time.monotonic() - self.last_ok >= HEARTBEAT_S and self.fault is None:
                with self.lock:
                    if self._stop.is_set() or time.monotonic() - self.last_ok < HEARTBEAT_S:
                        continue
                    try:
                        self.send(pickle.dumps(((), "noop", ())))  # a command (multihost.follow) of no work
                    except Exception:  # noqa: BLE001 — failed() has run
                        return

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            silent = time.monotonic() - self.last_ok
            if silent > self.peer_timeout:
                self.failed(f"no answer from the other processes of the group for {silent:.0f} s "
                            f"(--peer-timeout {self.peer_timeout:g})")  # fmt: skip
                return

    def failed(self, message: str) -> None:
        """A fault (once): tell `on_fault`, then exit 1 after EXIT_GRACE_S (the leader) or at once."""
        if self.fault is not None:
            return
        self.fault = message
        log.error("process group fault: %s", message)
        if self.on_fault is not None:
            try:
                self.on_fault(message)
            except Exception:
                log.exception("the fault handler failed")
        if self.exit_on_fault:
            delay = EXIT_GRACE_S if self.leader else 0.0
            threading.Thread(target=_exit_after, args=(delay,), name="group-exit", daemon=True).start()


def _exit_after(delay: float) -> None:
    time.sleep(delay)
    logging.shutdown()
    os._exit(1)  # a thread may be blocked in a collective that nothing can interrupt
