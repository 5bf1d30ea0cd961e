"""A submitted file's text as Python reads it, and the places where what it shows differs from what runs.

Python decodes a source file by its BOM or its coding cookie (PEP 263: ``# -*- coding: NAME -*-`` on line 1 or
2), not as UTF-8. Under ``# -*- coding: utf-7 -*-``, ``+AAo-`` is a newline: a "comment" that an editor, a diff
and a UTF-8 reader show as one line is, to Python, several lines of code (issue 36). So the review reads the
text exactly as the import does (``tokenize.detect_encoding``, then that codec, then universal newlines), gives
every flag Python's line number, and flags here (kinds ``encoding`` and ``display``) what a person reading the
file would not see:

- a file in any encoding but UTF-8: the cookie's line, and each line of code that is not in the file as written;
- a file Python cannot decode (then it runs nothing: every test that imports it fails);
- characters that display differently from what executes: bidirectional controls (Trojan Source), zero-width
  and other invisible format characters, line and paragraph separators (U+2028/2029), a form feed or vertical
  tab inside a line, a lone carriage return (Python ends the line there; a terminal overwrites it);
- identifiers Python folds to another spelling (NFKC: ``ｓｙｓ`` is ``sys``).
"""

from __future__ import annotations

import io
import re
import tokenize
import unicodedata

NEWLINE = re.compile(r"\r\n|\r|\n")
SUSPECT = re.compile(r"[^\t\n\r\x20-\x7e]")  # what hidden_char has to look at: controls and non-ASCII
FILLERS = {"\u115f", "\u1160", "\u3164", "\uffa0", "\u180e", "\u034f"}  # invisible letters and joiners
BIDI = set("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")


def hidden_char(c: str) -> bool:
    """A character that shows as nothing, or changes how its neighbours show."""
    return c in FILLERS or unicodedata.category(c) in ("Cf", "Zl", "Zp") or c in "\x0b\x0c" or \
        (unicodedata.category(c) == "Cc" and c not in "\t\n\r")


def shown(line: str, limit: int = 160) -> str:
    """A line as the log may print it: every hidden character written as its code, so that the log itself is
    not reordered or hidden by what it quotes."""
    line = line.strip()
    if not SUSPECT.search(line):
        return line[:limit]
    out = "".join(f"\\u{ord(c):04x}" if hidden_char(c) else c for c in line)
    return out[:limit]


def _describe(c: str) -> str:
    name = unicodedata.name(c, "") or {"\x0b": "VERTICAL TAB", "\x0c": "FORM FEED"}.get(c, "CONTROL")
    return f"U+{ord(c):04X} {name}"


class Decoded:
    """``text`` (what Python runs, newlines made ``\\n``), ``lines`` (Python's numbering: ``lines[n - 1]`` is
    line n), ``encoding``, ``runs`` (False when Python cannot decode the file) and ``flags``."""

    def __init__(self, data: bytes | str):
        self.flags: list[dict] = []
        self.encoding, self.runs = "utf-8", True
        if isinstance(data, str):  # already text (a test's snippet): no cookie applies, as for compile(str)
            raw_text = data
        else:
            raw_text = self._decode(data)
        self.text = NEWLINE.sub("\n", raw_text)
        self.lines = self.text.split("\n")
        if self.runs:
            self._characters(raw_text)
            if not self.text.isascii():
                self._identifiers()
        if isinstance(data, bytes) and self.encoding not in ("utf-8", "utf-8-sig") and self.runs:
            self._lines_not_as_written(data)

    def flag(self, line: int, kind: str, what: str) -> None:
        code = shown(self.lines[line - 1]) if 0 < line <= len(self.lines) else ""
        self.flags.append({"line": line, "kind": kind, "what": what, "code": code})

    def _decode(self, data: bytes) -> str:
        try:
            self.encoding, read = tokenize.detect_encoding(io.BytesIO(data).readline)
            text = data.decode(self.encoding)
        except (SyntaxError, LookupError, UnicodeDecodeError) as err:
            self.runs = False
            text = data.decode("utf-8", errors="replace")
            self.lines = NEWLINE.sub("\n", text).split("\n")
            line = getattr(err, "lineno", None) or (data[:getattr(err, "start", 0)].count(b"\n") + 1)
            self.flag(line, "encoding", f"Python cannot decode this file ({type(err).__name__}: {str(err)[:120]}): "
                                        f"importing it fails, so none of it runs (the tests grade it so)")
            return text
        if self.encoding not in ("utf-8", "utf-8-sig"):
            self.lines = NEWLINE.sub("\n", text).split("\n")
            self.flag(len(read), "encoding",
                      f"coding cookie: Python decodes this file as {self.encoding}, not UTF-8; what an editor, a "
                      f"diff or this log shows can differ from what runs (flags give Python's lines)")
        return text

    def _characters(self, raw_text: str) -> None:
        parts = NEWLINE.split(raw_text)
        ends = NEWLINE.findall(raw_text)
        for n, line in enumerate(parts, start=1):
            found = sorted({c for c in SUSPECT.findall(line) if hidden_char(c)} -
                           ({"\x0c"} if not line.strip(" \t\x0c") else set()))
            if found:
                kinds = ("bidirectional control" if any(c in BIDI for c in found) else
                         "invisible character" if any(c not in "\x0b\x0c" for c in found) else "page control")
                self.flag(n, "display", f"{kinds} ({', '.join(map(_describe, found[:4]))}): the line displays "
                                        f"differently from what Python runs")
            if n <= len(ends) and ends[n - 1] == "\r" and n < len(parts) and parts[n].strip():
                self.flag(n + 1, "display", "a lone carriage return ends the line before: Python runs this as "
                                            "its own line, a terminal prints it over the line before")

    def _identifiers(self) -> None:
        try:
            for tok in tokenize.generate_tokens(io.StringIO(self.text).readline):
                if tok.type == tokenize.NAME and not tok.string.isascii():
                    folded = unicodedata.normalize("NFKC", tok.string)
                    if folded != tok.string:
                        self.flag(tok.start[0], "display", f"identifier {shown(tok.string)!r} is {folded!r} to "
                                                           f"Python (NFKC): it reads as another name than it shows")
        except (tokenize.TokenError, SyntaxError, IndentationError):
            pass  # the parse reports what does not tokenize

    def _lines_not_as_written(self, data: bytes) -> None:
        """Lines of code that Python's decoding makes and the file does not show (UTF-7's ``+AAo-``)."""
        written = {line.strip() for line in NEWLINE.split(data.decode("latin-1"))}
        for n, line in enumerate(self.lines, start=1):
            text = line.strip()
            if text and not text.startswith("#") and text not in written:
                self.flag(n, "encoding", f"this line is not in the file as written: Python's {self.encoding} "
                                         f"decoding makes it")
