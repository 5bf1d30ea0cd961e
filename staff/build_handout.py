"""Build the handout: ``handout/handout.typ`` -> ``handout.pdf`` at the top of the repository.

The one command (staff only; needs the ``typst`` PyPI package, ``pip install typst`` or ``pip install -e '.[handout]'``,
no TeX)::

    python staff/build_handout.py            # rebuild handout.pdf and handout/build-stamp.json
    python staff/build_handout.py --check    # exit 1 when handout.pdf is stale (needs no typst)
    python staff/build_handout.py --png DIR  # also render every page to DIR/page-NN.png (needs pdftoppm)

What goes into the PDF besides the Typst files under ``handout/``: the build extracts, and passes to Typst as JSON
through ``sys.inputs``, so that the handout uses the same words as the files students work with:

- each task stub's public functions and classes: signatures and docstrings (``fsdp_assignment/task*.py``; the
  handout prints the signatures and points to the stub for the rules, stated once there);
- the points per task (``POINTS_SOURCES`` below; a placeholder in ``handout/handout.typ`` when none exists);
- the writeup's sections and questions (``WRITEUP_TEMPLATE.md``);
- the README's set-up commands (install and test), as ``staff/release.py`` reads them.

Staleness: ``source_parts()`` hashes each of the handout's Typst sources, this script, and the JSON inputs above
(content only, line endings normalised: no mtimes, so a fresh clone checks the same; the stub API task by task);
``source_digest()`` hashes those hashes. The build writes the digest, the parts and the PDF's own SHA-256 to
``handout/build-stamp.json`` and puts the digest in the PDF's metadata (keywords), so a stale PDF names what
changed.
``tests/staff/test_handout.py`` (marker ``staff``) recomputes the digest and fails when either differs, with the
command to run. The build is deterministic (no timestamp, Typst's embedded fonts only): building twice gives the
same bytes.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANDOUT_DIR = ROOT / "handout"
MAIN = HANDOUT_DIR / "handout.typ"
PDF = ROOT / "handout.pdf"
STAMP = HANDOUT_DIR / "build-stamp.json"
WRITEUP_TEMPLATE = ROOT / "WRITEUP_TEMPLATE.md"
TASK_FILES = {
    1: "fsdp_assignment/task1_meta_init.py",
    2: "fsdp_assignment/task2_flat_param.py",
    3: "fsdp_assignment/task3_forward.py",
    4: "fsdp_assignment/task4_backward.py",
    5: "fsdp_assignment/task5_optim_ckpt.py",
    6: "fsdp_assignment/task6_prefetch.py",
    7: "fsdp_assignment/task7_fully_shard.py",
}
BUILD_COMMAND = "python staff/build_handout.py"


# ---- Stub API ------------------------------------------------------------------------------------------
def _format_signature(prefix: str, node: ast.FunctionDef, drop_self: bool = False, width: int = 100) -> str:
    """``def name(a, b: int = 1, *, c=None) -> T``, wrapped one argument per line when too long."""
    a = node.args
    parts: list[str] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)

    def one(arg: ast.arg, default) -> str:
        s = arg.arg
        if arg.annotation is not None:
            s += f": {ast.unparse(arg.annotation)}"
            if default is not None:
                s += f" = {ast.unparse(default)}"
        elif default is not None:
            s += f"={ast.unparse(default)}"
        return s

    for i, (arg, default) in enumerate(zip(positional, defaults)):
        if drop_self and i == 0 and arg.arg in ("self", "cls"):
            continue
        parts.append(one(arg, default))
        if a.posonlyargs and arg is a.posonlyargs[-1]:
            parts.append("/")
    if a.vararg is not None:
        parts.append("*" + one(a.vararg, None))
    elif a.kwonlyargs:
        parts.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        parts.append(one(arg, default))
    if a.kwarg is not None:
        parts.append("**" + one(a.kwarg, None))
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    flat = f"{prefix}({', '.join(parts)}){ret}"
    if len(flat) <= width:
        return flat
    return f"{prefix}(\n" + "".join(f"    {p},\n" for p in parts) + f"){ret}"


_CODE_SPAN = re.compile(r"``(.+?)``|`([^`]+?)`")


def _spans(text: str) -> list[dict]:
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(text):
        if m.start() > pos:
            out.append({"code": False, "text": text[pos:m.start()]})
        out.append({"code": True, "text": m.group(1) or m.group(2)})
        pos = m.end()
    if pos < len(text):
        out.append({"code": False, "text": text[pos:]})
    return out


_ALIGNED = re.compile(r"\S {3,}\S")  # a run of spaces inside a line: columns aligned by hand


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def doc_blocks(doc: str | None) -> list[dict]:
    """A docstring as blocks the Typst side renders: text paragraphs (with ``code`` spans), code blocks for
    indented lines (kept verbatim: aligned tables and diagrams stay aligned), and bullet lists."""
    if not doc:
        return []
    lines = inspect.cleandoc(doc).splitlines()
    paras: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            paras[-1].append(line.rstrip())
        elif paras[-1]:
            paras.append([])
    blocks: list[dict] = []
    for para in (p for p in paras if p):
        if any(_ALIGNED.search(line) for line in para[1:]) or (len(para) == 1 and _ALIGNED.search(para[0])):
            # Column-aligned text (a table of formats, attributes): verbatim, after its header line if any.
            if para[0].rstrip().endswith(":") and not _ALIGNED.search(para[0]):
                blocks.append({"kind": "text", "spans": _spans(para[0].strip())})
                para = para[1:]
            blocks.append({"kind": "code", "text": inspect.cleandoc("\n".join(para))})
        elif all(_indent(line) > 0 for line in para):
            blocks.append({"kind": "code", "text": inspect.cleandoc("\n".join(para))})
        elif all(re.match(r"\s*[-*] ", line) or _indent(line) > 0 for line in para) and re.match(r"[-*] ", para[0]):
            items: list[str] = []
            for line in para:
                m = re.match(r"\s*[-*] (.*)", line)
                if m and _indent(line) == 0:
                    items.append(m.group(1))
                else:
                    items[-1] += " " + line.strip()
            blocks.append({"kind": "list", "items": [_spans(it) for it in items]})
        elif len(para) > 1 and para[0].endswith(":") and all(_indent(line) > 0 for line in para[1:]):
            blocks.append({"kind": "text", "spans": _spans(para[0])})
            blocks.append({"kind": "code", "text": inspect.cleandoc("\n".join(para[1:]))})
        else:
            # Prose, possibly followed by an indented block (e.g. "Example:" then code).
            head = []
            i = 0
            while i < len(para) and (_indent(para[i]) == 0 or not head):
                head.append(para[i].strip())
                i += 1
            blocks.append({"kind": "text", "spans": _spans(" ".join(head))})
            if i < len(para):
                blocks.append({"kind": "code", "text": inspect.cleandoc("\n".join(para[i:]))})
    return blocks


def stub_api() -> dict:
    """Task number -> the stub's module docstring and its public functions and classes, in file order."""
    api: dict[str, dict] = {}
    for n, rel in TASK_FILES.items():
        path = ROOT / rel
        if not path.exists():
            api[str(n)] = {"file": rel, "missing": True, "module_doc": [], "entries": []}
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exported = None
        for node in tree.body:  # honour __all__ when the stub declares it
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                exported = set(ast.literal_eval(node.value))
        entries = []
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_") or (exported is not None and node.name not in exported):
                continue
            if isinstance(node, ast.FunctionDef):
                entries.append({"name": node.name, "signature": _format_signature(f"def {node.name}", node),
                                "doc": doc_blocks(ast.get_docstring(node, clean=False)), "members": []})
                continue
            members = []
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            init_sig = f"class {node.name}({bases})" if bases else f"class {node.name}"
            for sub in node.body:
                if not isinstance(sub, ast.FunctionDef):
                    continue
                if sub.name == "__init__":
                    init_sig = _format_signature(f"class {node.name}", sub, drop_self=True)
                    init_doc = doc_blocks(ast.get_docstring(sub, clean=False))
                    if init_doc:
                        members.append({"name": "__init__", "signature": f"{node.name}(...)", "doc": init_doc})
                elif not sub.name.startswith("_"):
                    decorators = {ast.unparse(d) for d in sub.decorator_list}
                    prefix = f"@property {sub.name}" if "property" in decorators else f"def {sub.name}"
                    sig = (f"@property\ndef {sub.name}(self)" if "property" in decorators
                           else _format_signature(prefix, sub, drop_self=True))
                    members.append({"name": sub.name, "signature": sig,
                                    "doc": doc_blocks(ast.get_docstring(sub, clean=False))})
            entries.append({"name": node.name, "signature": init_sig,
                            "doc": doc_blocks(ast.get_docstring(node, clean=False)), "members": members})
        module_doc = doc_blocks(ast.get_docstring(tree, clean=False))
        if module_doc and module_doc[0]["kind"] == "text" and re.fullmatch(
                r"Task \d+: [^.]*\.?", "".join(s["text"] for s in module_doc[0]["spans"])):
            module_doc = module_doc[1:]  # the title line ("Task 4: backward."): the handout has its own heading
        api[str(n)] = {"file": rel, "missing": False, "module_doc": module_doc, "entries": entries}
    return api


# ---- Points ---------------------------------------------------------------------------------------------
# Where the autograder keeps the one points table. The first that exists and yields a table is used; with none,
# handout.typ shows its placeholder (and says so on the page).
POINTS_SOURCES: list[tuple[str, str]] = [("tests/points.py", "TABLE")]


def points_table() -> dict | None:
    for rel, attr in POINTS_SOURCES:
        path = ROOT / rel
        if not path.exists():
            continue
        spec = importlib.util.spec_from_file_location("_points_source", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        table = getattr(module, attr, None)
        if table:
            return {"source": rel, "table": table}
    return None


# ---- Writeup --------------------------------------------------------------------------------------------
_QUESTION = re.compile(r"^\*\*(Q\d+)\.?\*\*\s*(?:\*\(([^)]*)\)\*)?\s*(.*)$")
_DELIVERABLE = re.compile(r"^\*Deliverable(?: \(([^)]*)\))?:\*\s*(.*)$")


def _paragraph(lines: list[str], i: int) -> tuple[str, int]:
    """The paragraph that starts at ``lines[i]`` (joined), and the index of its last line."""
    text = [lines[i].strip()]
    while i + 1 < len(lines) and lines[i + 1].strip() and not lines[i + 1].lstrip().startswith(
            ("**", "#", ">", "|", "- ", "<!--")):
        i += 1
        text.append(lines[i].strip())
    return " ".join(text), i


def writeup_outline() -> dict:
    """Sections (``## `` headings), the questions (``**Q7.** *(topic; N points)* text``) with their
    ``*Deliverable:*`` line, and the sections' own deliverables (``*Deliverable (N points):*``, the benchmark
    tables and the bonus) of WRITEUP_TEMPLATE.md."""
    if not WRITEUP_TEMPLATE.exists():
        return {"sections": [], "questions": [], "section_deliverables": {}}
    sections, questions, section_deliverables = [], [], {}
    current = None
    last = None  # the question or section a *Deliverable:* line belongs to
    lines = WRITEUP_TEMPLATE.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            current = line[3:].strip()
            sections.append(current)
            last = ("section", current)
        m = _QUESTION.match(line.strip())
        d = _DELIVERABLE.match(line.strip())
        if m:
            text, i = _paragraph(lines, i)
            text = _QUESTION.match(text).group(3).strip()
            questions.append({"id": m.group(1), "topic": m.group(2) or "", "section": current,
                              "spans": _spans(text), "deliverable": []})
            last = ("question", questions[-1])
        elif d and last is not None:
            text, i = _paragraph(lines, i)
            spans = _spans(_DELIVERABLE.match(text).group(2).strip())
            if last[0] == "question":
                last[1]["deliverable"] = spans
            else:
                section_deliverables[last[1]] = {"points": d.group(1) or "", "spans": spans}
            last = None
        i += 1
    return {"sections": sections, "questions": questions, "section_deliverables": section_deliverables}


# ---- Set-up commands -----------------------------------------------------------------------------------
def setup_commands() -> dict | None:
    """The README's install and test commands (staff/release.py's reading of them), or None without a README."""
    readme = ROOT / "README.md"
    if not readme.exists():
        return None
    spec = importlib.util.spec_from_file_location("_release", ROOT / "staff" / "release.py")
    release = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(release)
    install, test = release.readme_commands(readme.read_text(encoding="utf-8"))
    return {"install": install, "test": test}


# ---- Inputs, digest, build -------------------------------------------------------------------------------
def inputs() -> dict[str, str]:
    """What the build passes to Typst (``sys.inputs``), each a JSON string."""
    out = {"api": json.dumps(stub_api(), sort_keys=True), "writeup": json.dumps(writeup_outline(), sort_keys=True)}
    setup = setup_commands()
    if setup is not None:
        out["setup"] = json.dumps(setup, sort_keys=True)
    points = points_table()
    if points is not None:
        out["points"] = json.dumps(points, sort_keys=True)
    return out


def _source_files() -> list[Path]:
    files = [p for p in HANDOUT_DIR.rglob("*") if p.is_file() and p != STAMP and "__pycache__" not in p.parts]
    return sorted(files) + [Path(__file__).resolve()]


def source_parts(build_inputs: dict[str, str] | None = None) -> dict[str, str]:
    """What the PDF is made of, part by part -> SHA-256 of its content (LF line endings): each handout source
    file, this script, and each build input (the stub API task by task, so a stale PDF names the stub)."""
    build_inputs = inputs() if build_inputs is None else build_inputs
    parts: dict[str, str] = {}
    for path in _source_files():
        data = path.read_bytes()
        if path.suffix in (".typ", ".py", ".md", ".json", ".txt"):
            data = data.replace(b"\r\n", b"\n")
        parts[path.relative_to(ROOT).as_posix()] = hashlib.sha256(data).hexdigest()
    labels = {"writeup": "the writeup questions in WRITEUP_TEMPLATE.md", "setup": "the set-up commands in README.md",
              "points": "the points table (" + ", ".join(rel for rel, _ in POINTS_SOURCES) + ")"}
    for key, value in sorted(build_inputs.items()):
        if key == "api":
            for n, task in sorted(json.loads(value).items()):
                parts[f"the signatures and docstrings of {task['file']}"] = hashlib.sha256(
                    json.dumps(task, sort_keys=True).encode()).hexdigest()
        else:
            parts[labels.get(key, f"build input {key}")] = hashlib.sha256(value.encode()).hexdigest()
    return parts


def source_digest(build_inputs: dict[str, str] | None = None, parts: dict[str, str] | None = None) -> str:
    """SHA-256 over every part of ``source_parts`` (names and contents): the one number the PDF carries."""
    parts = source_parts(build_inputs) if parts is None else parts
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(name.encode() + b"\0" + parts[name].encode() + b"\n")
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check() -> list[str]:
    """Problems that make handout.pdf stale (empty when it is up to date)."""
    problems = []
    if not PDF.exists():
        return [f"{PDF.relative_to(ROOT)} is missing"]
    if not STAMP.exists():
        return [f"{STAMP.relative_to(ROOT)} is missing"]
    stamp = json.loads(STAMP.read_text(encoding="utf-8"))
    parts = source_parts()
    if stamp.get("sources_sha256") != source_digest(parts=parts):
        built = stamp.get("parts", {})
        changed = sorted(name for name in parts.keys() | built.keys() if parts.get(name) != built.get(name))
        problems.append("its sources changed since handout.pdf was built: " + ("; ".join(changed) or "(unknown)"))
    if stamp.get("pdf_sha256") != file_sha256(PDF):
        problems.append("handout.pdf is not the file the last build wrote (edited or replaced by hand?)")
    elif stamp.get("sources_sha256", "").encode() not in PDF.read_bytes():
        problems.append("handout.pdf does not carry its source digest in its metadata")
    return problems


def build() -> Path:
    try:
        import typst
    except ImportError:
        sys.exit("build_handout: the typst package is missing: pip install typst   (or pip install -e '.[handout]')")
    build_inputs = inputs()
    parts = source_parts(build_inputs)
    digest = source_digest(parts=parts)
    sys_inputs = dict(build_inputs, source_digest=digest)
    try:
        pdf = typst.compile(str(MAIN), root=str(ROOT), ignore_system_fonts=True, sys_inputs=sys_inputs)
    except typst.TypstError as err:  # the message names file, line and column
        sys.exit(f"build_handout: typst failed:\n{getattr(err, 'diagnostic', None) or err}")
    if digest.encode() not in pdf:
        sys.exit("build_handout: the digest did not reach the PDF metadata (handout.typ must set document keywords)")
    PDF.write_bytes(pdf)
    STAMP.write_text(json.dumps({
        "sources_sha256": digest,
        "pdf_sha256": hashlib.sha256(pdf).hexdigest(),
        "typst": getattr(typst, "__version__", "unknown"),
        "rebuild": BUILD_COMMAND,
        "parts": parts,
    }, indent=2) + "\n", encoding="utf-8")
    return PDF


def render_png(out_dir: Path, dpi: int = 80) -> list[Path]:
    if shutil.which("pdftoppm") is None:
        sys.exit("build_handout: pdftoppm not found (apt-get install poppler-utils)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("page-*.png"):
        old.unlink()
    subprocess.run(["pdftoppm", "-png", "-r", str(dpi), str(PDF), str(out_dir / "page")], check=True)
    return sorted(out_dir.glob("page-*.png"))


def main(argv: list[str] | None = None) -> int:
    # the usage block of the docstring (its first three paragraphs), not only its title
    parser = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:3]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that handout.pdf is up to date")
    parser.add_argument("--png", type=Path, metavar="DIR", help="also render every page to DIR/page-NN.png")
    parser.add_argument("--dpi", type=int, default=80)
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(f"stale: {p}", file=sys.stderr)
        if problems:
            print(f"rebuild with: {BUILD_COMMAND}", file=sys.stderr)
            return 1
        print("handout.pdf is up to date")
        return 0
    pdf = build()
    print(f"wrote {pdf.relative_to(ROOT)} ({pdf.stat().st_size // 1024} KiB) and {STAMP.relative_to(ROOT)}")
    if args.png:
        pages = render_png(args.png, args.dpi)
        print(f"rendered {len(pages)} pages to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
