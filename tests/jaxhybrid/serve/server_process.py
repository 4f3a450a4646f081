"""A real `python -m jaxhybrid.serve` process on a free port, for tests that talk HTTP to it (the
`RemoteOpenAIServer` pattern of vLLM's tests). Buckets are few and small so it compiles in seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SMALL = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--token-buckets", "32",
         "--row-buckets", "4", "--max-model-len", "256", "--num-blocks", "160", "--num-state-slots", "24"]
START_TIMEOUT = 240.0  # seconds to load, compile and answer /health on a 2-core CI machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, cache_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "jaxhybrid.serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--compilation-cache-dir", str(cache_dir), *SMALL, *args]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ))
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {START_TIMEOUT} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def metric(self, name: str) -> float:
        """One unlabelled-or-model-labelled series from /metrics."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(f"jaxhybrid:{name}{{") or line.startswith(f"jaxhybrid:{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_drained(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and every block and slot is free; after `timeout`
        seconds of polls, the last values (the callers assert they are all zero)."""
        names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "state_slot_usage_perc")
        for _ in range(int(timeout / 0.1)):
            values = {n: self.metric(n) for n in names}
            if not any(values.values()):
                return values
            time.sleep(0.1)
        return {n: self.metric(n) for n in names}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
