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


# ---- the user's pages: short, and naming only what exists -------------------------------------------------
PAGES = ["README.md", "loadtest/RESULTS.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
MODULE = re.compile(r"python3? -m (loadtest(?:\.\w+)+)")
# A path in backticks: words joined by slashes, ending in a file's extension or a folder's slash.
PATH = re.compile(r"`((?:[\w.-]+/)+(?:[\w.-]+\.(?:py|md|yaml|yml|json|jsonl|txt|sh|proto|cpp|pt|toml|csv))?)`")
# Where a page's short paths are relative to: the repository, the package, the engine (docs name
# `worker/actor.py` for `disagg/worker/actor.py` and `layers/csrc/...` under `disagg/engine/`).
BASES = [ROOT, ROOT / "disagg", ROOT / "disagg" / "engine", ROOT / "deploy"]
# Folders benchmarks write into when run: named, not committed.
WRITTEN_BY_RUNS = {"loadtest/results/locust/"}


def page(name: str) -> str:
    return (ROOT / name).read_text()


def test_the_readme_and_the_results_stay_short():
    assert len(page("README.md").splitlines()) <= 250, "README.md: reference material goes to docs/"
    assert len(page("loadtest/RESULTS.md").splitlines()) <= 300, "RESULTS.md: current figures only"


def test_every_benchmark_a_page_runs_exists():
    missing = {
        (name, module)
        for name in PAGES
        for module in MODULE.findall(page(name))
        if not (ROOT / module.replace(".", "/")).with_suffix(".py").exists()
    }
    assert missing == set()


def test_every_path_a_page_names_exists():
    missing = {
        (name, path)
        for name in PAGES
        for path in PATH.findall(page(name))
        if path not in WRITTEN_BY_RUNS and not any((base / path).exists() for base in BASES)
    }
    assert missing == set()


def test_every_link_of_a_page_leads_somewhere():
    missing = {
        (name, target)
        for name in PAGES
        for target in re.findall(r"\]\(([^)#]+)\)", page(name))
        if not target.startswith(("http://", "https://")) and not ((ROOT / name).parent / target).exists()
    }
    assert missing == set()


def test_every_dotted_name_a_page_gives_exists():
    missing = []
    for name in PAGES:
        for dotted in SYMBOL.findall(page(name)):
            try:
                resolve(dotted)
            except (AttributeError, ModuleNotFoundError):
                missing.append((name, dotted))
    assert missing == []
