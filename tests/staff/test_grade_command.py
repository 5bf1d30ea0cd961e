"""The grading command's handling of a submission (staff/autograder/grade.py): only the seven task files are
taken, from wherever the student put them, and nothing else of the submission reaches the grading tree."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "staff" / "autograder"))
import grade  # noqa: E402

pytestmark = pytest.mark.staff

WANTED = grade.task_files(ROOT)


def test_the_seven_task_files_are_wanted():
    assert [Path(w).name for w in WANTED] == ["task1_meta_init.py", "task2_flat_param.py", "task3_forward.py",
                                              "task4_backward.py", "task5_optim_ckpt.py", "task6_prefetch.py",
                                              "task7_fully_shard.py"]


def test_submitted_files_are_found_where_students_put_them(tmp_path):
    sub = tmp_path / "submission"
    (sub / "fsdp_assignment").mkdir(parents=True)
    (sub / "fsdp_assignment" / "task1_meta_init.py").write_text("exact = True\n")
    (sub / "old").mkdir()
    (sub / "old" / "task1_meta_init.py").write_text("exact = False\n")       # the repository path wins
    (sub / "task2_flat_param.py").write_text("loose = True\n")                # a loose upload
    (sub / "__MACOSX").mkdir()
    (sub / "__MACOSX" / "task3_forward.py").write_text("junk\n")            # macOS metadata: ignored
    os.symlink("/etc/passwd", sub / "task4_backward.py")                      # a link: ignored
    (sub / "task5_optim_ckpt.py").write_bytes(b"#" * (grade.MAX_SUBMITTED_FILE_BYTES + 1))  # too big: ignored
    (sub / "a").mkdir()
    (sub / "b").mkdir()
    (sub / "a" / "task6_prefetch.py").write_text("a = 1\n")
    (sub / "b" / "task6_prefetch.py").write_text("b = 1\n")
    (sub / "conftest.py").write_text("raise SystemExit\n")
    found, notes = grade.find_submitted(sub, WANTED)
    by_name = {Path(k).name: v for k, v in found.items()}
    assert by_name["task1_meta_init.py"].read_text() == "exact = True\n"
    assert by_name["task2_flat_param.py"].read_text() == "loose = True\n"
    assert by_name["task6_prefetch.py"].read_text() == "a = 1\n"
    assert {"task3_forward.py", "task4_backward.py", "task5_optim_ckpt.py", "task7_fully_shard.py"}.isdisjoint(by_name)
    text = "\n".join(notes)
    assert "task3_forward.py: not found" in text and "task7_fully_shard.py: not found" in text
    assert "larger than" in text and "several files named task6_prefetch.py" in text

    tree = tmp_path / "tree"
    (tree / "fsdp_assignment").mkdir(parents=True)
    grade.install_submission(tree, found)
    assert sorted(p.name for p in (tree / "fsdp_assignment").iterdir()) == \
        ["task1_meta_init.py", "task2_flat_param.py", "task6_prefetch.py"]
    assert not (tree / "conftest.py").exists()


def test_task_files_inside_an_uploaded_zip(tmp_path):
    sub = tmp_path / "submission"
    sub.mkdir()
    with zipfile.ZipFile(sub / "submission.zip", "w") as zf:
        zf.writestr("fsdp_assignment/task3_forward.py", "zipped = True\n")
        zf.writestr("conftest.py", "raise SystemExit\n")
    found, notes = grade.find_in_zips(sub, WANTED)
    assert found == {"fsdp_assignment/task3_forward.py": b"zipped = True\n"}
    assert "taken from submission.zip" in notes[0]


def test_a_zip_with_too_many_entries_is_not_parsed(tmp_path):
    # Issue 18: a 35 MiB zip of 400,007 entries took 2 s and 234 MiB of root's memory to parse. The entry count
    # and directory size are read from the end-of-central-directory record first; beyond the caps it is not opened.
    sub = tmp_path / "submission"
    sub.mkdir()
    with zipfile.ZipFile(sub / "many.zip", "w") as z:
        for i in range(grade.MAX_SUBMISSION_ENTRIES + 1):
            z.writestr(f"x{i}", b"")
        z.writestr(WANTED[0], b"x = 1\n")
    found, notes = grade.find_in_zips(sub, WANTED)
    assert not found
    assert any("many.zip: not opened" in n and f"{grade.MAX_SUBMISSION_ENTRIES + 2} entries" in n for n in notes), notes
