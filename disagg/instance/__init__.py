"""An instance that can serve either pool: switching roles with the same weights (role_switch.py)."""
