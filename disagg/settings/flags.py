"""`disagg serve` flags, one per setting of the serving config (catalog.py), as vLLM's
arg_utils.py makes its engine arguments from its config classes.

A group's settings carry its name: `--engine.max-num-seqs 64`, `--prefill.num-instances 2`,
`--slo.ttft-ms 400`. Booleans are `--x` / `--no-x`; mapping and list settings take JSON; numbers
are numbers; `null` unsets a setting that may be unset. No flag checks a value: the settings go to the
config's own validation, so a bad value reads as it would in a config file.
"""

from __future__ import annotations

import argparse
import json

from disagg.errors import InvalidRequestError
from disagg.settings.catalog import Setting, arms, is_switch, serving_groups, serving_settings

ALIASES = {"engine.model": ("--model",)}  # flags `disagg serve` had before every setting was one


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in a section per group, each with its doc and default."""
    for group in serving_groups():
        title = f"{group.name} settings" if group.name else "serving settings"
        section = parser.add_argument_group(title, _escaped(group.doc))
        for setting in group.settings:
            _add(section, setting)


def settings_from_flags(args: argparse.Namespace) -> dict:
    """The settings the command line gave, nested as a config file nests them."""
    given = vars(args)
    settings: dict = {}
    for setting in serving_settings():
        if setting.key in given:
            into = settings.setdefault(setting.group, {}) if setting.group else settings
            into[setting.name] = parse_value(setting, given[setting.key])
    return settings


def parse_value(setting: Setting, text: str | bool) -> object:
    """A flag's text as the setting's value; what does not parse stays text, for the config to refuse."""
    types = arms(setting.hint)
    if isinstance(text, bool):
        return text
    if type(None) in types and text == "null":
        return None
    if str in types:
        return text
    if dict in types or list in types:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(setting.name, f"must be JSON ({exc}), got {text!r}") from None
    return _number(text) if (int in types or float in types) else text


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _add(section, setting: Setting) -> None:
    help_text = _escaped(f"{setting.doc} (default: {setting.default})")
    flags = (setting.flag, *ALIASES.get(setting.key, ()))
    if is_switch(setting.hint):
        section.add_argument(*flags, setting.negative_flag, action=_Switch, dest=setting.key, help=help_text)
        return
    section.add_argument(*flags, dest=setting.key, metavar=_metavar(setting), default=argparse.SUPPRESS, help=help_text)


def _metavar(setting: Setting) -> str:
    names = {int: "INT", float: "NUMBER", str: "TEXT", dict: "JSON", list: "JSON", type(None): "null"}
    return "|".join(dict.fromkeys(names.get(arm, "TEXT") for arm in arms(setting.hint)))


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help text with %


class _Switch(argparse.Action):
    """A boolean setting's pair of flags: the first sets it true, the `--no-` one false."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string != self.option_strings[-1])
