"""`python -m jaxhybrid.serve`: the OpenAI-compatible server, on the embedded default model without `--model`.

Flags are vLLM's where the concept exists (both `--max-num-seqs` and `--max_num_seqs` spellings, `--no-`
forms for booleans, JSON for `--speculative-config`); `--config FILE` reads the same flags from YAML
(see `configs/`), and flags given on the command line win. Start-up logs what was built and how long
each phase took: loading, the pools, compiling every bucket.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
from collections.abc import Callable

from jaxhybrid.engine.builder import build_engine
from jaxhybrid.flags import TOOL_FLAGS, FlagParser, check_tool_flags, from_namespace, make_parser, non_default
from jaxhybrid.flags import parse_args as parse_flags
from jaxhybrid.malloc import preload_tcmalloc

log = logging.getLogger("jaxhybrid.serve")

_SERVER_FLAGS: dict[str, dict] = {
    "--host": dict(default="0.0.0.0"),
    "--port": dict(type=int, default=8000),
    "--served-model-name": dict(nargs="+", default=None, help="names clients use (default: the model path)"),
    "--root-path": dict(default="", help="the path prefix a path-routing proxy serves this under (FastAPI's "
                        "root_path); paths with and without it are served"),
    "--api-key": dict(nargs="+", default=None, help="Bearer keys for /v1/* (env JAXHYBRID_API_KEY)"),
    "--max-num-queued-requests": dict(type=int, default=None,
                                      help="sequences (n counting n) queued or running before new requests get "
                                      "429 (default: 8 x max_num_seqs)"),
    "--max-num-queued-tokens": dict(type=int, default=None,
                                    help="prompt tokens of the sequences queued or running before new requests get "
                                    "429 (default: 2 x max_num_seqs x max_model_len, two batches of the longest "
                                    "prompts)"),
    "--max-request-body-bytes": dict(type=int, default=None,
                                     help="larger request bodies get 413 before they are parsed (default: 8 MiB)"),
    "--shutdown-timeout": dict(type=float, default=0, help="seconds SIGTERM waits for in-flight requests (0: they "
                               "are aborted at once, as vLLM's default)"),
    "--watchdog-timeout": dict(type=float, default=120.0,
                               help="seconds without a step or an idle wait after which the engine counts as "
                               "stuck: /health answers 503 and the server exits with status 1"),
    "--uvicorn-log-level": dict(default="info", choices=("critical", "error", "warning", "info", "debug", "trace")),
    "--enable-request-id-headers": dict(action=argparse.BooleanOptionalAction, default=False,
                                        help="echo X-Request-Id (or a fresh id) in every response's headers"),
    "--enable-tokenizer-info-endpoint": dict(action=argparse.BooleanOptionalAction, default=False,
                                             help="serve GET /tokenizer_info (the tokenizer's config, chat template)"),
    "--enable-prompt-tokens-details": dict(action=argparse.BooleanOptionalAction, default=False,
                                           help="usage.prompt_tokens_details.cached_tokens in every response"),
    "--enable-force-include-usage": dict(action=argparse.BooleanOptionalAction, default=False,
                                         help="usage on every chunk of every stream, whatever stream_options say"),
    "--chat-template-content-format": dict(choices=("auto", "string", "openai"), default="auto",
                                           help="message content for the chat template: text parts joined "
                                           "(string), the parts with their fields (openai), or what the "
                                           "template reads (auto)"),
    "--enable-server-load-tracking": dict(action=argparse.BooleanOptionalAction, default=False,
                                          help="serve GET /load: the completions and chat requests in flight"),
    **TOOL_FLAGS,
    "--exclude-tools-when-tool-choice-none": dict(action=argparse.BooleanOptionalAction, default=False,
                                                  help='tool_choice "none" keeps the tools out of the chat template'),
    "--disable-log-stats": dict(action="store_true", default=False,
                                help="no periodic stats line (throughput, queue, cache usage and hit rates, every "
                                "VLLM_LOG_STATS_INTERVAL seconds, 10 by default)"),
    "--enable-log-requests": dict(action=argparse.BooleanOptionalAction, default=False,
                                  help="log each request as it arrives (id, prompt, sampling parameters) and ends"),
    "--max-log-len": dict(type=int, default=None, help="prompt characters --enable-log-requests logs (default: all)"),
}


PROG = "python -m jaxhybrid.serve"


def parser(prog: str = PROG) -> FlagParser:
    flags = make_parser(prog, __doc__.splitlines()[0], _SERVER_FLAGS)
    flags.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model (vLLM's positional)")
    return flags


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    flags = parser(prog)
    args = parse_flags(flags, argv)
    check_tool_flags(flags, args)
    if not args.api_key and os.environ.get("JAXHYBRID_API_KEY"):
        args.api_key = [os.environ["JAXHYBRID_API_KEY"]]
    return args


def build_server(args: argparse.Namespace, on_stuck: Callable[[str], None] | None = None):
    """The engine, the engine loop and the app, with the start-up report; returns (app, state). `on_stuck` is
    called once if the engine thread dies or stops coming round its loop."""
    from jaxhybrid.engine.stat_logger import RequestLogger, StatLogger
    from jaxhybrid.models.weights import DEFAULT_MODEL_DIR
    from jaxhybrid.openai.render import content_format
    from jaxhybrid.serve.app import DEFAULT_MAX_BODY_BYTES, build_app
    from jaxhybrid.serve.engine_loop import EngineLoop
    from jaxhybrid.serve.metrics import ServerMetrics, cache_config_info
    from jaxhybrid.serve.state import ServerState

    # /health answers while the buckets compile on a worker thread
    built = build_engine(from_namespace(args), background_compile=True)
    config = built.config
    names = tuple(args.served_model_name or [str(args.model or "jaxhybrid-default")])
    metrics = ServerMetrics(names[0], config.max_model_len, config.num_spec_tokens, cache_config_info(config))
    # a queue beyond a few batches only adds waiting: clients are better told to retry (or sent elsewhere)
    max_queued = args.max_num_queued_requests or 8 * config.max_num_seqs
    max_queued_tokens = args.max_num_queued_tokens or 2 * config.max_num_seqs * config.max_model_len
    loop = EngineLoop(built.engine, metrics, max_queued=max_queued, max_queued_tokens=max_queued_tokens,
                      watchdog_timeout=args.watchdog_timeout, on_stuck=on_stuck,
                      stat_logger=None if args.disable_log_stats else StatLogger(config.num_spec_tokens),
                      request_logger=RequestLogger(args.max_log_len) if args.enable_log_requests else None)
    log.info("queue: at most %d sequences and %d prompt tokens; request bodies up to %d bytes", max_queued,
             max_queued_tokens, args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES)
    state = ServerState(built, loop, names, str(args.model or DEFAULT_MODEL_DIR), config.max_model_len,
                        prompt_tokens_details=args.enable_prompt_tokens_details,
                        force_include_usage=args.enable_force_include_usage,
                        content_format=content_format(built.tokenizer, args.chat_template_content_format),
                        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none)
    app = build_app(state, tuple(args.api_key or ()), root_path=args.root_path,
                    request_id_headers=args.enable_request_id_headers,
                    tokenizer_info=args.enable_tokenizer_info_endpoint,
                    server_load_tracking=args.enable_server_load_tracking,
                    max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES)
    return app, state


def exit_stuck(reason: str) -> None:
    """The engine is stuck or dead: no request can finish, so the process ends (status 1) for a supervisor
    to restart it, as vLLM's server does when its engine core dies. Every thread's stack goes to stderr
    first, to show where it stuck. Nothing here takes a lock (the stuck thread may hold logging's) or waits
    for the stuck thread."""
    os.write(2, f"jaxhybrid: the engine is unhealthy, exiting: {reason}\n".encode(errors="replace"))
    faulthandler.dump_traceback(all_threads=True)
    os._exit(1)


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv, prog)
    log.info("non-default arguments: %s", non_default(parser(prog), args))
    try:
        app, state = build_server(args, on_stuck=exit_stuck)
    except ValueError as error:  # settings the checkpoint cannot honour (a parser, MTP, a template): one line
        parser(prog).error(str(error))

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
    preload_tcmalloc()
    main()
