"""SIGTERM on the real server: admission stops, in-flight requests finish within --shutdown-timeout (or are
cut at once with 0), and the process exits promptly (vLLM's test_shutdown.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.jaxhybrid.serve.server_process import ServerProcess

BODY = {"prompt": "def read_config(path):\n", "max_tokens": 150, "ignore_eos": True, "stream": True}


def _stream_in_thread(url: str, lines: list[str], started: threading.Event) -> threading.Thread:
    def read() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=BODY, timeout=120) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
        except httpx.TransportError as error:  # the server cut the connection
            lines.append(f"transport error: {error!r}")
        started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _wait_until_refused(url: str, seconds: float = 60.0) -> None:
    """Poll (bounded) until the server stops taking connections: it handles SIGTERM whenever it is scheduled."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/version", timeout=5)
        except httpx.TransportError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server still takes connections {seconds} s after SIGTERM")


# A drain long enough for the stream to finish on a loaded 2-core machine (it ends as soon as the stream does).
@pytest.mark.parametrize("timeout", [120, 0])
def test_sigterm_drains_then_exits(tmp_path_factory, timeout):
    tmp = tmp_path_factory.mktemp(f"shutdown{timeout}")
    server = ServerProcess(["--shutdown-timeout", str(timeout)], tmp / "server.log",
                           tmp_path_factory.getbasetemp() / "compile-cache")
    try:
        lines, started = [], threading.Event()
        reader = _stream_in_thread(server.url, lines, started)
        assert started.wait(60), server.log()
        server.process.terminate()
        _wait_until_refused(server.url)
        with pytest.raises(httpx.TransportError):  # admission has stopped: the socket is closed
            httpx.post(f"{server.url}/v1/completions", json={**BODY, "stream": False}, timeout=5)
        reader.join(150)
        assert not reader.is_alive()
        began = time.monotonic()
        code = server.process.wait(60)
        assert code in (0, -15), server.log()
        assert time.monotonic() - began < 10
    finally:
        server.stop(timeout=5)
    if timeout:  # drained: the whole completion arrived
        assert lines[-1] == "data: [DONE]", lines[-3:]
        finals = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
        assert finals[-1]["finish_reason"] == "length"
        assert "".join(c["text"] for c in finals)
    else:  # cut at once: the stream never completed
        assert lines[-1] != "data: [DONE]" or '"abort"' in lines[-2]
