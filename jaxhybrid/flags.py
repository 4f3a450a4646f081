"""The programs' flags: one per `EngineArgs` field (vLLM's names; `--max-num-seqs` and `--max_num_seqs`; `--no-`
forms for booleans) with the programs' own defaults (`CLI_DEFAULTS`), the same names read from a YAML `--config`
file (the command line wins), and the tool-call flags of the programs that answer chat.

A vLLM command line runs with its first word swapped, or ends with one line: a flag jaxhybrid does not take (a
vLLM feature it does not have, or a typo), or a value it cannot honour, ends start-up with `PROG: error: ...`
naming it and exit status 2, never argparse's usage dump or a traceback."""

from __future__ import annotations

import argparse
import dataclasses
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from jaxhybrid.engine.args import CLI_DEFAULTS, EngineArgs
from jaxhybrid.parsers.tools import TOOL_PARSERS

FIELDS = {field.name: field for field in dataclasses.fields(EngineArgs)}

# The tool-call flags of the programs that answer chat (the server, the batch job's chat lines): vLLM's names.
TOOL_FLAGS: dict[str, dict] = {
    "--enable-auto-tool-choice": dict(action=argparse.BooleanOptionalAction, default=False,
                                      help='parse tool calls out of chat output (tool_choice "auto", "required" '
                                      "and named functions); needs --tool-call-parser"),
    "--tool-call-parser": dict(default=None, choices=tuple(TOOL_PARSERS),
                               help="the model's tool-call format, for --enable-auto-tool-choice"),
}


def check_tool_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """vLLM's rule: --enable-auto-tool-choice names its parser; without one, start-up ends with one line."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.exit(2, f"{parser.prog}: error: --enable-auto-tool-choice requires --tool-call-parser\n")


def _add(parser: argparse.ArgumentParser, name: str, keywords: dict) -> None:
    """`--name-with-dashes`, `--name_with_underscores` and any `aliases` (vLLM's short forms, such as -tp)."""
    flag = "--" + name.replace("_", "-")
    keywords = dict(keywords)
    aliases = keywords.pop("aliases", ())
    if isinstance(keywords.get("default"), bool) and "action" not in keywords:
        keywords["action"] = argparse.BooleanOptionalAction
    parser.add_argument(*([flag, "--" + name] if "_" in name else [flag]), *aliases, **keywords)


class FlagParser(argparse.ArgumentParser):
    """argparse with one-line errors. Prefixes of flags are not flags: vLLM's `--max-log` must not pass for one
    of ours that it happens to begin."""

    def __init__(self, prog: str, description: str):
        super().__init__(prog=prog, description=description, allow_abbrev=False)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def make_parser(prog: str, description: str, flags: dict[str, dict]) -> FlagParser:
    """A parser of every `EngineArgs` field, `--config`, and `flags` (the program's own: flag -> keywords)."""
    parser = FlagParser(prog, description)
    for name, field in FIELDS.items():
        _add(parser, name, {**field.metadata, "default": CLI_DEFAULTS.get(name, field.default)})
    _add(parser, "config", {"help": "YAML file of these flags (command-line flags win)"})
    for flag, keywords in flags.items():
        _add(parser, flag.lstrip("-").replace("-", "_"), keywords)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`argv` parsed; the first thing the parser does not know ends it, named."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        first = unknown[0]
        if first.startswith("-"):
            parser.error(f"{first.split('=')[0]} is not a jaxhybrid flag: jaxhybrid takes vLLM's flags where it has "
                         f"the feature (`{parser.prog} --help` lists them)")
        parser.error(f"unexpected argument {first!r}")
    if getattr(args, "model_tag", None) is not None:  # `serve MODEL`, vLLM's positional model
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return args


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Flags from `argv`, over the YAML `--config` file, over the defaults."""
    args = _parse(parser, argv)
    if args.config:
        values = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(values, dict):
            parser.error(f"--config {args.config}: expected a mapping of flag names to values")
        defaults = {name.lstrip("-").replace("-", "_"): value for name, value in values.items()}
        unknown = sorted(set(defaults) - set(vars(args)))
        if unknown:
            parser.error(f"--config {args.config}: unknown keys {unknown}")
        parser.set_defaults(**defaults)
        args = _parse(parser, argv)
    try:  # a value the engine cannot honour ends start-up here, in one line
        from_namespace(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def from_namespace(args: argparse.Namespace) -> EngineArgs:
    """The engine's part of parsed flags (lists become tuples; an empty cache directory turns the cache off)."""
    values = {name: getattr(args, name) for name in FIELDS}
    values["token_buckets"], values["row_buckets"] = tuple(args.token_buckets), tuple(args.row_buckets)
    values["compilation_cache_dir"] = args.compilation_cache_dir or None
    return EngineArgs(**values)


def non_default(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The arguments that differ from their defaults, secrets redacted (for the start-up log)."""
    return {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()
            if v != parser.get_default(k)}


def installed_version() -> str:
    """jaxhybrid's version (`--version`, the server's /version), or "unknown" in a checkout never installed."""
    try:
        return version("jaxhybrid")
    except PackageNotFoundError:
        return "unknown"
