"""The command-line programs' tcmalloc preload (jaxhybrid/malloc.py): which library, when, and exactly one
re-execution."""

from __future__ import annotations

import os
import subprocess
import sys

from jaxhybrid.malloc import SETTING, preload_environment, tcmalloc_library

PRINT_PRELOAD = ("import os; from jaxhybrid.malloc import preload_tcmalloc; preload_tcmalloc(); "
                 "print('LD_PRELOAD=' + os.environ.get('LD_PRELOAD', ''))")


def test_the_setting_chooses_or_refuses_the_library():
    assert tcmalloc_library({SETTING: "0"}) is None
    assert tcmalloc_library({SETTING: "/opt/lib/libtcmalloc.so"}) == "/opt/lib/libtcmalloc.so"


def test_a_preloaded_or_missing_library_is_not_preloaded_again():
    assert preload_environment({}, None) is None
    assert preload_environment({"LD_PRELOAD": "libfoo.so libtcmalloc.so.4"}, "libtcmalloc.so.4") is None
    assert preload_environment({"LD_PRELOAD": "libfoo.so:libtcmalloc.so.4"}, "libtcmalloc.so.4") is None
    environment = preload_environment({"LD_PRELOAD": "libfoo.so", "X": "1"}, "libtcmalloc.so.4")
    assert environment == {"LD_PRELOAD": "libtcmalloc.so.4 libfoo.so", "X": "1"}


def _run(setting: str) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {SETTING: setting}
    result = subprocess.run([sys.executable, "-c", PRINT_PRELOAD], env=environment, capture_output=True, text=True,
                            timeout=120, check=True)
    return [line for line in result.stdout.splitlines() if line.startswith("LD_PRELOAD=")]


def test_the_program_reexecutes_once_with_the_library_preloaded():
    """libc stands in for tcmalloc (present everywhere, harmless to preload); the process prints once, so it ran
    its code after exactly one re-execution."""
    assert _run("libc.so.6") == ["LD_PRELOAD=libc.so.6"]
    assert _run("0") == ["LD_PRELOAD="]
