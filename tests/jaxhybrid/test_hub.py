"""Hugging Face hub ids for `LLM`, `load_model` and the CLI, against a fake local hub cache (the layout
huggingface_hub writes: `models--org--name/{refs/<ref>, snapshots/<commit>/...}`) with HF_HUB_OFFLINE=1:
no test touches the network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants, errors

import jaxhybrid
from jaxhybrid import LLM, SamplingParams
from jaxhybrid.engine.builder import build_engine
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.flags import from_namespace
from jaxhybrid.models.weights import DEFAULT_MODEL_DIR, CheckpointError, resolve_model
from jaxhybrid.serve.__main__ import parse_args

ROOT = Path(__file__).parent.parent.parent
REPO = "org/name"
MAIN, V1 = "a" * 40, "b" * 40
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=192, num_blocks=96, num_state_slots=24,
             token_buckets=(16, 64), row_buckets=(4,), mamba_block_size=16)


def fake_hub_cache(cache: Path, repo_id: str, refs: dict[str, str]) -> Path:
    """A hub cache holding `repo_id` at each ref -> commit, every snapshot the embedded model's files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for ref, commit in refs.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for source in DEFAULT_MODEL_DIR.iterdir():
            (snapshot / source.name).symlink_to(source)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE at a fake cache (huggingface_hub read both at import: set there too)."""
    cache = tmp_path / "hub"
    fake_hub_cache(cache, REPO, {"main": MAIN, "v1": V1})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_id_loads_from_the_cache_and_generates_what_the_local_path_does(offline_cache):
    prompt, params = "def read_config(path):\n", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    local = LLM(DEFAULT_MODEL_DIR, **SMALL).generate(prompt, params, use_tqdm=False)[0]
    hub = LLM(REPO, **SMALL)
    assert hub.tokenizer is not None and hub.generation_defaults  # tokenizer and generation config came along
    output = hub.generate(prompt, params, use_tqdm=False)[0]
    assert output.prompt_token_ids == local.prompt_token_ids
    assert output.outputs[0].token_ids == local.outputs[0].token_ids and len(local.outputs[0].token_ids) == 8


def test_the_cli_takes_a_hub_id_with_revision_and_download_dir(tmp_path, monkeypatch):
    """`python -m jaxhybrid.serve --model org/name --revision v1 --download-dir D` builds its engine from D."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake_hub_cache(tmp_path, REPO, {"v1": V1})
    args = parse_args(["--model", REPO, "--revision", "v1", "--download-dir", str(tmp_path), "--no-precompile",
                       "--compilation-cache-dir", "", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                       "--max-model-len", "192", "--num-blocks", "96", "--num-state-slots", "24",
                       "--token-buckets", "16", "64", "--row-buckets", "4", "--mamba-block-size", "16"])
    built = build_engine(from_namespace(args))
    assert built.model.hf_config == jaxhybrid.load_model().hf_config
    assert built.tokenizer.encode("x = 1") == Tokenizer.from_pretrained(DEFAULT_MODEL_DIR).encode("x = 1")


def test_revisions_resolve_to_their_snapshots(offline_cache):
    repo = offline_cache / "models--org--name"
    assert resolve_model(REPO) == repo / "snapshots" / MAIN
    assert resolve_model(REPO, revision="v1") == repo / "snapshots" / V1
    assert jaxhybrid.load_model(REPO, revision="v1").config == jaxhybrid.load_model().config
    with pytest.raises(CheckpointError, match="'org/name' .*revision 'v2'.*HF_HUB_OFFLINE"):
        resolve_model(REPO, revision="v2")


def test_an_id_that_cannot_be_resolved_is_a_clear_error(offline_cache):
    with pytest.raises(CheckpointError, match="'org/missing' .*Hugging Face hub id.*HF_HUB_OFFLINE") as error:
        LLM("org/missing", **SMALL)
    assert isinstance(error.value.__cause__, errors.LocalEntryNotFoundError)
    with pytest.raises(CheckpointError, match="'not/a/hub/id' does not exist"):
        jaxhybrid.load_model("not/a/hub/id")


def test_hf_home_and_hf_hub_offline_are_read_from_the_environment(tmp_path):
    """In a fresh process, as a user sets them: HF_HOME/hub is the cache and nothing is fetched."""
    fake_hub_cache(tmp_path / "hub", REPO, {"main": MAIN})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    code = ("from jaxhybrid.models.weights import resolve_model\n"
            "print(resolve_model('org/name'))\n"
            "try:\n    resolve_model('org/other')\nexcept ValueError as error:\n    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    assert out[0] == str(tmp_path / "hub" / "models--org--name" / "snapshots" / MAIN)
    assert "'org/other'" in out[1] and "HF_HUB_OFFLINE" in out[1]
