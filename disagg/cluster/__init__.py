"""Launches pools of Ray actors in placement groups, and a local redis-server when none is given."""
