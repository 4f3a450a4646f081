"""The OpenAI-compatible HTTP server: `python -m jaxhybrid.serve` (flags in `__main__`), the FastAPI app
(`app`), its wire format (`protocol`) and the engine's background thread (`engine_loop`)."""
