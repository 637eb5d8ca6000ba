"""The documents name what exists: every symbol in docs/architecture.md's path of one request
resolves to a real function or class, the files the page says the path names are those it names,
and the README links nothing outside the repository."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYMBOL = re.compile(r"`(disagg(?:\.\w+)+)`")


def request_walkthrough() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## One request, hop by hop")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def resolve(dotted: str):
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return target
    raise ModuleNotFoundError(dotted)


def test_every_symbol_of_the_request_walkthrough_exists():
    names = SYMBOL.findall(request_walkthrough())
    assert len(names) >= 20, "the walk-through names the functions a request passes through"
    missing = []
    for name in names:
        try:
            resolve(name)
        except (AttributeError, ModuleNotFoundError):
            missing.append(name)
    assert missing == []


def files_named(text: str) -> set[str]:
    """The files of the modules `disagg....` names in `text`."""
    files = set()
    for dotted in SYMBOL.findall(text):
        parts = dotted.split(".")
        found = next(
            (
                "/".join(parts[:k]) + ".py"
                for k in range(len(parts), 0, -1)
                if (ROOT / "/".join(parts[:k])).with_suffix(".py").exists()
            ),
            None,
        )
        files.add(found or dotted)
    return files


def test_the_path_names_as_many_files_as_the_page_says_and_at_most_30():
    path = request_walkthrough()
    http, summary = path.index("**Over HTTP**"), path.index("**What it takes to follow.**")
    grpc_files = files_named(path[:http])
    http_files = (grpc_files - {"disagg/router/frontend.py"}) | files_named(path[http:summary])
    stated = re.search(r"The gRPC path names (\d+) files.*?over HTTP, (\d+)", path[summary:], re.S)
    assert stated is not None, "the page states how many files the path names"
    assert (len(grpc_files), len(http_files)) == (int(stated.group(1)), int(stated.group(2)))
    assert len(http_files) <= 30


def test_the_readme_links_nothing_outside_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "../" not in re.sub(r"```.*?```", "", readme, flags=re.S)
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target
