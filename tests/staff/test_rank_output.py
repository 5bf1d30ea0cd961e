"""A print a student adds to a task file reaches them (issue 41 item 1): in a passing ``pytest -s`` run of a public
test, labelled by rank, and nowhere as pytest's own lines. Staff only: it copies the tree to a temporary folder,
adds a print to the implementation's ``clip_grad_norm_`` there (never to this tree's files), and runs Task 5's
public clip test in a pytest of its own (about 10 s quiet)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness_report import show_output

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
PROBE = "CLIP-PROBE"


def _copy_tree(dest: Path) -> None:
    for name in ("fsdp_assignment", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "staff", "hidden"))
    for name in ("adapters.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, dest / name)


def _add_print(dest: Path) -> None:
    """A print on every rank, at the top of clip_grad_norm_, in whichever implementation adapters picks here."""
    impl = "reference" if (ROOT / "fsdp_assignment/reference").is_dir() else None
    path = dest / "fsdp_assignment" / (f"{impl}/" if impl else "") / "task5_optim_ckpt.py"
    text = path.read_text()
    anchor = "    units = fsdp_units(module)\n"
    assert anchor in text, "test set-up: clip_grad_norm_'s first line moved; update this test's anchor"
    path.write_text(text.replace(anchor, f"    print('{PROBE}', torch.distributed.get_rank(), flush=True)\n"
                                       + anchor, 1))


def test_a_print_in_a_task_file_shows_in_a_passing_pytest_s_run(tmp_path):
    _copy_tree(tmp_path)
    _add_print(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "FSDP_"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
                           "tests/public/test_task5_optim_ckpt.py::test_clip_grad_norm_uses_the_global_norm"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(3):  # the test runs W = 3
        assert f"[rank {rank}] {PROBE} {rank}" in proc.stdout, (
            f"rank {rank}'s print did not show in the passing run's output:\n{proc.stdout[-3000:]}")


class _FakeRank:
    def __init__(self, rank: int, path: str):
        self.rank, self.out_path = rank, path


def test_rank_output_is_labelled_and_cannot_pass_for_pytest_lines(tmp_path):
    (tmp_path / "r0").write_text("hello\n\x1b[32mPASSED\x1b[0m\rFAKE\n")
    (tmp_path / "r1").write_text("")
    os.symlink(tmp_path / "r0", tmp_path / "r2")  # a link is never followed
    out = __import__("io").StringIO()
    show_output([_FakeRank(0, str(tmp_path / "r0")), _FakeRank(1, str(tmp_path / "r1")),
                 _FakeRank(2, str(tmp_path / "r2"))], out)
    lines = out.getvalue().splitlines()
    assert lines == ["[rank 0] hello", "[rank 0] \\x1b[32mPASSED\\x1b[0m\\rFAKE"], lines
