"""The handout PDF is up to date with its sources (staff only; not in the student release).

``handout.pdf`` is built by ``python staff/build_handout.py`` from ``handout/*.typ`` plus what the build extracts
from the task stubs' docstrings, the points table and ``WRITEUP_TEMPLATE.md``. The build records a digest of all
of that (content only: no mtimes, so a fresh clone checks the same) and the PDF's own SHA-256 in
``handout/build-stamp.json``, and embeds the digest in the PDF's metadata. These tests recompute the digest; they
need neither typst nor the network, and take well under a second.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]


def _build_handout():
    spec = importlib.util.spec_from_file_location("build_handout", ROOT / "staff" / "build_handout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_handout_pdf_is_up_to_date():
    problems = _build_handout().check()
    assert not problems, ("handout.pdf is stale:\n  - " + "\n  - ".join(problems) +
                          "\nRebuild it and commit handout.pdf and handout/build-stamp.json:\n"
                          "  pip install typst && python staff/build_handout.py")


def test_handout_covers_every_stub_function():
    # The build copies each stub's public names into the handout; a task with none means the stub moved.
    api = _build_handout().stub_api()
    for n, task in api.items():
        assert not task["missing"], f"Task {n}: stub {task['file']} not found"
        assert task["entries"], f"Task {n}: no public function or class found in {task['file']}"


def test_handout_setup_commands_are_the_readmes():
    data = (ROOT / "handout" / "data.typ").read_text(encoding="utf-8")
    commands = re.findall(r'#let setup-(?:install|test) = "([^"]+)"', data)
    assert len(commands) == 2, "handout/data.typ must define setup-install and setup-test"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in commands:
        assert command in readme, (f"the handout's set-up command {command!r} is not in README.md; "
                                   "update handout/data.typ (and rebuild) or the README")
