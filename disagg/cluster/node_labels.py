"""The `ray start` flags that make a machine of a `ray up` cluster a node of its pool.

Ray's cluster launcher runs one worker start command on every worker machine, so the command
cannot name the pool itself. Each machine finds its own: the cluster file lists which addresses
serve which pool, and a machine is the address the launcher reached it at over SSH (the server
side of `$SSH_CONNECTION`). It prints

    --node-ip-address=10.0.0.2 --resources={"prefill":1}

for `ray start`: the node registers under that address (the launcher's autoscaler knows its nodes
by the addresses in the cluster file), and the custom resource named after the pool is what
`disagg serve --cluster` pins the pool to (disagg.cluster.launcher). Standard library only (and
disagg.config, which is): it runs before anything else on a fresh node.

    python -m disagg.cluster.node_labels --prefill 10.0.0.2 --decode 10.0.0.3 10.0.0.4
"""

from __future__ import annotations

import argparse
import json
import sys

from disagg.config import env

POOLS = ("prefill", "decode", "colocated")
LABEL_AMOUNT = 1  # a node's units of its pool's resource; each worker takes a sliver of one


def reached_address(ssh_connection: str | None) -> str:
    """The address this machine was reached at over SSH: the third field of $SSH_CONNECTION
    ("client-ip client-port server-ip server-port")."""
    fields = (ssh_connection or "").split()
    if len(fields) != 4:
        raise ValueError("SSH_CONNECTION is not set: pass --address (this runs in a `ray up` start command)")
    return fields[2]


def pool_resources(address: str, addresses_by_pool: dict[str, list[str]]) -> dict[str, int]:
    """{pool: LABEL_AMOUNT} for the pool that lists `address` ({} for none: e.g. the head)."""
    pools = [pool for pool, addresses in addresses_by_pool.items() if address in addresses]
    if len(pools) > 1:
        raise ValueError(f"{address} is listed for several pools: {', '.join(pools)}")
    return {pools[0]: LABEL_AMOUNT} if pools else {}


def ray_start_flags(address: str, addresses_by_pool: dict[str, list[str]]) -> str:
    resources = pool_resources(address, addresses_by_pool)
    # Compact JSON: the flags reach `ray start` through an unquoted $(...), split on spaces.
    return f"--node-ip-address={address} --resources={json.dumps(resources, separators=(',', ':'))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.cluster.node_labels", description=__doc__.split("\n")[0])
    for pool in POOLS:
        parser.add_argument(f"--{pool}", nargs="*", default=[], metavar="ADDRESS", help=f"the {pool} pool's machines")
    parser.add_argument("--address", help="this machine's address (default: where SSH reached it)")
    args = parser.parse_args(argv)
    try:
        address = args.address or reached_address(env("SSH_CONNECTION"))
        print(ray_start_flags(address, {pool: getattr(args, pool) for pool in POOLS}))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
