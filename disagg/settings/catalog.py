"""Every setting of a serving config, as `disagg serve` flags and docs/settings.md show it: its
YAML key, its flag, its declared type, its default and its doc."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from disagg.config import (
    SET_BY_POOLS,
    EngineConfig,
    EnvDefault,
    ServingConfig,
    env_default,
    field_types,
    setting_groups,
)
from disagg.settings.field_docs import field_docs


@dataclass(frozen=True)
class Setting:
    group: str  # "" at the top level, else the group's name (engine, prefill, decode, colocated, slo)
    name: str  # the field's
    hint: object  # its declared type
    default: str  # as a config file would write it
    doc: str

    @property
    def key(self) -> str:
        """Where a config file has it: `engine.max_num_seqs`."""
        return f"{self.group}.{self.name}" if self.group else self.name

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def negative_flag(self) -> str:
        """A boolean's `--no-` form: `--engine.no-enable-prefix-caching`."""
        prefix = f"{self.group}." if self.group else ""
        return f"--{prefix}no-{self.name.replace('_', '-')}"


@dataclass(frozen=True)
class Group:
    name: str  # "" for the top level
    doc: str
    settings: tuple[Setting, ...]


def serving_groups() -> list[Group]:
    """The top-level settings, then each group's (engine, the pools, slo), in declaration order."""
    docs = field_docs(ServingConfig)
    groups = setting_groups()
    top = [f for f in dataclasses.fields(ServingConfig) if f.name not in groups]
    listed = [Group("", "frontends, placement, timeouts, security", _settings("", ServingConfig, top))]
    for name, cls in groups.items():
        fields = [f for f in dataclasses.fields(cls) if not (cls is EngineConfig and f.name in SET_BY_POOLS)]
        listed.append(Group(name, docs[name], _settings(name, cls, fields)))
    return listed


def serving_settings() -> list[Setting]:
    return [setting for group in serving_groups() for setting in group.settings]


def _settings(group: str, cls: type, fields: list[dataclasses.Field]) -> tuple[Setting, ...]:
    hints, docs = field_types(cls), field_docs(cls)
    return tuple(Setting(group, f.name, hints[f.name], default_text(f), docs[f.name]) for f in fields)


def default_text(f: dataclasses.Field) -> str:
    """A field's default as a config file writes it; one read from the environment names the
    variable, so that the docs say the same on every machine."""
    if isinstance(f.default_factory, EnvDefault):
        return f"${f.default_factory.name} or {env_default(f.default_factory.name)}"
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return value_text(value)


def value_text(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return str(value)
    return str(value.value if hasattr(value, "value") else value)


def is_switch(hint: object) -> bool:
    """A boolean setting: `--x` / `--no-x`."""
    return hint is bool


def arms(hint: object) -> tuple:
    """The types a declared type allows: (int, NoneType) for `int | None`."""
    return typing.get_args(hint) or (hint,)
