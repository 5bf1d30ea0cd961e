"""The TA's staff commands print their usage with --help (issue 31): the docstring's command lines, not only a title.

Fast: each script's main() is called in-process with --help (argparse prints and exits before any work).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["staff/answer_key/regenerate.py", "staff/answer_key/check_tables.py", "staff/release.py",
           "staff/make_stubs.py", "staff/build_handout.py"]


@pytest.mark.parametrize("rel", SCRIPTS)
def test_help_shows_the_usage_lines(rel, capsys):
    spec = importlib.util.spec_from_file_location("_help_" + Path(rel).stem, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    usage = [line for line in module.__doc__.splitlines() if line.strip().startswith(f"python {rel}")]
    assert usage, f"{rel}'s docstring has no 'python {rel} ...' usage line"
    missing = [line.strip() for line in usage if line.strip() not in out]
    assert not missing, f"{rel} --help does not show its usage lines: {missing}"
