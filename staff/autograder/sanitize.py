"""Text from a submission as the grader shows it, in results.json and in the log.

A submission controls much of what the grader prints: exception messages, its output, the names of the files and
folders it uploads. None of it may change how the rest reads: no terminal escape (colours, cursor moves,
hyperlinks, title changes), no carriage return that hides a line behind a fake verdict, no bidirectional control
that shows text in another order than it is stored ("Trojan Source"), no line or paragraph separator that a
viewer draws as a new line. Escape sequences are removed; every other such character is shown escaped
(``\\r``, ``\\x07``, ``\\u202e``), so the student still sees that it was there.
"""

from __future__ import annotations

import codecs
import re

_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]|\x9b[0-?]*[ -/]*[@-~]")
# C0 and C1 controls but tab and newline (U+0085, NEXT LINE, is C1); bidi embeddings, overrides, isolates and
# marks (U+202A-202E, U+2066-2069, U+200E/F, U+061C); the line and paragraph separators U+2028/2029.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def _shown(m: re.Match) -> str:
    c = m.group()
    if c == "\r":
        return "\\r"
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def sanitize(text: str) -> str:
    """``text`` with escape sequences removed and other control, bidi and separator characters shown escaped;
    newlines and tabs kept."""
    return _CONTROLS.sub(_shown, _ESCAPES.sub("", text))


def one_line(text: str) -> str:
    """``text`` sanitized and on one line (its newlines and tabs escaped too): for a name the submission chose
    (a file or folder) inside a note of the grader's own, where a newline would start a line of its choosing."""
    return sanitize(text).replace("\n", "\\n").replace("\t", "\\t")


class LineSanitizer:
    """Bytes from a stream (pytest's output) -> sanitized text, a line at a time: an escape sequence or a UTF-8
    character split across two reads is seen whole. A line longer than ``max_line`` is cut there."""

    def __init__(self, max_line: int = 1 << 16):
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.max_line = max_line

    def feed(self, data: bytes) -> str:
        """The complete lines in what has come so far (each ending with a newline), sanitized."""
        self._pending += self._decode.decode(data)
        cut = self._pending.rfind("\n") + 1
        if not cut and len(self._pending) > self.max_line:
            cut = len(self._pending)
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        return sanitize(ready)

    def close(self) -> str:
        """What is left (the last line, without its newline), sanitized."""
        rest, self._pending = self._pending + self._decode.decode(b"", final=True), ""
        return sanitize(rest)
