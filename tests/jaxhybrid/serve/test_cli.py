"""The server's flags: vLLM's names in both spellings, `--no-` forms, JSON flags, YAML presets under the
command line, and clear errors for what this build does not do."""

from __future__ import annotations

from pathlib import Path

import pytest

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
