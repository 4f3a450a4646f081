"""`python -m jaxhybrid.serve`: the OpenAI-compatible server, on the embedded default model without `--model`.

Flags are vLLM's where the concept exists (both `--max-num-seqs` and `--max_num_seqs` spellings, `--no-`
forms for booleans, JSON for `--speculative-config`); `--config FILE` reads the same flags from YAML
(see `configs/`), and flags given on the command line win. Start-up logs what was built and how long
each phase took: loading, the pools, compiling every bucket.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import yaml

log = logging.getLogger("jaxhybrid.serve")

# flag -> argparse keywords; the dest is the flag's name with underscores
_FLAGS: dict[str, dict] = {
    "--model": dict(default=None, help="checkpoint directory (default: the embedded model)"),
    "--tokenizer": dict(default=None, help="tokenizer directory (default: the model's)"),
    "--skip-tokenizer-init": dict(action=argparse.BooleanOptionalAction, default=False,
                                  help="serve token-id prompts only (no tokenizer files needed)"),
    "--host": dict(default="0.0.0.0"),
    "--port": dict(type=int, default=8000),
    "--served-model-name": dict(nargs="+", default=None, help="names clients use (default: the model path)"),
    "--api-key": dict(nargs="+", default=None, help="Bearer keys for /v1/* (env JAXHYBRID_API_KEY)"),
    "--max-num-seqs": dict(type=int, default=32),
    "--max-num-batched-tokens": dict(type=int, default=512),
    "--max-model-len": dict(type=int, default=None),
    "--max-num-queued-requests": dict(type=int, default=None,
                                      help="sequences queued or running before new requests get 429"),
    "--enable-prefix-caching": dict(action=argparse.BooleanOptionalAction, default=True),
    "--speculative-config": dict(type=json.loads, default=None,
                                 help='e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\''),
    "--replayssm-window": dict(type=int, default=16, help="W, the ReplaySSM ring"),
    "--seed": dict(type=int, default=0),
    "--gpu-memory-utilization": dict(type=float, default=0.9),
    "--num-blocks": dict(type=int, default=None),
    "--num-state-slots": dict(type=int, default=None),
    "--block-size": dict(type=int, default=16),
    "--mamba-block-size": dict(type=int, default=64),
    "--max-logprobs": dict(type=int, default=20),
    "--dtype": dict(default="float32"),
    "--tensor-parallel-size": dict(type=int, default=1),
    "--token-buckets": dict(type=int, nargs="+", default=None, help="step token buckets (default: a ladder)"),
    "--row-buckets": dict(type=int, nargs="+", default=None),
    "--bucket-growth": dict(type=int, default=4, help="ratio between default buckets (fewer shapes to compile)"),
    "--precompile": dict(action=argparse.BooleanOptionalAction, default=True,
                         help="compile every bucket before serving"),
    "--compilation-cache-dir": dict(default=str(Path.home() / ".cache" / "jaxhybrid" / "xla"),
                                    help="compiled steps persist here across restarts ('' turns it off)"),
    "--shutdown-timeout": dict(type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests"),
    "--watchdog-timeout": dict(type=float, default=120.0,
                               help="/health is 503 when requests wait and no step ends for this long"),
    "--uvicorn-log-level": dict(default="warning"),
    "--config": dict(default=None, help="YAML file of these flags (command-line flags win)"),
}
_LLM_ARGS = ("tokenizer", "skip_tokenizer_init", "enable_prefix_caching", "speculative_config", "max_num_seqs",
             "max_num_batched_tokens", "max_model_len", "seed", "gpu_memory_utilization", "num_blocks",
             "num_state_slots", "replayssm_window", "block_size", "mamba_block_size", "max_logprobs", "dtype",
             "bucket_growth", "compilation_cache_dir")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxhybrid.serve", description=__doc__.splitlines()[0])
    for flag, keywords in _FLAGS.items():
        p.add_argument(flag, *([flag.replace("-", "_").replace("__", "--")] if "-" in flag[2:] else []), **keywords)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags from `argv`, over the YAML `--config` file, over the defaults."""
    p = parser()
    args = p.parse_args(argv)
    if args.config:
        values = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(values, dict):
            p.error(f"--config {args.config}: expected a mapping of flag names to values")
        defaults = {name.lstrip("-").replace("-", "_"): value for name, value in values.items()}
        unknown = sorted(set(defaults) - {f.lstrip("-").replace("-", "_") for f in _FLAGS})
        if unknown:
            p.error(f"--config {args.config}: unknown keys {unknown}")
        p.set_defaults(**defaults)
        args = p.parse_args(argv)
    if args.tensor_parallel_size != 1:
        p.error("--tensor-parallel-size: this build serves on one device (tensor parallelism is not built yet)")
    if not args.api_key and os.environ.get("JAXHYBRID_API_KEY"):
        args.api_key = [os.environ["JAXHYBRID_API_KEY"]]
    return args


def build_server(args: argparse.Namespace):
    """The LLM, the engine loop and the app, with the start-up report; returns (app, state)."""
    from jaxhybrid.api import LLM
    from jaxhybrid.metrics import ServerMetrics
    from jaxhybrid.serve.app import ServerState, build_app
    from jaxhybrid.serve.engine_loop import EngineLoop
    from jaxhybrid.weights import DEFAULT_MODEL_DIR

    start = time.perf_counter()
    args.compilation_cache_dir = args.compilation_cache_dir or None
    llm = LLM(args.model, **{name: getattr(args, name) for name in _LLM_ARGS},
              token_buckets=tuple(args.token_buckets or ()), row_buckets=tuple(args.row_buckets or ()))
    loaded = time.perf_counter()
    config = llm.config
    log.info("model %s loaded in %.1f s", args.model or "(embedded default)", loaded - start)
    log.info("cache mode %s; %d KV blocks of %d tokens; %d state slots (ring W=%d, MTP K=%d); max_num_seqs %d; "
             "max_model_len %d", config.cache_mode, config.num_blocks - 1, config.block_size,
             config.num_state_slots - 1, config.ring_size, config.num_spec_tokens, config.max_num_seqs,
             config.max_model_len)
    if args.precompile:
        count = llm.engine.runner.precompile()
        log.info("compiled %d buckets in %.1f s (token buckets %s, row buckets %s)", count,
                 time.perf_counter() - loaded, config.token_buckets, config.row_buckets)
    names = tuple(args.served_model_name or [str(args.model or "jaxhybrid-default")])
    cache_info = {"block_size": str(config.block_size), "mamba_block_size": str(config.mamba_block_size),
                  "cache_mode": config.cache_mode, "num_gpu_blocks": str(config.num_blocks - 1),
                  "num_state_slots": str(config.num_state_slots - 1), "replayssm_window": str(config.ring_size),
                  "num_speculative_tokens": str(config.num_spec_tokens)}
    metrics = ServerMetrics(names[0], config.max_model_len, config.num_spec_tokens, cache_info)
    loop = EngineLoop(llm.engine, metrics, max_queued=args.max_num_queued_requests,
                      watchdog_timeout=args.watchdog_timeout)
    state = ServerState(llm, loop, names, str(args.model or DEFAULT_MODEL_DIR), config.max_model_len)
    return build_app(state, tuple(args.api_key or ())), state


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    shown = {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()
             if v != parser().get_default(k)}
    log.info("non-default arguments: %s", shown)
    app, state = build_server(args)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # SIGTERM/SIGINT: refuse new work, drain the rest
            state.loop.draining = True
            log.info("signal %s: draining for up to %.0f s", signal.Signals(sig).name, args.shutdown_timeout)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                   timeout_graceful_shutdown=args.shutdown_timeout))
    log.info("serving %s on http://%s:%d", ", ".join(state.model_names), args.host, args.port)
    server.run()  # after a signal, uvicorn re-raises it once drained: the exit status is -SIGTERM, as vLLM's


if __name__ == "__main__":
    main()
