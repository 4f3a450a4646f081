"""The OpenAI-compatible HTTP server, `python -m jaxhybrid.serve` (flags in `__main__`).

`app` routes requests over the `ServerState` (`state`: the built engine, the engine loop, the flags);
`engine_loop` runs the engine on its own thread; `streaming` sends outputs as server-sent events;
`middleware` holds the keys, root path and request ids; `http_errors` the error responses; `metrics` the
Prometheus endpoint. Request bodies, prompts and response bodies are the OpenAI protocol's
(`jaxhybrid.openai`), which the batch job shares.
"""
