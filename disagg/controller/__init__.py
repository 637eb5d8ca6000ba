"""One per deployment, detached and restarted by Ray: the pools' placement groups and actors,
relaunch supervision, the controller's heartbeat (disagg.controller.controller)."""
