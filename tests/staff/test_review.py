"""The staff review (staff/autograder/review.py, issues 32 and 36): code that reaches into the grader's machinery or
around the process group is listed for a person, with file and line, however it is spelt (aliases, getattr with a
built name, a coding cookie that hides lines); a correct submission flags nothing; the student never sees the list.
Static (``ast``), no process spawned: about a second."""

from __future__ import annotations

import ast
import json
import textwrap
import zipfile
from pathlib import Path

import pytest

from staff.autograder import grade, results_schema, review
from staff.grader_selftest.mutant_grading import reference_student_files
from staff.grader_selftest.review_cases import HONEST, ISSUE_36, ISSUE_40, MORE

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]

# Each case: a small task file, and the (line, kind) it must flag. Line 1 of every source is "import torch".
CASES = {
    "frame": ("import torch\nimport sys\n\ndef f():\n    return sys._getframe(1).f_locals\n", {(5, "frame")}),
    "inspect": ("import torch\nimport inspect\n\ndef f():\n    return inspect.currentframe()\n", {(5, "frame")}),
    "traceback frame": ("import torch\n\ndef f(tb):\n    return tb.tb_frame.f_back\n", {(4, "frame")}),
    "settrace": ("import torch\nimport sys\nsys.settrace(None)\n", {(3, "frame")}),
    "gc": ("import torch\nimport gc\n\ndef f():\n    return [o for o in gc.get_objects()]\n", {(5, "gc")}),
    "gc imported": ("import torch\nfrom gc import get_referrers\n", {(2, "gc")}),
    "ctypes": ("import torch\nimport ctypes\n", {(2, "ctypes")}),
    "mmap": ("import torch\nimport mmap as m\n", {(2, "mmap")}),
    "memfd": ("import torch\nimport os\nfd = os.memfd_create('x')\n", {(3, "mmap")}),
    "shared_memory": ("import torch\nfrom multiprocessing import shared_memory\n", {(2, "process"), (2, "mmap")}),
    "/proc": ("import torch\n\ndef f(pid):\n    return open(f'/proc/{pid}/mem', 'rb')\n", {(4, "path")}),
    "/dev/shm": ("import torch\nPATH = '/dev/shm/x'\n", {(2, "path")}),
    "patch dist": ("import torch\nimport torch.distributed as dist\n\ndef f():\n    dist.all_reduce = print\n",
                   {(5, "patch")}),
    "patch torch.distributed": ("import torch\n\ndef f(g):\n    torch.distributed.all_gather = g\n", {(4, "patch")}),
    "patch a class of torch": ("import torch\ntorch.Tensor.__eq__ = lambda a, b: True\n", {(2, "patch")}),
    "patch via from-import": ("import torch\nfrom torch import distributed\ndistributed.barrier = None\n",
                              {(3, "patch")}),
    "setattr on a module": ("import torch\nimport torch.nn as nn\nsetattr(nn.Module, '__call__', None)\n",
                            {(3, "patch")}),
    "del on a module": ("import torch\ndel torch.allclose\n", {(2, "patch")}),
    "vars of a module": ("import torch\nimport torch.distributed as dist\nvars(dist)['all_reduce'] = print\n",
                         {(3, "patch")}),
    "builtins": ("import torch\nimport builtins\nbuiltins.print = None\n", {(2, "patch"), (3, "patch")}),
    "harness patched": ("import torch\nimport tests.harness as h\nh.run_ranks = None\n",
                        {(2, "harness"), (3, "patch")}),
    "harness imported": ("import torch\nfrom tests.public.collectives import CountedProcessGroup\n",
                         {(2, "harness")}),
    "sys.modules": ("import torch\nimport sys\nsys.modules['tests.harness'] = None\n",
                    {(3, "sys.modules"), (3, "harness")}),
    "signal": ("import torch\nimport signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n", {(2, "signal")}),
    "kill the parent": ("import torch\nimport os\nos.kill(os.getppid(), 9)\n", {(3, "signal")}),
    "fork": ("import torch\nimport os\n\ndef f():\n    if os.fork() == 0:\n        pass\n", {(5, "process")}),
    "subprocess": ("import torch\nimport subprocess\n", {(2, "process")}),
    "exec": ("import torch\n\ndef f(code):\n    exec(code)\n", {(4, "dynamic")}),
    "importlib": ("import torch\nimport importlib\n", {(2, "dynamic")}),
    "socket": ("import torch\nimport socket\n", {(2, "socket")}),
    "environment": ("import torch\nimport os\nos.environ['FSDP_IMPL'] = 'reference'\n", {(3, "environment")}),
    "rlimits": ("import torch\nimport resource\n", {(2, "resource")}),
    "unparsable": ("import torch\ndef f(:\n", {(2, "unreadable")}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_is_flagged_with_its_line(case):
    source, expected = CASES[case]
    got = {(f["line"], f["kind"]) for f in review.review_source(source)}
    assert got == expected, f"{case}: flagged {got}, expected {expected}"


EVASIONS = {**ISSUE_36, **MORE, **ISSUE_40}


@pytest.mark.parametrize("case", sorted(EVASIONS))
def test_each_evasion_is_flagged_with_its_line(case):
    """Issue 36's 27 spellings the review of issue 32 did not flag (the UTF-7 cookie among them), and more
    spellings of the same accesses: each is flagged, on Python's line for it, with the expected kind."""
    source, expected = EVASIONS[case]
    flags = review.review_source(source)
    got = {(f["line"], f["kind"]) for f in flags}
    assert got == expected, f"{case}: flagged {got}, expected {expected}: {flags}"
    assert all(f["code"] for f in flags if f["line"] > 0), f"{case}: a flag without its code: {flags}"


def test_the_utf7_lie_is_read_as_python_reads_it():
    """A coding cookie decides what runs: the review flags the cookie, and the lines hidden in the "comment"
    are flagged on Python's line numbers, with the text Python runs as their code."""
    source, _ = ISSUE_36["the UTF-7 cookie"]
    namespace: dict = {}
    exec(compile(source.replace(b"import torch\n", b"\n").replace(b"torch.UntypedStorage.size", b"SIZES_LIE"),
                 "lie.py", "exec"), namespace)  # Python runs the hidden lines: the lie is real
    assert "SIZES_LIE" in namespace and "_caller" in namespace
    flags = {(f["line"], f["kind"]): f for f in review.review_source(source)}
    assert "utf-7" in flags[(1, "encoding")]["what"]
    assert flags[(5, "frame")]["code"] == "_caller = sys._getframe(1)"
    assert flags[(6, "patch")]["what"] == "assigns torch.UntypedStorage.size"
    assert b"sys._getframe" in source and source.count(b"\n") == 4  # four lines as written, seven as run


def test_a_flood_of_flags_is_capped_per_file():
    flags = review.review_files({"t.py": "import torch\n" + "import ctypes\n" * (review.MAX_FLAGS_PER_FILE + 50)})
    assert len(flags) == review.MAX_FLAGS_PER_FILE + 1
    assert flags[-1]["kind"] == "truncated" and flags[-1]["what"].startswith("50 further flag(s)")


def test_the_lies_are_flagged_on_their_lying_lines_and_their_honest_twins_are_not():
    """staff/grader_selftest/lies.py: each honest bug flags nothing; each lie is flagged on the line that
    installs it (a patch of torch's storage sizes, of the tests' collective counter reached through
    sys.modules), and on the frames it walks."""
    from staff.grader_selftest import lies
    reference = reference_student_files()
    for lie in lies.LIES:  # the files each changes (the others are the reference's, reviewed below)
        honest = {k: v for k, v in lies.files(lie, lying=False).items() if v != reference.get(k)}
        assert honest and review.review_files(honest) == [], lie.id
        files = {k: v for k, v in lies.files(lie, lying=True).items() if v != reference.get(k)}
        flags = {(f["file"], f["line"], f["kind"]) for f in review.review_files(files)}
        for path, text in files.items():
            for n, line in enumerate(text.splitlines(), start=1):
                if any(s in line for s in ("UntypedStorage.size =", "UntypedStorage.nbytes =", "._record = ")):
                    assert (path, n, "patch") in flags, (lie.id, n, line)
                if "sys._getframe" in line or "f_locals" in line:
                    assert (path, n, "frame") in flags, (lie.id, n, line)


def test_a_failure_of_the_review_on_one_file_leaves_the_others_reviewed(monkeypatch):
    """(1,500 files of the standard library were reviewed without one; this is the net for the next.)"""
    real = review.Review.visit

    def visit(self, tree):
        if any(isinstance(n, ast.Global) for n in ast.walk(tree)):
            raise KeyError("planted")
        return real(self, tree)

    monkeypatch.setattr(review.Review, "visit", visit)
    flags = review.review_files({"a.py": "global x\n", "b.py": "import ctypes\n"})
    assert [(f["file"], f["kind"]) for f in flags] == [("a.py", "unreadable"), ("b.py", "ctypes")]
    assert "KeyError" in flags[0]["what"]


def test_honest_idioms_are_not_flagged():
    assert review.review_source(HONEST) == []


def test_what_a_correct_implementation_does_is_not_flagged():
    """Attributes set on the model's modules, a function's own names that shadow a module, setattr on a
    submodule, torch's collectives called, weakref and threads: none of it reaches into the grader."""
    source = textwrap.dedent("""\
        import threading
        import weakref

        import torch
        import torch.distributed as dist
        import torch.nn as nn
        from torch.distributed import all_gather_into_tensor

        def f(module, dist_group, sub, attr, views):
            module.forward = lambda x: x
            setattr(sub, attr, views[attr])
            dist.all_reduce(torch.ones(1), group=dist_group)
            all_gather_into_tensor(torch.ones(2), torch.ones(1))
            nn.Module.register_forward_pre_hook

        def g(dist):
            dist.x = 1  # a parameter named like the module: not the module

        REF = weakref.WeakKeyDictionary()
        LOCK = threading.Lock()
    """)
    assert review.review_source(source) == []


def test_the_reference_and_the_staff_alternatives_flag_nothing():
    files = reference_student_files()
    alternatives = ROOT / "staff" / "alternatives" / "fsdp_assignment"
    files.update({str(p.relative_to(ROOT)): p.read_text() for p in sorted(alternatives.glob("task*.py"))})
    stubs = {rel: (ROOT / rel).read_text() for rel in grade.task_files(ROOT)}
    assert review.review_files({**files, **{"stub/" + k: v for k, v in stubs.items()}}) == []


CORPUS = ROOT / "staff" / "grader_selftest" / "honest_corpus"
# Issue 40's idioms of honest FSDP code (each in the corpus, spelt as a student spells it): the corpus must keep
# showing every one, or a narrowing of the review could go untested.
CORPUS_IDIOMS = ("__dict__.pop(attr", "__dict__[attr] = view", '__dict__.get("_fsdp_unit")', "cls.__mro__",
                 "type(module).__mro__", "torch.utils.swap_tensors(", "self._index = index", "flat._index",
                 "flat_param_of(u)._index", "del owner._parameters[attr]", "nn.Module.__setattr__(",
                 "object.__setattr__(", "type(name, (FSDPMixin, cls)", "module.__class__ = ", "setattr(sub, name",
                 "register_multi_grad_hook(", "Variable._execution_engine.queue_callback(", "untyped_storage().resize_(0)",
                 "param.data = ", "weakref.ref(", "weakref.finalize(", "functools.partial(", "@contextlib.contextmanager",
                 "@dataclasses.dataclass", "enum.Enum", "register_forward_pre_hook(", "register_full_backward_pre_hook(",
                 "register_post_accumulate_grad_hook(", ".register_hook(", "getattr(torch.optim, ", "vars(module)",
                 "self.__dict__.update(", "__slots__", "p._order = i", 'setattr(module, f"_buf_{i}"', "self._record",
                 "_reduce_scatter_base(", "torch.Tensor._make_subclass(")


def _corpus() -> dict[str, dict[str, str]]:
    """{student: {fsdp_assignment/taskN_*.py: text}}: one submission per folder of the honest corpus."""
    return {student.name: {p.relative_to(student).as_posix(): p.read_text()
                           for p in sorted(student.glob("fsdp_assignment/task*.py"))}
            for student in sorted(CORPUS.iterdir()) if student.is_dir()}


def test_the_honest_corpus_flags_nothing(capsys):
    """Issue 40, item 6: honest FSDP code written in other styles than the staff's (staff/grader_selftest/
    honest_corpus, one submission per folder, reviewed as a TA reviews a folder of submissions) gets no finding,
    and the corpus holds every idiom the issue names. (Before issue 40 the review gave it 12 flags.)"""
    corpus = _corpus()
    assert len(corpus) >= 4 and all(corpus.values()), sorted(corpus)
    text = "\n".join(t for files in corpus.values() for t in files.values())
    assert [idiom for idiom in CORPUS_IDIOMS if idiom not in text] == []
    assert review.main([str(CORPUS)]) == 0
    out = capsys.readouterr().out
    assert out.count("nothing flagged") == len(corpus), out


def test_a_private_name_is_the_submissions_where_any_of_its_files_defines_it():
    """The student's FlatParameter defines ``_index`` in Task 2 and Task 3 reads it: reviewed as one submission,
    nothing; Task 3 alone (where nothing defines it) is flagged, as the tests' counter's ``_index`` would be."""
    files = _corpus()["dict_views"]
    alone = review.review_source(files["fsdp_assignment/task3_forward.py"])
    assert {f["kind"] for f in alone} == {"harness"} and all("_index" in f["what"] for f in alone), alone
    assert review.review_files(files) == []
    # Assigning the name on an object the function was handed defines nothing (the lie's own move).
    lie = dict(files, **{"fsdp_assignment/task9_x.py": "def f(work):\n    work._pending = set()\n"})
    del lie["fsdp_assignment/task3_forward.py"], lie["fsdp_assignment/task4_backward.py"]
    assert [(f["line"], f["kind"]) for f in review.review_files(lie)] == [(2, "harness")]


def test_the_torch_names_the_instrumentation_shares_are_torchs():
    """A private name of the tests' classes that torch's ProcessGroup or torch.distributed defines too is not
    flagged (``dist._reduce_scatter_base`` is torch's); the list names exactly those."""
    import torch.distributed as dist
    from staff.autograder.review_instrumentation import TORCH_NAMES, instrumentation_names
    torch_names = set(dir(dist.ProcessGroup)) | set(dir(dist.distributed_c10d)) | set(dir(dist.Work))
    assert TORCH_NAMES == set(instrumentation_names()) & torch_names


def _graded_tree(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "fsdp_assignment").mkdir()
    (tmp_path / "fsdp_assignment" / "task3_forward.py").write_text("import torch\nimport ctypes\n")
    (tmp_path / "fsdp_assignment" / "task1_meta_init.py").write_text("import torch\n")
    results = tmp_path / "results" / "results.json"
    results.parent.mkdir()
    results.write_text(json.dumps({"score": 1.0, "execution_time": 1, "output": "table", "stdout_visibility": "hidden",
                                   "tests": [{"name": "Task 3 public: t", "number": "3.1", "score": 1.0,
                                              "max_score": 1.0, "status": "passed", "output": "ok",
                                              "visibility": "visible"}]}))
    return tmp_path, results


def test_the_review_is_in_results_json_for_staff_only(tmp_path):
    """grade.py adds the review to results.json where Gradescope stores it but shows nothing (extra_data), and
    nowhere a student reads (the top-level output, any test's output or name). No audit log: no runtime
    findings, said once."""
    tree, results = _graded_tree(tmp_path)
    said: list[str] = []
    review.add_staff_review(tree, results, said.append)
    data = json.loads(results.read_text())
    assert results_schema.validate(data) == []
    staff = data["extra_data"]["staff_review"]
    assert [(f["file"], f["line"], f["kind"]) for f in staff["flags"]] == [("fsdp_assignment/task3_forward.py", 2,
                                                                            "ctypes")]
    assert staff["runtime"] == [] and sum("no runtime findings" in line for line in said) == 1
    assert "grade:   fsdp_assignment/task3_forward.py:2: ctypes: import ctypes  |  import ctypes" in said
    shown = json.dumps({"output": data["output"], "tests": data["tests"]})
    assert "ctypes" not in shown and "review" not in shown


def test_every_issue_36_case_is_in_results_json_with_its_file_and_line(tmp_path):
    """Issue 36's "done when": each case, as a task file of a graded tree, is in results.json's staff review
    section with its file and line (seven cases a round, one per task file)."""
    tree, results = _graded_tree(tmp_path)
    task_files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "fsdp_assignment").glob("task[0-9]_*.py"))
    cases = sorted(ISSUE_36)
    blank = results.read_text()
    for start in range(0, len(cases), len(task_files)):
        chunk = dict(zip(task_files, cases[start:start + len(task_files)]))
        for rel in task_files:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            source = ISSUE_36[chunk[rel]][0] if rel in chunk else "import torch\n"
            (tree / rel).write_bytes(source if isinstance(source, bytes) else source.encode())
        results.write_text(blank)
        review.add_staff_review(tree, results, lambda line: None)
        flags = json.loads(results.read_text())["extra_data"]["staff_review"]["flags"]
        for rel, case in chunk.items():
            got = {(f["line"], f["kind"]) for f in flags if f["file"] == rel}
            assert got == ISSUE_36[case][1], (case, got)


def test_runtime_findings_are_stored_and_printed_capped(tmp_path):
    """The rank audit's findings (seam 3: JSON lines in audit.jsonl beside results.json) are stored under
    staff_review.runtime and printed like static flags; repeats are merged with a count, a flood is capped at
    MAX_RUNTIME_FINDINGS, and a line that is not a finding is counted, not trusted."""
    tree, results = _graded_tree(tmp_path)
    (tree / "fsdp_assignment" / "task3_forward.py").write_bytes(
        b"# -*- coding: utf-7 -*-\nimport torch\n# x+AAo-import sys+AAo-import ctypes\n\n\nf = sys._getframe(1)\n")
    event = {"file": "fsdp_assignment/task3_forward.py", "line": 8, "kind": "frame", "what": "sys._getframe",
             "code": "", "test": "tests/public/test_task3_forward.py::test_x", "rank": 1, "source": "runtime"}
    flood = [dict(event, line=1000 + i, what=f"open /proc/{i}\u202e") for i in range(3 * review.MAX_RUNTIME_FINDINGS)]
    lines = [json.dumps(event)] * 5 + ["not json", "[1, 2]"] + [json.dumps(f) for f in flood]
    (results.parent / "audit.jsonl").write_text("\n".join(lines) + "\n")
    said: list[str] = []
    review.add_staff_review(tree, results, said.append)
    runtime = json.loads(results.read_text())["extra_data"]["staff_review"]["runtime"]
    assert len(runtime) == review.MAX_RUNTIME_FINDINGS
    first = runtime[0]
    assert (first["line"], first["kind"], first["count"], first["rank"], first["source"]) == (8, "frame", 5, 1,
                                                                                              "runtime")
    assert all("\u202e" not in f["what"] for f in runtime)  # shown escaped: the log cannot be reordered
    # the code is Python's line 8 (the file shows it on line 6): read as the static review reads it
    assert ("grade:   fsdp_assignment/task3_forward.py:8: frame: sys._getframe  |  f = sys._getframe(1)  "
            "(runtime: tests/public/test_task3_forward.py::test_x, rank 1, 5 times)") in said
    assert any(f"{2 * review.MAX_RUNTIME_FINDINGS + 1} further runtime event(s)" in line for line in said)
    assert any("2 line(s) of the audit log were not findings" in line for line in said)
    assert len(json.dumps(runtime)) < 100_000


def test_the_bundle_ships_every_part_of_the_review():
    """grade.py runs the review inside the Gradescope bundle: every review_*.py module it imports must be in it
    (else the log says "staff review failed: ModuleNotFoundError" and results.json holds no review)."""
    from staff.autograder import build_bundle
    parts = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "staff" / "autograder").glob("review*.py"))
    shipped = {p for pattern in build_bundle.BUNDLE_GLOBS for p in
               (q.relative_to(ROOT).as_posix() for q in ROOT.glob(pattern))}
    assert [p for p in parts if p not in shipped] == [], "add them to build_bundle.BUNDLE_GLOBS"


def test_grade_adds_the_review_through_review_py():
    """Seam 3: grade.py keeps only the call; the review (and the runtime findings) live in review.py."""
    assert not hasattr(grade, "add_staff_review") or grade.add_staff_review is review.add_staff_review
    assert "add_staff_review(tree, results, say)" in (ROOT / "staff" / "autograder" / "grade.py").read_text()


def test_the_staff_command_reviews_a_folder_of_submissions(tmp_path, capsys):
    subs = tmp_path / "submissions"
    (subs / "alice" / "fsdp_assignment").mkdir(parents=True)
    (subs / "alice" / "fsdp_assignment" / "task5_optim_ckpt.py").write_text("import torch\n\nimport gc\n"
                                                                            "x = gc.get_objects()\n")
    with zipfile.ZipFile(subs / "bob.zip", "w") as zf:
        zf.writestr("fsdp_assignment/task7_fully_shard.py", "import torch\nimport torch.distributed as d\n"
                                                              "d.all_reduce = None\n")
    with zipfile.ZipFile(subs / "carol.zip", "w") as zf:
        zf.writestr("fsdp_assignment/task7_fully_shard.py", "import torch\n")
    out_json = tmp_path / "review.json"
    assert review.main([str(subs), "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert {k: [(f["file"], f["line"], f["kind"]) for f in v] for k, v in report.items()} == {
        "alice": [("fsdp_assignment/task5_optim_ckpt.py", 4, "gc")],
        "bob.zip": [("fsdp_assignment/task7_fully_shard.py", 3, "patch")],
        "carol.zip": []}
    assert "bob.zip: 1 flag(s)" in capsys.readouterr().out


def test_a_ta_reviews_every_case_as_zips(tmp_path, capsys):
    """Every evasion as a student's zip, through the staff command a TA runs (python -m staff.autograder.review
    SUBMISSIONS): each is flagged with its file and line, bytes and cookie as submitted."""
    subs = tmp_path / "submissions"
    subs.mkdir()
    names = {}
    for i, (case, (source, _)) in enumerate(sorted(EVASIONS.items())):
        names[f"student{i:02d}.zip"] = case
        with zipfile.ZipFile(subs / f"student{i:02d}.zip", "w") as zf:
            zf.writestr("fsdp_assignment/task4_backward.py",
                        source if isinstance(source, bytes) else source.encode("utf-8"))
    out_json = tmp_path / "review.json"
    assert review.main([str(subs), "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    for zip_name, case in names.items():
        got = {(f["file"], f["line"], f["kind"]) for f in report[zip_name]}
        assert got == {("fsdp_assignment/task4_backward.py", line, kind) for line, kind in EVASIONS[case][1]}, case
    assert "nothing flagged" not in capsys.readouterr().out


def test_help_says_what_the_review_reads_and_cannot_see(capsys):
    with pytest.raises(SystemExit):
        review.main(["--help"])
    text = " ".join(capsys.readouterr().out.split()).lower()
    for words in ("coding cookie", "what it cannot see", "runtime audit", "audit.jsonl"):
        assert words in text, f"review --help does not say {words!r}"


def test_a_lie_to_the_tests_instrumentation_is_flagged_on_its_lines():
    """Issue 35's rs_waited_at_once: a reduce-scatter waited on at once, its handle put back among the tests'
    counter's unwaited collectives (work._log._pending), which only the in-rank log sees; the kernel cannot judge
    it, so the review flags each use of the counter's private names (kind harness) with its line. Its honest twin,
    the reference, the stubs and the alternatives use none of them; a student's own ``self._state`` is theirs."""
    from staff.autograder.review_instrumentation import instrumentation_names
    from staff.grader_selftest import lies

    assert {"_log", "_pending", "_index", "_record"} <= set(instrumentation_names())
    (lie,) = [x for x in lies.LIES if x.id == "rs_waited_at_once"]
    honest = [f for f in review.review_files(lies.files(lie, False)) if f["kind"] == "harness"]
    lying = [f for f in review.review_files(lies.files(lie, True)) if f["kind"] == "harness"]
    assert honest == []
    text = lies.files(lie, True)["fsdp_assignment/task4_backward.py"].splitlines()
    want = {i + 1 for i, line in enumerate(text) if "_log" in line or "_pending" in line}
    assert want and want <= {f["line"] for f in lying}, (want, lying)
    own = "class Unit:\n    def __init__(self):\n        self._state = 1\n\n    def go(self):\n        return self._state\n"
    assert [f for f in review.review_source(own) if f["kind"] == "harness"] == []
    assert [f for f in review.review_source("def f(w):\n    return w._pending\n") if f["kind"] == "harness"][0]["line"] == 2
