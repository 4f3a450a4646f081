"""The training corpus: the `.py` sources of the running Python's standard library, deduplicated and split."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Held out of tokenizer and model training; small, self-contained, ordinary-looking modules.
HELD_OUT_MODULES = ("csv.py", "textwrap.py", "shlex.py", "fractions.py", "pprint.py")
# Test suites and vendored third-party code are not the standard library's own style.
_EXCLUDED_DIRS = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    train: list[tuple[str, str]]  # (path relative to the stdlib dir, text), sorted by path
    held_out: list[tuple[str, str]]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def gather_corpus(root: Path | None = None) -> Corpus:
    """Every readable `.py` file under the stdlib dir, exact duplicates dropped, held-out modules split off."""
    root = root or stdlib_dir()
    seen: set[str] = set()
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _EXCLUDED_DIRS & set(relative.parts[:-1]):
            continue
        text = _read(path)
        if not text or not text.strip():
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        target = held_out if str(relative) in HELD_OUT_MODULES else train
        target.append((str(relative), text))
    missing = set(HELD_OUT_MODULES) - {name for name, _ in held_out}
    if missing:
        raise FileNotFoundError(f"held-out stdlib modules not found under {root}: {sorted(missing)}")
    return Corpus(train, held_out)
