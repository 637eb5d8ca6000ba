"""A config dataclass's field docs, read from the comments beside its fields in the source.

The comments in disagg/config.py (and disagg/slo.py, the slo group's) are the one source of truth: a field's doc is the block of
comment lines right above it plus any comment on its own lines, joined into one paragraph.
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize

PRAGMAS = ("fmt:", "noqa", "type:")  # tool directives, not prose


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its doc} of dataclass `cls` ("" where it has no comment)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = _comments_by_line(source)
    lines = source.splitlines()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above = _block_above(node.lineno, lines, comments)
            beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            docs[node.target.id] = " ".join(above + beside)
    return docs


def _comments_by_line(source: str) -> dict[int, str]:
    """{line number: its comment's text}, pragmas left out."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if text and not text.startswith(PRAGMAS):
                found[token.start[0]] = text
    return found


def _block_above(lineno: int, lines: list[str], comments: dict[int, str]) -> list[str]:
    """The comment-only lines directly above line `lineno`, in order."""
    block = []
    n = lineno - 1
    while n >= 1 and n in comments and lines[n - 1].lstrip().startswith("#"):
        block.insert(0, comments[n])
        n -= 1
    return block
