"""An instance of one worker that serves as prefill or as decode, and switches between them
without reloading its weights (issue 36, item 2).

It is both actors in one: in the prefill role it serves PrefillService exactly as a
PrefillActor does, in the decode role DecodeService as a DecodeActor does; each method of either
role goes to the role it holds now (a router calls an instance only in the role the registry
shows). `switch_role` runs on the engine thread between steps, once the instance holds nothing
(the router drained it first: out of placement, decodes moved away with their KV, prefills
done): disagg.instance.role_switch builds the new worker around the same engine, on new KV
endpoints, and only then lets the old one go. The next heartbeat registers the instance in its
new pool (its role and KV address in the registry), and `resume_service` puts it back in
placement. A switch that fails leaves the old worker as it was, still draining: the caller
resumes it in its old role, or leaves it out of service.

Ray relaunches a dead instance with the arguments it was created with, so one that dies after
a switch comes back in its first role, whole; the re-planner sees the split it is then.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass

from disagg.config import Role, WorkerConfig
from disagg.decode_worker.actor import DecodeActor
from disagg.decode_worker.worker import DecodeWorker
from disagg.errors import UnavailableError
from disagg.instance.role_switch import switch_worker
from disagg.kv_transfer.factory import make_transport
from disagg.prefill_worker.actor import AbortPrefill, PrefillActor
from disagg.prefill_worker.worker import PrefillWorker
from disagg.registry import LoadReport
from disagg.rpc.services import DecodeService, PrefillService
from disagg.worker.actor_base import WorkerActorBase

logger = logging.getLogger(__name__)
SWITCHABLE_ROLES = (Role.PREFILL, Role.DECODE)


class InstanceService(DecodeService, PrefillService):
    """Both roles' methods (`abort` is in both: it goes to the role held)."""


@dataclass(frozen=True)
class SwitchRole:
    role: Role


class InstanceActor(DecodeActor, PrefillActor):
    service = InstanceService

    def __init__(self, config: WorkerConfig):
        if config.role not in SWITCHABLE_ROLES:
            raise ValueError(f"role: a switchable instance starts as prefill or decode, not {config.role}")
        WorkerActorBase.__init__(self, config)
        self._generation = itertools.count(1)  # each role's KV endpoints get ids of their own
        self.worker = self._new_worker(config.role, self.instance_id)
        self._attach(config.role)
        self._draining = threading.Event()
        self._catch_sigterm()
        self._start()

    @property
    def held_role(self) -> Role:
        return Role(self.role)

    # ---- switching ---------------------------------------------------------------------------
    async def switch_role(self, role: str) -> bool:
        """Once the engine thread switched (True; or it holds that role already) or refused:
        ValueError while the instance holds requests, the old role unchanged."""
        return await asyncio.wrap_future(self.loop.submit(SwitchRole(Role(role))))

    def _switch(self, command: SwitchRole) -> bool:
        if command.role is self.held_role:
            return True
        if command.role not in SWITCHABLE_ROLES:
            raise ValueError(f"switch: to {command.role}? only prefill and decode")
        if not self.worker.is_idle():  # before any endpoint is built: nothing to undo
            raise ValueError("switch: the instance still holds requests; drain it first")
        suffix = f"{self.instance_id}~{next(self._generation)}"
        transport = make_transport(
            self.config.kv_transport, suffix, self.config.link_key, self.host, self.config.engine.device
        )
        moves = (
            make_transport(
                self.config.kv_transport, f"{suffix}-move", self.config.link_key, self.host, self.config.engine.device
            )
            if command.role is Role.DECODE
            else None
        )
        try:
            new = switch_worker(
                self.worker, command.role, transport, kv_timeout=self.config.kv_timeout_s, migration_transport=moves
            )
        except BaseException:
            for t in (transport, moves):
                if t is not None:
                    t.close()
            raise
        old_role, self.worker, self.role = self.role, new, str(command.role)
        self._attach(command.role)
        logger.info("instance %s switched from %s to %s", self.instance_id, old_role, self.role)
        return True

    def _new_worker(self, role: Role, transport_id: str) -> PrefillWorker | DecodeWorker:
        config = self.config
        transport = make_transport(config.kv_transport, transport_id, config.link_key, self.host, config.engine.device)
        if role is Role.PREFILL:
            return PrefillWorker(config.engine, transport, kv_timeout=config.kv_timeout_s)
        moves = make_transport(
            config.kv_transport, f"{transport_id}-move", config.link_key, self.host, config.engine.device
        )
        return DecodeWorker(config.engine, transport, kv_timeout=config.kv_timeout_s, migration_transport=moves)

    def _attach(self, role: Role) -> None:
        (self._attach_prefill_worker if role is Role.PREFILL else self._attach_decode_worker)()

    def _as_held(self):
        """The actor class whose behaviour the held role has."""
        return PrefillActor if self.held_role is Role.PREFILL else DecodeActor

    # ---- the request path: each role's calls only while it holds that role ----------------------
    def prefill(self, request_id, prompt_token_ids, params, priority=0):
        return PrefillActor.prefill(self._holding(Role.PREFILL), request_id, prompt_token_ids, params, priority)

    def set_kv_targets(self, request_id, reservation):
        return PrefillActor.set_kv_targets(self._holding(Role.PREFILL), request_id, reservation)

    def reserve(self, request_id, prompt_token_ids, params, prefill, kv_wait_s, priority=0):
        held = self._holding(Role.DECODE)
        return DecodeActor.reserve(held, request_id, prompt_token_ids, params, prefill, kv_wait_s, priority)

    def submit(self, request_id, prompt_token_ids, params, priority=0):
        return DecodeActor.submit(self._holding(Role.DECODE), request_id, prompt_token_ids, params, priority)

    def reserve_migration(self, *args):
        return DecodeActor.reserve_migration(self._holding(Role.DECODE), *args)

    def migrate_out(self, request_id, reservation):
        return DecodeActor.migrate_out(self._holding(Role.DECODE), request_id, reservation)

    def _holding(self, role: Role) -> "InstanceActor":
        """Self, if it holds `role` now: a call of the other role's (a router that placed on the
        registry's view of a moment ago) is refused, not run in the wrong role."""
        if self.held_role is not role:
            raise UnavailableError(f"instance {self.instance_id} serves {self.role} now, not {role}")
        return self

    # ---- each of these is the held role's ------------------------------------------------------
    def load(self) -> LoadReport:
        load = self._as_held().load(self)
        load.draining = self._draining.is_set()
        return load

    async def status(self) -> dict:
        return {**(await self._as_held().status(self)), "role": self.role}

    def abort(self, request_id: str):
        return self._as_held().abort(self, request_id)

    def _kv_endpoint(self):
        return self._as_held()._kv_endpoint(self)

    def _handle_outputs(self, outputs) -> None:
        self._as_held()._handle_outputs(self, outputs)

    def _fail_all(self, exc: Exception) -> None:
        self._as_held()._fail_all(self, exc)

    def _link_closed(self, link) -> None:
        self._as_held()._link_closed(self, link)

    def _engine_commands(self) -> dict:
        # Built once, before any role is held: every command of both, each for its own role
        # (both actors name their abort handler `_abort`; the prefill one is named here).
        return {
            **PrefillActor._engine_commands(self),
            **DecodeActor._engine_commands(self),
            AbortPrefill: lambda command: PrefillActor._abort(self, command),
            SwitchRole: self._switch,
        }
