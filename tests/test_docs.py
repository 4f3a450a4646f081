"""The repository stands alone: no file cites a document outside it, and every `docs/` page or anchor cited exists."""

import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parent.parent
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml"}
SKIPPED_DIRS = {"node_modules", "__pycache__", "build", "dist"}

# Design notes and references that live outside the repository, under the names they were cited by.
OUTSIDE_DOCUMENTS = re.compile(
    r"\bDESIGN\b|STYLE\.md|kernels_models|vllm_mamba_scheduler|jax_pallas_notes|engine_seams|vllm_cpu_peer|gpu_aot"
    r"|ecosystem\.md|\bseed[- ]0\d\d\b|\bseeds/|\.\./shared|/work/shared|\bshared/reference|\breference/[a-z_]+\.md"
    r"|§"  # a section of a document that is not here
)
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/([\w-]+\.md)(?:#([\w-]+))?")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _listed_files() -> list[str]:
    """Tracked and untracked, not ignored, files; every file under the root where git is absent."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()]
    return [name for name in listed
            if not any(part.startswith(".") or part in SKIPPED_DIRS for part in Path(name).parts[:-1])]


@cache
def text_files() -> tuple[Path, ...]:
    """The repository's source, documentation, config and script files, this one (which names the patterns) aside."""
    return tuple(ROOT / name for name in sorted(_listed_files())
                 if Path(name).suffix in SUFFIXES and (ROOT / name).is_file() and ROOT / name != Path(__file__))


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return frozenset(slug(h) for h in headings)


def broken_target(page: Path, anchor: str | None) -> str | None:
    """Why a cited page (and anchor) does not resolve, or None."""
    if not page.is_file():
        return "no such file"
    if anchor and page.suffix == ".md" and anchor not in anchors(page):
        return f"no heading with anchor #{anchor}"
    return None


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name)


def outside_citations(files: tuple[Path, ...]) -> list[str]:
    hits = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for match in OUTSIDE_DOCUMENTS.finditer(line):
                hits.append(f"{_shown(path)}:{number}: {match.group(0)!r} in {line.strip()[:100]}")
    return hits


def broken_doc_references(files: tuple[Path, ...]) -> list[str]:
    broken = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        targets = [(ROOT / "docs" / m.group(1), m.group(2), m.group(0)) for m in DOCS_PATH.finditer(text)]
        if path.suffix == ".md":
            for m in MARKDOWN_LINK.finditer(text):
                target, _, anchor = m.group(1).partition("#")
                if re.match(r"[a-z]+:", target):  # http:, mailto:
                    continue
                targets.append((path.parent / target if target else path, anchor or None, m.group(1)))
        for page, anchor, cited in targets:
            if reason := broken_target(page, anchor):
                broken.append(f"{_shown(path)}: {cited} ({reason})")
    return broken


def test_no_file_cites_an_outside_document():
    assert outside_citations(text_files()) == []


def test_cited_docs_pages_and_anchors_exist():
    assert broken_doc_references(text_files()) == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    citations = ['(DESIGN "Kernels")', "DESIGN.md", "kernels_models section 1.4", "the maths of §2.3",
                 "../shared/notes.md", "/work/shared/reference/gpu_aot.md", "reference/ecosystem.md",
                 "the seed-004 fix", "STYLE.md", "vllm_cpu_peer", "jax_pallas_notes 1.7"]
    planted = tmp_path / "planted.md"
    planted.write_text("\n".join(citations + ["docs/engine.md#one-step and [scheduler](../docs/scheduler.md) are fine",
                                               "docs/nowhere.md, docs/engine.md#no-such-heading, [x](missing.md)"]))
    flagged_lines = {int(hit.split(":")[1]) for hit in outside_citations((planted,))}
    assert flagged_lines == set(range(1, len(citations) + 1))
    assert [hit.split(": ", 1)[1] for hit in broken_doc_references((planted,))] == [
        "docs/nowhere.md (no such file)",
        "docs/engine.md#no-such-heading (no heading with anchor #no-such-heading)",
        "../docs/scheduler.md (no such file)",
        "missing.md (no such file)",
    ]
    assert slug("Compile check without a GPU") == "compile-check-without-a-gpu"
    assert slug("`carry_chunks`: prefill, 2 rows") == "carry_chunks-prefill-2-rows"
