"""The handout PDF is up to date with its sources (staff only; not in the student release).

``handout.pdf`` is built by ``python staff/build_handout.py`` from ``handout/*.typ`` plus what the build extracts
from the task stubs' docstrings, the points table and ``WRITEUP_TEMPLATE.md``. The build records a digest of all
of that (content only: no mtimes, so a fresh clone checks the same) and the PDF's own SHA-256 in
``handout/build-stamp.json``, and embeds the digest in the PDF's metadata. These tests recompute the digest; they
need neither typst nor the network, and take well under a second.
"""

from __future__ import annotations

import ast
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


def test_handout_has_the_readmes_setup_commands():
    # The build reads them from README.md (and the digest covers them): they must be readable there.
    setup = _build_handout().setup_commands()
    assert setup is not None, "README.md is missing"
    assert "pip install" in setup["install"] and "pytest" in setup["test"], setup


def test_writeup_template_has_every_benchmark_table_header():
    """Each benchmark script's docstring lists the markdown table headers it prints ("Table header(s) (x.md; the
    writeup copies them)"); WRITEUP_TEMPLATE.md must carry each header verbatim, so pasted rows fit."""
    template = (ROOT / "WRITEUP_TEMPLATE.md").read_text(encoding="utf-8")
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    assert scripts, "no benchmarks/bench_*.py"
    missing = []
    for script in scripts:
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
        m = re.search(r"^Table headers? \(.*?\):\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.MULTILINE | re.DOTALL)
        assert m, f"{script.name}: no 'Table header(s) (...):' paragraph in its docstring"
        for header in (line.strip() for line in m.group(1).splitlines() if line.strip().startswith("|")):
            if header not in template:
                missing.append(f"{script.name}: {header}")
    assert not missing, "WRITEUP_TEMPLATE.md lacks these benchmark table headers:\n  " + "\n  ".join(missing)


def test_handout_does_not_mention_the_reference():
    # The PDF goes into the student release, whose check (staff/release.py) cannot read compressed PDF text:
    # check what the PDF is made of instead, with the release's own rule.
    spec = importlib.util.spec_from_file_location("release", ROOT / "staff" / "release.py")
    release = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(release)
    texts = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
             for p in sorted((ROOT / "handout").glob("*.typ"))}
    texts.update({f"build input {k}": v for k, v in _build_handout().inputs().items()})
    found = []
    for name, text in texts.items():
        for n, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("//"):
                continue  # Typst comments do not reach the PDF
            for m in release.MENTION.finditer(line):
                if not release.ALLOWED_MENTIONS.search(line[max(0, m.start() - 30):m.end() + 30]):
                    found.append(f"{name}:{n}: {line.strip()[:120]}")
                    break
    assert not found, "the handout mentions the reference:\n  " + "\n  ".join(found)


def _points():
    spec = importlib.util.spec_from_file_location("_points", ROOT / "tests" / "points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_writeup_points_and_deliverables_match_the_points_table():
    """Every question of WRITEUP_TEMPLATE.md shows its points from tests/points.py and has a "Deliverable:" line;
    every benchmark table section shows its points; nothing in the template is missing from the table, or back."""
    points = _points()
    text = (ROOT / "WRITEUP_TEMPLATE.md").read_text(encoding="utf-8")
    questions = dict(re.findall(r"^\*\*(Q\d+)\.\*\* \*\([^)]*?(\d+) points?\)\*", text, re.MULTILINE))
    assert {q: int(n) for q, n in questions.items()} == points.WRITEUP_QUESTION_POINTS, \
        "WRITEUP_TEMPLATE.md's question points differ from tests/points.py's WRITEUP_QUESTION_POINTS"
    every = re.findall(r"^\*\*(Q\d+)\.\*\*", text, re.MULTILINE)
    assert sorted(every) == sorted(questions), "a question without '*(topic; N points)*'"
    blocks = re.split(r"^(?=\*\*Q\d+\.\*\*|## )", text, flags=re.MULTILINE)
    for block in blocks:
        m = re.match(r"\*\*(Q\d+)\.\*\*", block)
        if m:
            assert re.search(r"^\*Deliverable:\* \S", block, re.MULTILINE), f"{m.group(1)}: no '*Deliverable:*' line"
    tables = dict(re.findall(r"^## (.+?)\n\n\*Deliverable \((\d+) points?\):\* ", text, re.MULTILINE))
    assert {k: int(v) for k, v in tables.items()} == points.WRITEUP_TABLE_POINTS
    assert re.search(rf"^## Bonus.*\n(.*\n)*?\*Deliverable \(up to {points.BONUS_POINTS} points\):\*", text,
                     re.MULTILINE), "WRITEUP_TEMPLATE.md: no bonus section with its points"


def test_the_models_box_copies_the_memory_model_the_benchmark_prints():
    """The handout's Models box states bench_memory.py's peak-memory model term for term; its source carries the
    benchmark's printed formula in a comment, so a change to the benchmark's model fails here until the box follows."""
    printed = re.search(r"Model: (max\(.*?\)) \(see bench_memory\.py\)",
                        (ROOT / "benchmarks" / "bench_memory.py").read_text(encoding="utf-8"))
    assert printed, "bench_memory.py no longer prints 'Model: max(...) (see bench_memory.py)'"
    box = (ROOT / "handout" / "handout.typ").read_text(encoding="utf-8")
    assert f"// bench_memory model: {printed.group(1)}" in box, (
        f"the handout's Models box does not carry bench_memory.py's model {printed.group(1)}: update the box's formula "
        "and terms, then its '// bench_memory model: ...' line")


def test_the_handout_version_is_the_changelogs_newest():
    """The handout prints its version (data.typ's handout-version); CHANGELOG.md, which the release carries, lists
    the versions newest first: the two agree, so a change is never shipped without its entry."""
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    newest = re.search(r"^## (\d+\.\d+\.\d+)", changelog, re.MULTILINE)
    assert newest, "CHANGELOG.md has no '## x.y.z' entry"
    data = (ROOT / "handout" / "data.typ").read_text(encoding="utf-8")
    version = re.search(r'^#let handout-version = "([^"]+)"', data, re.MULTILINE)
    assert version and version.group(1) == newest.group(1), (
        f"handout/data.typ's handout-version ({version.group(1) if version else None}) is not CHANGELOG.md's newest "
        f"entry ({newest.group(1)}): add the entry, or bump the version, and list the change in handout/errata.typ")


def part_points(deliverable: str) -> float:
    """The points of a deliverable's parts: "(1)", "(0.5 + 0.5)" and "(0.5 each: 1.5)" after each part."""
    total = 0.0
    for m in re.finditer(r"\((\d+(?:\.\d+)?)(?: \+ (\d+(?:\.\d+)?))?\)|\(\d+(?:\.\d+)? each: (\d+(?:\.\d+)?)\)",
                         deliverable):
        total += sum(float(g) for g in m.groups() if g)
    return total


def test_every_question_gives_points_per_part_that_add_up():
    """Each question's deliverable splits its points over its parts, (a), (b), ..., and they add up to the
    question's points: the partial-credit promise of the handout, written where the student reads it."""
    points = _points()
    text = (ROOT / "WRITEUP_TEMPLATE.md").read_text(encoding="utf-8")
    wrong = []
    for block in re.split(r"^(?=\*\*Q\d+\.\*\*|## )", text, flags=re.MULTILINE):
        m = re.match(r"\*\*(Q\d+)\.\*\*", block)
        if m:
            deliverable = re.search(r"^\*Deliverable:\* (.*)$", block, re.MULTILINE).group(1)
            got = part_points(deliverable)
            if "(a)" not in deliverable or got != points.WRITEUP_QUESTION_POINTS[m.group(1)]:
                wrong.append(f"{m.group(1)}: parts add up to {got}, the question is worth "
                             f"{points.WRITEUP_QUESTION_POINTS[m.group(1)]}")
    assert not wrong, "WRITEUP_TEMPLATE.md deliverables without points per part that add up:\n  " + "\n  ".join(wrong)


def test_ci_runs_the_readmes_own_commands():
    """.ci/run installs with the README's install line (pip's quiet flags aside) and runs its test command."""
    release = _load_release()
    install, test = release.readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    head, _, args = install.partition("pip install")
    ci_installs = [re.sub(r"\s--(quiet|disable-pip-version-check)\b", "", line) for line in ci if "pip install" in line]
    assert any(line.startswith(head.strip()) and line.endswith(args.strip()) for line in ci_installs), \
        f".ci/run does not run the README's install line `{install}`: {ci_installs}"
    # (report flags after it allowed: .ci/run adds --durations for staff/ci_durations.md)
    assert any(line == test or line.startswith(test + " --durations") for line in ci), \
        f".ci/run does not run the README's test command `{test}`"


def _load_release():
    spec = importlib.util.spec_from_file_location("release", ROOT / "staff" / "release.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _models_box() -> str:
    typ = (ROOT / "handout" / "handout.typ").read_text(encoding="utf-8")
    return typ[typ.index('#callout(title: "Models box"'):typ.index("== How FSDP works")]


def test_every_memory_model_term_is_the_same_in_the_box_the_benchmark_and_the_key():
    """The Models box's terms (its `// term` lines, next to the prose that states them) evaluated for every strategy
    of bench_memory at W = 1, 2, 4 equal what bench_memory.analytic() computes; and the box's prose and the answer
    key name every term. The last round's no-reshard U_end (psi + n_root + 2 tied) fails here."""
    import importlib

    import torch  # noqa: F401  (bench_memory's model reads the GPT on the meta device)

    bench_memory = importlib.import_module("benchmarks.bench_memory")
    trainers = importlib.import_module("benchmarks.trainers")
    from benchmarks import cli

    box = _models_box()
    terms = re.findall(r"^\s*// term (\S+) (U_\w+) = (.+)$", box, re.MULTILINE)
    assert {(k, t) for k, t, _ in terms} >= {("fsdp", "U_p"), ("fsdp", "U_g"), ("fsdp", "U_end"),
                                             ("fsdp-no-reshard", "U_p")}, terms
    cfg = trainers.model_config(bench_memory.parser().parse_args([]))
    wrong = []
    for name in bench_memory.STRATEGIES:
        family, opt = trainers.STRATEGIES[name]
        if family == "ddp":
            continue
        kinds = (["fsdp-no-reshard"] if not opt.get("reshard", True) else []) + \
            (["fsdp"] if family in ("fsdp", "fsdp2") else ["unsharded"])
        for w in (1, 2, 4):
            model = bench_memory.analytic(name, w, cfg, 0.0)
            env = {"psi": model["psi"], "n_root": model["n_root"], "n_block": model["n_block_unit"],
                   "n_blocks": model["n_block_units"], "tied": cfg.vocab_size * cfg.n_embd,
                   "prefetch": int(bool(opt.get("prefetch"))), "min": min}
            for term in ("U_p", "U_g", "U_end"):
                expr = next((e for k in kinds for kk, t, e in terms if kk == k and t == term), None)
                assert expr is not None, f"the Models box has no `// term` line for {term} of {name}"
                if eval(expr, {"__builtins__": {}}, env) != model[term]:
                    wrong.append(f"{name}, W={w}: {term} = {expr} gives {eval(expr, {'__builtins__': {}}, env)}, "
                                 f"bench_memory computes {model[term]}")
    assert not wrong, "the Models box and bench_memory.analytic() disagree:\n  " + "\n  ".join(wrong)
    prose = re.sub(r"^\s*//.*$", "", box, flags=re.MULTILINE)
    key = (ROOT / "staff" / "answer_key" / "key_source.md").read_text(encoding="utf-8")
    for term, typst in (("U_p", "$U_p$"), ("U_g", "$U_g$"), ("U_end", '$U_"end"$')):
        assert typst in prose, f"the Models box's prose does not define {term}"
        assert term in key, f"the answer key never names the model term {term}"
    assert cli  # the benchmark's own flag defaults made cfg


def test_one_symbol_table_and_no_symbol_with_two_meanings():
    """The box's symbol table defines each symbol once; the template, the key, the box and the benchmarks' printed
    formulas use none of the retired double meanings (S as HSDP's shard size, U as a count of units, Psi or N in
    bytes)."""
    box = _models_box()
    table = box[box.index("*0. Symbols*"):box.index("*1. Time of a collective")]
    symbols = re.findall(r"^\s*\[(\$[^\]]+\$)\], \[", table, re.MULTILINE)
    assert len(symbols) == len(set(symbols)) and len(symbols) >= 10, symbols
    for needed in ("$Psi$", "$S$", "$W$", "$b$", "$N$", '$n_"units"$', "$A$"):
        assert any(needed in s for s in symbols), f"the symbol table lacks {needed}"
    texts = {"WRITEUP_TEMPLATE.md": (ROOT / "WRITEUP_TEMPLATE.md").read_text(encoding="utf-8"),
             "key_source.md": (ROOT / "staff" / "answer_key" / "key_source.md").read_text(encoding="utf-8"),
             "the Models box": box,
             **{f"{name}'s docstring": ast.get_docstring(ast.parse((ROOT / "benchmarks" / name).read_text(encoding="utf-8")))
                for name in ("bench_comm.py", "bench_memory.py", "bench_step.py")}}
    retired = [r"\(R, S\)", r"\$\(R, S\)\$", r"\bfor U units\b", r"\b3 ?U ?α|\b3U\b|3 U α|a = 3 ?U\b",
               r"Ψ in bytes|here \$Psi\$ in bytes|Ψ = parameters x 4 bytes", r"\bN bytes\b|buffer of \$N\$ bytes"]
    found = [f"{name}: {m.group(0)!r}" for name, text in texts.items() for pat in retired
             for m in re.finditer(pat, text)]
    assert not found, "a retired double meaning is back:\n  " + "\n  ".join(found)


# ---- Length and each fact once ---------------------------------------------------------------------------
MAX_WORDS = 20_000  # issue 37: 27,599 words before (pypdf's count); CS336's assignment 2 is 19,027 for five topics


def pdf_words(path: Path) -> int:
    """The built PDF's words as pypdf extracts them, the count issue 37 states its limit in."""
    from pypdf import PdfReader
    return len(" ".join(page.extract_text() for page in PdfReader(str(path)).pages).split())


def test_handout_pdf_is_under_the_word_limit():
    pytest.importorskip("pypdf", reason="pypdf counts the PDF's words: pip install -e '.[staff]' (or pip install pypdf)")
    words = pdf_words(ROOT / "handout.pdf")
    assert words < MAX_WORDS, (f"handout.pdf has {words} words (pypdf), over {MAX_WORDS}: cut what the stubs already "
                               "state (the rules live in the stubs' docstrings; the handout points there)")


SHINGLE = 6          # words per shingle
MAX_SHARED = 0.3     # a handout sentence sharing this share of its shingles with the stubs restates them


def _normalised_sentences(text: str) -> list[list[str]]:
    """Sentences as lists of lower-case words, markup (Typst, reST, Markdown) dropped; only those of at least
    ``SHINGLE`` words."""
    text = re.sub(r"[`*_$\\#\[\]]", " ", text.lower())
    text = re.sub(r"[^a-z0-9.;:!?\s-]", " ", text)
    return [s.split() for s in re.split(r"[.;:!?]\s", text) if len(s.split()) >= SHINGLE]


def _shingles(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def restated_sentences(handout_text: str, stub_sources: list[str]) -> list[str]:
    """The handout sentences that share at least ``MAX_SHARED`` of their word shingles with the stubs' docstrings."""
    stub = set()
    for source in stub_sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for sentence in _normalised_sentences(ast.get_docstring(node, clean=False) or ""):
                    stub |= _shingles(sentence)
    text = "\n".join(line for line in handout_text.splitlines() if not line.lstrip().startswith("//"))
    out = []
    for sentence in _normalised_sentences(text):
        shingles = _shingles(sentence)
        if len(shingles & stub) >= MAX_SHARED * len(shingles):
            out.append(" ".join(sentence))
    return out


def test_no_rule_is_stated_both_in_a_stub_and_in_the_task_sections():
    """Each fact once: the stub's docstring states the rule, the handout's task sections pose the problem and point
    to the stub. A sentence of handout/tasks.typ that largely repeats a stub's words is a second statement."""
    stubs = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "fsdp_assignment").glob("task*.py"))]
    restated = restated_sentences((ROOT / "handout" / "tasks.typ").read_text(encoding="utf-8"), stubs)
    assert not restated, ("handout/tasks.typ restates the stubs (say it in one place: the rule in the stub, the "
                          "problem and a pointer in the handout):\n  " + "\n  ".join(restated))


def test_the_restatement_check_finds_a_copied_rule():
    stub = '"""Task 9.\n\nAfter the unit\'s forward its unsharded storage has size 0 and the memory is free."""\n'
    assert restated_sentences("*Rule.* After the unit's forward, its unsharded storage has size 0.", [stub])
    assert not restated_sentences("*Problem.* When may a unit give its memory back?", [stub])


# ---- issue 41: six facts the handout stated twice or more, each stated once now ------------------------------
ONCE = {
    "the autograder copies only the seven task files": r"copies \*?only\*? your\s+seven task files|copies your\s+seven task files",
    "model.parameters() yields this rank's shards": r"`model\.parameters\(\)` yields this rank's shards",
    "rank r keeps only shard r": r"[Rr]ank \$r\$ keeps only\s+shard \$r\$",
    "the bonus writeup's contents (the template's bonus section holds them)": r"the device memory saved and the step time",
    "16 Psi / W bytes per rank (Table 1's FSDP row)": r"^.*16 Psi \\/ W.*$",
    "the total hours (the summary)": r"#total-hours\.at\(0\) to #total-hours\.at\(1\)",
    "where a rank's prints show (Debugging)": r"`\[rank r\]`",
}
ALLOWED = {"the bonus writeup's contents (the template's bonus section holds them)": 0}


def test_each_fact_is_stated_once_in_the_handout():
    """The autograder's copied files, model.parameters() yielding shards, rank r keeping shard r, the bonus writeup's
    contents, 16 Psi / W and the total hours were each stated two to four times (issue 41): once now, referred to
    elsewhere. The Typst comments do not count (they never reach the PDF)."""
    text = "\n".join(typst_lines for p in sorted((ROOT / "handout").glob("*.typ"))
                     for typst_lines in [_typst_text(p.read_text(encoding="utf-8"))])
    wrong = []
    for fact, pattern in ONCE.items():
        n = len(re.findall(pattern, text, re.MULTILINE))
        if n != ALLOWED.get(fact, 1):
            wrong.append(f"{fact}: stated {n} times")
    assert not wrong, "the handout states a fact more than once (or lost it):\n  " + "\n  ".join(wrong)


def _typst_text(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))


def test_the_once_check_finds_a_second_statement():
    twice = "The autograder copies *only* your seven task files.\nThe autograder copies your\nseven task files."
    assert len(re.findall(ONCE["the autograder copies only the seven task files"], twice, re.MULTILINE)) == 2
