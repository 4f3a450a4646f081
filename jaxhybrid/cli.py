"""`jaxhybrid serve [MODEL] [flags]` and `jaxhybrid run-batch -i IN -o OUT [flags]`, as `vllm serve` and
`vllm run-batch` are called, so that a vLLM command line runs with its first word swapped. Each subcommand is
the program `python -m jaxhybrid.serve` / `python -m jaxhybrid.run_batch` runs, under the name `jaxhybrid ...`."""

from __future__ import annotations

import importlib
import sys

from jaxhybrid.flags import installed_version
from jaxhybrid.malloc import preload_tcmalloc

PROG = "jaxhybrid"
COMMANDS = {  # subcommand -> (module whose main(argv, prog) runs it, what it does)
    "serve": ("jaxhybrid.serve.__main__", "the OpenAI-compatible server (the embedded model without MODEL)"),
    "run-batch": ("jaxhybrid.run_batch", "an offline batch job: OpenAI batch JSONL in, JSONL out"),
}


def usage() -> str:
    lines = [f"usage: {PROG} {{{','.join(COMMANDS)}}} ...", "", "commands:"]
    lines += [f"  {name:<10} {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", f"`{PROG} COMMAND --help` lists a command's flags (vLLM's names where jaxhybrid has the feature)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """The console script: dispatch to the subcommand, or end with one line and status 2."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    if argv[0] in ("-v", "--version"):
        print(installed_version())
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{PROG}: error: unknown command {command!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        raise SystemExit(2)
    preload_tcmalloc()
    module = importlib.import_module(COMMANDS[command][0])
    module.main(rest, prog=f"{PROG} {command}")


if __name__ == "__main__":
    main()
