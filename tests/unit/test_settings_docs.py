"""docs/settings.md is what `python -m disagg.settings.markdown` writes, and it names every
setting and every environment variable."""

from __future__ import annotations

from pathlib import Path

from disagg.config import ENV_VARS
from disagg.settings.catalog import serving_settings
from disagg.settings.markdown import COMMAND, render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_committed_settings_page_is_current():
    assert PAGE.read_text() == render(), f"docs/settings.md is stale: regenerate it with `{COMMAND}`"


def test_the_page_lists_every_setting_and_environment_variable():
    text = render()
    for setting in serving_settings():
        assert f"| `{setting.key}` | `{setting.flag}`" in text
    for var in ENV_VARS:
        assert f"| `{var.name}` |" in text


def test_the_page_says_the_same_on_every_machine(monkeypatch, tmp_path):
    """Defaults read from the environment show the variable, not this machine's value."""
    before = render()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DISAGG_WEIGHTS", "int8")
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    assert render() == before
    assert "`$DISAGG_WEIGHTS or auto`" in before
