"""The documents name what exists: every symbol in docs/architecture.md's walk through one request
resolves to a real function or class, and the README links nothing outside the repository."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYMBOL = re.compile(r"`(disagg(?:\.\w+)+)`")


def request_walkthrough() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## One request, function by function")
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


def test_the_readme_links_nothing_outside_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "../" not in re.sub(r"```.*?```", "", readme, flags=re.S)
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target
