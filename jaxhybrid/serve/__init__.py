"""The OpenAI-compatible HTTP server, `python -m jaxhybrid.serve` (flags in `__main__`).

`app` routes requests; `protocol` parses their bodies into `SamplingParams`; `render` turns them into engine
prompts (the chat template); `engine_loop` runs the engine on its own thread; `streaming` and `responses`
shape what goes back; `errors` holds the 400s; `middleware` the keys, root path and request ids; `metrics`
the Prometheus endpoint.
"""
