"""vLLM's command line with its first word swapped. vLLM's own `vllm serve --help=all` and `vllm run-batch
--help=all` (tests/fixtures/vllm_cli/, written by make_help.py there) drive the flag tests: each vLLM flag is
either one of ours or ends start-up with one line that names it and exit status 2. The serve commands of vLLM's
recipes for our model families (recipes.sh) each parse into engine settings or refuse in one line."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxhybrid import run_batch
from jaxhybrid.flags import from_namespace
from jaxhybrid.serve import __main__ as serve

VLLM_CLI = Path(__file__).parents[2] / "fixtures" / "vllm_cli"
OPTION = re.compile(r"^  (-[^ ].*?)(?: {2,}|$)")

# Our flags that vLLM does not have, each for a setting of ours with no vLLM counterpart.
JAXHYBRID_ONLY = {
    "--backend": "the kernels: pallas or the pure-JAX reference",
    "--cpu-kernels": "the C++ FFI kernels on CPU or the pure-JAX reference",
    "--scan-layers": "the layer stack as one loop over its repeats, or unrolled",
    "--bucket-growth": "the step's shape ladders (each shape compiles once)",
    "--token-buckets": "the step's token ladder",
    "--row-buckets": "the step's row ladder",
    "--compilation-cache-dir": "where compiled steps persist (XLA's cache)",
    "--precompile": "compile every bucket at start-up (in the background, for the server)",
    "--num-blocks": "an exact KV pool size",
    "--num-state-slots": "an exact recurrent state pool size",
    "--replayssm-window": "ReplaySSM's ring",
    "--max-sampling-constraints": "the compiled width of per-request token bans",
    "--max-num-queued-requests": "the server's queue bound in sequences",
    "--max-request-body-bytes": "the server's body size bound",
    "--watchdog-timeout": "the server's stuck-engine watchdog",
    "--window": "the batch job's lines in flight",
    "--resume": "the batch job carries on after a crash",
    "--top-logprobs": "the batch job's scoring lines",
    "--checkpoint-reuse": "the batch job's scoring lines",
    "--ray": "the batch job over Ray Data actors",
    "--num-replicas": "the batch job over Ray Data actors",
    "--ray-address": "the batch job over Ray Data actors",
}


# Defaults of shared flags that are not vLLM's, and why. vLLM's None means "resolved at start-up"; where ours
# is the value its resolution gives on this hardware class, the row says so.
DEFAULTS_DIFFER = {
    "--model": "no model: the embedded default model (vLLM downloads Qwen/Qwen3-0.6B), so a fresh machine runs",
    "--max-num-seqs": "32: vLLM resolves per device; ours sets the compiled row ladder, sized for a CPU",
    "--max-num-batched-tokens": "512: vLLM resolves per device; ours sets the compiled token ladder",
    "--enable-prefix-caching": "True: what vLLM resolves for hybrid models in align mode",
    "--block-size": "16: vLLM's resolved GPU block size",
    "--mamba-block-size": "64: our recurrent-state grid (vLLM resolves it from the attention block size)",
    "--async-scheduling": "True: what vLLM resolves",
    "--enable-chunked-prefill": "True: what vLLM resolves (and the only mode here)",
    "--host": "0.0.0.0: every interface, what vLLM's None means",
    "--root-path": "'': no prefix, what vLLM's None means",
    "--reasoning-parser": "None: no parser, what vLLM's '' means",
    "--hf-overrides": "None: no overrides, what vLLM's {} means",
}


def vllm_defaults(name: str) -> dict[str, str]:
    """Each option spelling's `(default: ...)` in vLLM's help, read from its whole help paragraph."""
    defaults, spellings, text = {}, [], ""
    for line in [*(VLLM_CLI / name).read_text().splitlines(), ""]:
        match = OPTION.match(line)
        if match or not line.startswith("   "):
            found = re.search(r"\(default: (.*)\)\s*$", text)
            defaults.update((spelling, found.group(1)) for spelling in spellings if found)
            spellings, text = [], ""
        if match:
            spellings = [s.split(" ")[0] for s in re.split(r", (?=-)", match.group(1))]
            text = line[match.end(1):]
        elif spellings:
            text += " " + line.strip()
    return defaults


def test_shared_flags_have_vllms_defaults():
    """Where we have vLLM's feature we have its default, or DEFAULTS_DIFFER says why not."""
    theirs = vllm_defaults("serve_help_all.txt")
    checked = 0
    for action in serve.parser()._actions:
        flag = next((f for f in action.option_strings if f in theirs), None)
        if flag is None or flag in ("-h", "--help"):
            continue
        checked += 1
        ours = "" if action.default is None and theirs[flag] == "" else str(action.default)
        assert flag in DEFAULTS_DIFFER or ours == theirs[flag], (flag, action.default, theirs[flag])
    assert checked > 40


def vllm_options(name: str) -> dict[str, str | None]:
    """Every spelling of every option in vLLM's help, with a value to give it (None: it takes none)."""
    options = {}
    for line in (VLLM_CLI / name).read_text().splitlines():
        match = OPTION.match(line)
        if not match:
            continue
        for spelling in re.split(r", (?=-)", match.group(1)):
            flag, _, metavar = spelling.partition(" ")
            choice = re.match(r"\{([^,}]*)|\['([^']*)'", metavar)  # {a,b} or ['a', 'b']: the first choice
            options[flag] = (choice.group(1) or choice.group(2)) if choice else ("1" if metavar else None)
    return options


def ours(parser) -> set[str]:
    return {spelling for action in parser._actions for spelling in action.option_strings}


def refused_in_one_line(parse, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, (argv, err)
    return err


@pytest.mark.parametrize("program, help_file, parse", [
    ("serve", "serve_help_all.txt", serve.parse_args),
    ("run-batch", "run_batch_help_all.txt", lambda argv: run_batch.parse_flags(argv)),
])
def test_every_vllm_flag_is_ours_or_refused_in_one_line(program, help_file, parse, capsys):
    parser = serve.parser() if program == "serve" else run_batch.parser()
    known = ours(parser)
    options = vllm_options(help_file)
    assert len(options) > 300  # the help text parsed: vLLM has some 440 spellings
    refused = 0
    for flag, value in options.items():
        if flag in known or flag in ("-h", "--help"):
            continue
        argv = [flag] if value is None else [flag, value]
        if program == "run-batch":
            argv += ["-i", __file__, "-o", "/dev/null"]
        err = refused_in_one_line(parse, argv, capsys)
        assert flag in err, err
        refused += 1
    assert refused < len(options)
    ours_only = {f for f in known if f.startswith("--") and "_" not in f and not f.startswith("--no-")}
    ours_only -= set(options) | {"--config"}
    assert ours_only <= set(JAXHYBRID_ONLY), sorted(ours_only - set(JAXHYBRID_ONLY))


def recipes() -> list[list[str]]:
    text = (VLLM_CLI / "recipes.sh").read_text().replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.startswith("vllm serve")]


# recipe -> the flag it is refused for (None: it starts)
RECIPE_OUTCOMES = [None, "--no-enable-chunked-prefill", None, None, "--mm-encoder-tp-mode", None,
                   "--attention-backend", None, None, "--reasoning-parser"]  # nano_v3: a plugin file's


@pytest.mark.parametrize("index", range(len(RECIPE_OUTCOMES)))
def test_vllm_recipes_start_or_refuse_in_one_line(index, capsys):
    argv = recipes()[index]
    assert argv[:2] == ["vllm", "serve"] and len(recipes()) == len(RECIPE_OUTCOMES)
    refused_for = RECIPE_OUTCOMES[index]
    if refused_for is None:
        args = serve.parse_args(argv[2:])
        settings = from_namespace(args)
        assert settings.model == argv[2] and settings.model.count("/") == 1
    else:
        assert refused_for in refused_in_one_line(serve.parse_args, argv[2:], capsys)


def test_the_console_script_refuses_a_vllm_flag_in_one_line():
    """What a user sees: `jaxhybrid serve --attention-backend X` ends with status 2 and one line, no traceback."""
    done = subprocess.run([sys.executable, "-m", "jaxhybrid.cli", "serve", "--attention-backend", "FLASH_ATTN"],
                          capture_output=True, text=True, timeout=120, env={"JAXHYBRID_TCMALLOC": "0", "PATH": ""})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("jaxhybrid serve: error: --attention-backend")
