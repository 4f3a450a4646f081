"""Server start-up: seconds from launch to `/health` 200 with an empty compilation cache (cold) and again with
the cache the cold start filled (warm), and how many programs each start added to the cache. A warm start
that adds none recompiled nothing.

Each side is a checkout run as `python -m jaxhybrid.serve` on the embedded default model with the same flags;
`--baseline PATH` adds another checkout (e.g. a `git worktree` of the commit before a change), measured in the
same run, A then B, cold then warm each:

    python -m benchmarks.startup --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from benchmarks.common import write_results

ROOT = Path(__file__).resolve().parents[1]
HEALTH_TIMEOUT_S = 1200


def cache_entries(cache: Path) -> int:
    return sum(1 for path in cache.rglob("*") if path.is_file())


def start_once(checkout: Path, cache: Path, port: int, flags: list[str]) -> float:
    """Seconds until the server launched from `checkout` answers /health 200; the server is then stopped."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "jaxhybrid.serve", "--port", str(port), "--compilation-cache-dir", str(cache),
               *flags]
    start = time.perf_counter()
    server = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while time.perf_counter() - start < HEALTH_TIMEOUT_S:
            if server.poll() is not None:
                raise RuntimeError(f"the server from {checkout} exited: {server.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"no /health 200 from {checkout} within {HEALTH_TIMEOUT_S} s")
    finally:
        server.terminate()
        server.wait(60)


def measure(name: str, checkout: Path, port: int, flags: list[str], progress: tqdm) -> dict:
    with tempfile.TemporaryDirectory(prefix="startup-cache-") as folder:
        cache, row = Path(folder), {"side": name, "checkout": str(checkout)}
        for start in ("cold", "warm"):
            before = cache_entries(cache)
            row[f"{start}_s"] = round(start_once(checkout, cache, port, flags), 1)
            row[f"{start}_new_programs"] = cache_entries(cache) - before
            progress.update()
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="server flags for both sides")
    args = parser.parse_args()
    sides = [("this checkout", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    with tqdm(total=2 * len(sides), desc="starts", unit="start") as progress:
        rows = [measure(name, checkout, args.port, args.flags, progress) for name, checkout in sides]
    print(f"{'side':<16} {'cold s':>8} {'programs':>9} {'warm s':>8} {'programs':>9}")
    for row in rows:
        print(f"{row['side']:<16} {row['cold_s']:>8} {row['cold_new_programs']:>9} {row['warm_s']:>8} "
              f"{row['warm_new_programs']:>9}")
    write_results("startup", rows, {"flags": args.flags, "cores_each_side": os.cpu_count()})


if __name__ == "__main__":
    main()
