"""The serving config's settings as a user reaches them: `disagg serve` flags generated from the
config dataclasses (flags.py) and docs/settings.md (markdown.py), both from one catalog
(catalog.py) whose docs are the comments beside each field in disagg/config.py and disagg/slo.py (field_docs.py)."""
