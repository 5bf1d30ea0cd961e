"""make_submission.sh gives a specific message for each bad submission (staff only; not in the student release).

Each test builds a tiny fake repository in a temporary directory (the real script, the real WRITEUP_TEMPLATE.md,
seven one-line task files) and runs the script with ``--skip-tests`` (the run-the-tests path is covered by
``tests/staff/test_release.py``), so the whole file takes a few seconds: no torch process starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
TASK_FILES = [
    "fsdp_assignment/task1_meta_init.py", "fsdp_assignment/task2_flat_param.py", "fsdp_assignment/task3_forward.py",
    "fsdp_assignment/task4_backward.py", "fsdp_assignment/task5_optim_ckpt.py", "fsdp_assignment/task6_prefetch.py",
    "fsdp_assignment/task7_fully_shard.py",
]
QUESTION = re.compile(r"^\*\*(Q\d+)\.?\*\*")


def filled_writeup(skip: tuple[str, ...] = (), skip_tables: tuple[str, ...] = ()) -> str:
    """WRITEUP_TEMPLATE.md with an answer under every question and a row under every benchmark table header,
    except the questions in ``skip`` and the table sections in ``skip_tables``."""
    out, section, in_table = [], None, False
    for line in (ROOT / "WRITEUP_TEMPLATE.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        is_table = line.startswith("| ---")
        if in_table and not line.startswith("|"):
            in_table = False
        out.append(line)
        m = QUESTION.match(line.strip())
        if m and m.group(1) not in skip:
            out.append(f"\nMy answer to {m.group(1)}: 3 Psi (W-1)/W elements.")
        if is_table and section not in skip_tables and section != "Summary":
            out.append("| FSDP | 2 | " + " | ".join(["1.0"] * 9) + " |")
    return "\n".join(out) + "\n"


def table_sections() -> list[str]:
    text = (ROOT / "WRITEUP_TEMPLATE.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## (.+?)\s*$\n(?:(?!^## |^\*\*Q).*\n)*?^\| .*\|\s*$", text, re.MULTILINE)
    return [s for s in sections if s != "Summary"]


def a_pdf(pages: int = 1) -> bytes:
    """A small but real PDF (what an export gives, minus fonts): header, objects, xref, trailer, %%EOF."""
    body = b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n" + b"1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n"
    body += b"2 0 obj << /Type /Pages /Kids [3 0 R] /Count 1 >> endobj\n"
    body += b"3 0 obj << /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] >> endobj\n"
    body += b"% " + b"writeup text " * 100 + b"\n"
    return body + b"trailer << /Root 1 0 R >>\nstartxref\n0\n%%EOF\n"


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    (repo / "fsdp_assignment").mkdir(parents=True)
    shutil.copy(ROOT / "make_submission.sh", repo / "make_submission.sh")
    shutil.copy(ROOT / "WRITEUP_TEMPLATE.md", repo / "WRITEUP_TEMPLATE.md")
    for rel in TASK_FILES:
        (repo / rel).write_text("def f():\n    return 1\n")
    return repo


def run(repo: Path, *args: str, python: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_") and k not in ("PYTHONPATH",)}
    env["PYTHON"] = python or sys.executable
    return subprocess.run(["bash", "make_submission.sh", *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)


def zipped(repo: Path) -> set[str]:
    return set(zipfile.ZipFile(repo / "submission.zip").namelist())


def test_a_complete_writeup_is_taken(repo):
    (repo / "WRITEUP.md").write_text(filled_writeup())
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "taking WRITEUP.md" in proc.stderr
    assert zipped(repo) == set(TASK_FILES) | {"WRITEUP.md"}


def test_a_task_file_that_does_not_compile_is_named(repo):
    (repo / "WRITEUP.md").write_text(filled_writeup())
    (repo / TASK_FILES[3]).write_text("def backward(:\n    pass\n")
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{TASK_FILES[3]} does not compile: {TASK_FILES[3]}:1" in proc.stderr, proc.stderr
    assert not any(f"{f} does not compile" in proc.stderr for f in TASK_FILES if f != TASK_FILES[3])
    assert not (repo / "submission.zip").exists()


def test_a_missing_task_file_is_named(repo):
    (repo / "WRITEUP.md").write_text(filled_writeup())
    (repo / TASK_FILES[5]).unlink()
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 1 and f"{TASK_FILES[5]} is missing" in proc.stderr, proc.stderr


def test_no_writeup_is_refused(repo):
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 1 and "no writeup" in proc.stderr and "WRITEUP_TEMPLATE.md" in proc.stderr, proc.stderr
    assert not (repo / "submission.zip").exists()


@pytest.mark.parametrize("data, why", [
    (b"%PDF-1.4\n", "too small"),                          # the 16-byte "PDF"
    (b"# My writeup\n" * 200, "does not start with %PDF-"),  # a markdown file renamed
    (a_pdf()[:-40], "no %%EOF"),                            # a truncated export
])
def test_a_fake_or_broken_pdf_is_refused(repo, data, why):
    (repo / "writeup.pdf").write_bytes(data)
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "writeup.pdf is not a valid PDF" in proc.stderr and why in proc.stderr, proc.stderr


def test_a_real_pdf_alone_is_taken(repo):
    (repo / "writeup.pdf").write_bytes(a_pdf())
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "taking writeup.pdf" in proc.stderr
    assert zipped(repo) == set(TASK_FILES) | {"writeup.pdf"}


def test_both_writeups_are_taken_and_it_says_so(repo):
    (repo / "WRITEUP.md").write_text(filled_writeup())
    (repo / "writeup.pdf").write_bytes(a_pdf())
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "taking WRITEUP.md and writeup.pdf" in proc.stderr, proc.stderr
    assert zipped(repo) == set(TASK_FILES) | {"WRITEUP.md", "writeup.pdf"}


def test_the_unchanged_template_next_to_a_pdf_takes_the_pdf_only(repo):
    shutil.copy(repo / "WRITEUP_TEMPLATE.md", repo / "WRITEUP.md")
    (repo / "writeup.pdf").write_bytes(a_pdf())
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "only writeup.pdf is taken" in proc.stderr, proc.stderr
    assert zipped(repo) == set(TASK_FILES) | {"writeup.pdf"}


def test_a_template_with_one_character_changed_is_refused_naming_every_question(repo):
    text = (repo / "WRITEUP_TEMPLATE.md").read_text().replace("**Name:**", "**Name:** A")
    (repo / "WRITEUP.md").write_text(text)
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "still the empty template" in proc.stderr, proc.stderr
    questions = [m.group(1) for m in map(QUESTION.match, (s.strip() for s in text.splitlines())) if m]
    assert len(questions) >= 12
    for q in questions:
        assert re.search(rf"^\s+{q}$", proc.stderr, re.MULTILINE), f"{q} not named:\n{proc.stderr}"


def test_each_empty_answer_is_named(repo):
    skip_tables = tuple(table_sections()[:1])
    assert skip_tables, "WRITEUP_TEMPLATE.md has no benchmark table section"
    (repo / "WRITEUP.md").write_text(filled_writeup(skip=("Q3", "Q13"), skip_tables=skip_tables))
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    named = re.findall(r"^\s{6}(\S.*)$", proc.stderr, re.MULTILINE)
    assert named == ["Q3", "Q13", f"the {skip_tables[0]} table"] or \
        sorted(named) == sorted(["Q3", "Q13", f"the {skip_tables[0]} table"]), proc.stderr
    assert "3 of its deliverables are empty" in proc.stderr
    # Skipping a question on purpose is an answer.
    lines = filled_writeup(skip=("Q3",)).splitlines()
    q3 = next(i for i, line in enumerate(lines) if line.startswith("**Q3.**"))
    (repo / "WRITEUP.md").write_text("\n".join(lines[:q3 + 1] + ["", "not answered"] + lines[q3 + 1:]))
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_deleted_question_is_named(repo):
    text = "\n".join(line for line in filled_writeup().splitlines() if not line.startswith("**Q9.**"))
    (repo / "WRITEUP.md").write_text(text)
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 1 and "Q9 (not found" in proc.stderr, proc.stderr


def test_quick_benchmark_results_are_warned_about(repo):
    (repo / "WRITEUP.md").write_text(filled_writeup())
    results = repo / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "memory.json").write_text('{"quick": true, "config": {"params": 200000.0, "world_sizes": [2]}}')
    (results / "step.json").write_text('{"config": {"params": 4000000.0}}')
    (results / "scaling.json").write_text('{"config": {"params": 0, "params_per_rank": 1e6}}')  # not quick
    (results / "summary.md").write_text("# Benchmarks (--quick: sizes too small to mean anything)\n")
    (results / "cache.pt").write_text("not included")
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--quick smoke run" in proc.stdout, proc.stdout
    assert "benchmarks/results/memory.json (it says quick)" in proc.stdout
    assert "benchmarks/results/summary.md (it says --quick)" in proc.stdout
    assert "step.json" not in proc.stdout.split("--quick smoke run")[1].split("Run python")[0]
    assert "scaling.json" not in proc.stdout.split("--quick smoke run")[1].split("Run python")[0]
    assert zipped(repo) == set(TASK_FILES) | {"WRITEUP.md", "benchmarks/results/memory.json", "benchmarks/results/step.json",
                                              "benchmarks/results/scaling.json", "benchmarks/results/summary.md"}
    # The benchmarks' own label (a top-level "quick": true) is recognised too.
    (results / "comm.json").write_text('{"config": {"quick": true}}')
    proc = run(repo, "--skip-tests")
    assert "benchmarks/results/comm.json (its config says quick)" in proc.stdout, proc.stdout
    (results / "comm.json").unlink()
    # Real-size results: no warning.
    (results / "memory.json").write_text('{"config": {"params": 4000000.0}}')
    (results / "summary.md").write_text("# Benchmarks\n")
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0 and "--quick" not in proc.stdout, proc.stdout
    # Only a quick run, in benchmarks/results/quick/ (where --quick writes): not zipped, and said so.
    for f in list(results.iterdir()):
        f.unlink()
    (results / "quick").mkdir()
    (results / "quick" / "memory.json").write_text('{"quick": true}')
    proc = run(repo, "--skip-tests")
    assert "no benchmark results" in proc.stdout and "results/quick/ holds a --quick smoke run" in proc.stdout
    assert zipped(repo) == set(TASK_FILES) | {"WRITEUP.md"}


def test_a_python_without_torch_suggests_the_virtualenv(repo, tmp_path):
    # An interpreter that cannot import torch: the system's python with an empty, isolated path.
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -S -I "$@"\n')
    fake.chmod(0o755)
    probe = subprocess.run([str(fake), "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("torch is importable without site-packages here")
    (repo / "WRITEUP.md").write_text(filled_writeup())
    proc = run(repo, python=str(fake))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "cannot import torch" in out and "source .venv/bin/activate" in out, out
    assert "Public tests: NOT RUN" in out, out


def test_gitignore_ignores_virtualenvs():
    lines = (ROOT / ".gitignore").read_text().split()
    assert "venv/" in lines and ".venv/" in lines


def test_an_image_the_zip_would_drop_is_warned_about(repo):
    """Issue 37, M3: Q12 halves every part without the picture; an image WRITEUP.md links outside what the zip
    takes (benchmarks/results/*.png, bonus/*.png) used to be dropped silently. The zip's own step_timeline.png,
    linked or not, is in the zip and draws no warning."""
    results = repo / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "step_timeline.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (repo / "figs").mkdir()
    (repo / "figs" / "crop.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (results / "quick").mkdir()
    (results / "quick" / "step_timeline.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    text = filled_writeup() + ("\n![timeline](benchmarks/results/step_timeline.png)\n![crop](figs/crop.png)\n"
                               '<img src="./benchmarks/results/quick/step_timeline.png" width="400">\n'
                               "![gone](missing.png)\n![web](https://example.org/x.png)\n")
    (repo / "WRITEUP.md").write_text(text)
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "WARNING: WRITEUP.md shows the image figs/crop.png, which is not in the zip" in out, out
    assert "WARNING: WRITEUP.md shows the image ./benchmarks/results/quick/step_timeline.png, which is not in the zip" in out
    assert "WARNING: WRITEUP.md shows the image missing.png, which does not exist" in out
    assert "Put the image in benchmarks/results/" in out
    assert "image benchmarks/results/step_timeline.png" not in out and "example.org" not in out, out
    assert "benchmarks/results/step_timeline.png" in zipped(repo)
    # Linked from where the zip takes it: no warning at all.
    (repo / "WRITEUP.md").write_text(filled_writeup() + "\n![timeline](benchmarks/results/step_timeline.png)\n")
    proc = run(repo, "--skip-tests")
    assert proc.returncode == 0 and "shows the image" not in proc.stdout, proc.stdout
