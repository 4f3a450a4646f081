"""The server's flags: EngineArgs' fields in vLLM's names and both spellings, `--no-` forms, JSON flags, YAML
presets under the command line, and clear errors for what this build does not do."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaxhybrid import LLM
from jaxhybrid.engine.args import CLI_DEFAULTS, EngineArgs
from jaxhybrid.engine.builder import chat_template_text
from jaxhybrid.flags import FIELDS, from_namespace
from jaxhybrid.serve.__main__ import parse_args

PRESETS = sorted((Path(__file__).parents[3] / "configs" / "serve").glob("*.yaml"))


def test_vllm_spellings_and_forms():
    args = parse_args(["--max_num_seqs", "7", "--max-num-batched-tokens", "128", "--no-enable-prefix-caching",
                       "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--api-key", "a", "b"])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.enable_prefix_caching) == (7, 128, False)
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.api_key == ["a", "b"]
    assert parse_args([]).model is None  # the embedded model


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_presets_parse_and_the_command_line_wins(preset):
    args = parse_args(["--config", str(preset)])
    assert args.speculative_config["method"] == "mtp" and args.max_num_seqs > 1
    assert parse_args(["--config", str(preset), "--max-num-seqs", "3"]).max_num_seqs == 3


def test_bad_flags_are_refused(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-sequences: 4\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(bad)])
    assert "unknown keys ['max_num_sequences']" in capsys.readouterr().err
    assert parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAXHYBRID_API_KEY", "from-env")
    assert parse_args([]).api_key == ["from-env"]
    assert parse_args(["--api-key", "flag"]).api_key == ["flag"]


def test_chat_template_content_format():
    """vLLM's --chat-template-content-format: auto by default, string or openai, nothing else."""
    assert parse_args([]).chat_template_content_format == "auto"
    assert parse_args(["--chat-template-content-format", "openai"]).chat_template_content_format == "openai"
    with pytest.raises(SystemExit):
        parse_args(["--chat-template-content-format", "json"])


def test_the_flags_are_engine_args_with_the_programs_defaults():
    """One declaration: every EngineArgs field is a flag; with no flags the CLI builds EngineArgs at its
    defaults except the ones CLI_DEFAULTS names (and they differ from the library's, or they would not be there)."""
    assert set(CLI_DEFAULTS) <= set(FIELDS)
    assert all(FIELDS[name].default != value for name, value in CLI_DEFAULTS.items())
    built = from_namespace(parse_args([]))
    assert built == dataclasses.replace(EngineArgs(), **CLI_DEFAULTS)
    flags = ["--model", "m", "--token_buckets", "8", "16", "--no-async-scheduling", "--backend", "interpret",
             "--compilation-cache-dir", "", "--no-precompile"]
    assert from_namespace(parse_args(flags)) == dataclasses.replace(
        built, model="m", token_buckets=(8, 16), async_scheduling=False, backend="interpret",
        compilation_cache_dir=None, precompile=False)


def test_llm_refuses_a_keyword_that_is_no_engine_arg():
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(max_num_sequences=4)


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    """vLLM's --chat-template: a file's text, or a template given inline; a path to no file is refused."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert chat_template_text(str(tmp_path / "t.jinja")) == template
    assert chat_template_text(template) == template
    with pytest.raises(ValueError, match="no file at"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    assert from_namespace(parse_args(["--chat-template", template])).chat_template == template
