"""Every environment variable the code reads is declared once, in disagg.config.ENV_VARS, and
read through `disagg.config.env`: no module of disagg/ but config.py touches os.environ."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from disagg.config import ENV_VARS, EngineConfig, env, set_env_default

PACKAGE = Path(__file__).resolve().parents[2] / "disagg"
CONFIG = PACKAGE / "config.py"
DIRECT_READ = re.compile(r"\bos\.environ\b|\bgetenv\s*\(|\bfrom os import\b.*\b(environ|getenv)\b|\benviron\s*\[")
NAMED_READ = re.compile(r"\b(?:env|set_env_default|EnvDefault)\(\s*\"([A-Za-z_][A-Za-z0-9_]*)\"")


def sources() -> dict[Path, str]:
    return {path: path.read_text() for path in PACKAGE.rglob("*.py") if "v1" not in path.relative_to(PACKAGE).parts}


def test_no_module_but_config_reads_the_environment_directly():
    readers = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path, text in sources().items()
        if path != CONFIG
        for n, line in enumerate(text.splitlines(), 1)
        if DIRECT_READ.search(line)
    ]
    assert readers == [], "read it through disagg.config.env (declare it in ENV_VARS)"


def test_the_check_sees_a_direct_read():
    assert DIRECT_READ.search('seal = os.environ.get("X", "y")') and DIRECT_READ.search("os.getenv('X')")


def test_every_variable_read_by_name_is_declared():
    declared = {var.name for var in ENV_VARS}
    named = {name for text in sources().values() for name in NAMED_READ.findall(text)}
    assert named, "the pattern finds the reads"
    assert named - declared == set()


def test_every_declared_variable_is_read_somewhere():
    """A declaration outlives no read: its name appears in the code beyond ENV_VARS itself."""
    config_text = CONFIG.read_text()
    start = config_text.index("ENV_VARS = (")
    end = config_text.index("\n)\n", start)
    code = config_text[:start] + config_text[end:]
    code += "".join(text for path, text in sources().items() if path != CONFIG)
    assert [var.name for var in ENV_VARS if f'"{var.name}"' not in code] == []


def test_an_undeclared_variable_cannot_be_read():
    with pytest.raises(KeyError, match="not declared"):
        env("DISAGG_NO_SUCH_THING")
    with pytest.raises(KeyError, match="not declared"):
        set_env_default("DISAGG_NO_SUCH_THING")


def test_unset_or_empty_gives_the_declared_default(monkeypatch):
    monkeypatch.delenv("DISAGG_KV_SEAL", raising=False)
    assert env("DISAGG_KV_SEAL") == "cross-host"
    monkeypatch.setenv("DISAGG_KV_SEAL", " ")
    assert env("DISAGG_KV_SEAL") == "cross-host"
    monkeypatch.setenv("DISAGG_KV_SEAL", "always")
    assert env("DISAGG_KV_SEAL") == "always"


def test_settings_defaults_come_from_their_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("DISAGG_WEIGHTS", " INT8 ")
    monkeypatch.setenv("DISAGG_ENFORCE_EAGER", "1")
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    config = EngineConfig()
    assert (config.weights, config.enforce_eager, config.cache_dir) == ("int8", True, str(tmp_path))
    monkeypatch.delenv("DISAGG_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert EngineConfig().cache_dir == str(tmp_path / ".cache" / "disagg")
