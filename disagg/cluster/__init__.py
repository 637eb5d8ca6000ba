"""Launches pools of Ray actors in placement groups, and a local redis-server when none is given;
node_labels.py labels the machines of a `ray up` cluster for their pools."""
