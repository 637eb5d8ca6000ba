"""A follower rank's own thread: it takes each order rank 0 sends on the step channel, runs it
and answers, in order, instead of being called through Ray once per step.

A step that raises is answered with its error (rank 0 then takes the instance out of service:
its ranks are out of lockstep); the loop goes on waiting, though nothing more should come. When
rank 0's process is gone the loop ends: the launcher stops this rank with its instance.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from disagg.config import DEFAULT_STEP_TIMEOUT_S
from disagg.worker.peer_wait import ChannelTimeout, PeerGone
from disagg.worker.shard_service import ShardReply
from disagg.worker.step_channel import FollowerChannel
from disagg.worker.step_messages import StepAnswer, decode_order, encode_answer

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.25  # while no step comes: how often the loop checks whether it should stop

RunStep = Callable[[list | None, list, float], ShardReply]  # (chunks, this rank's commands, wait_s)


class FollowerLoop:
    def __init__(
        self,
        channel: FollowerChannel,
        index: int,
        run_step: RunStep,
        name: str,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ):
        """`index`: this rank's place among rank 0's followers (which commands are its own);
        `step_timeout_s`: how long rank 0 may take to take an answer (ServingConfig.step_timeout_s)."""
        self.channel = channel
        self.step_timeout_s = step_timeout_s
        self.index = index
        self.run_step = run_step
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # else a step still runs: the process exit unmaps the channel
            self.channel.close()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                payload = self.channel.recv(IDLE_WAIT_S)
                if payload is not None:
                    self.channel.send(self._answer(payload), self.step_timeout_s)
        except (PeerGone, ChannelTimeout) as exc:
            if not self._stopping.is_set():
                logger.warning("the step channel to rank 0 broke (%s): this rank takes no more steps", exc)
        except Exception:  # noqa: BLE001 - e.g. the channel closed under it while stopping
            if not self._stopping.is_set():
                logger.exception("the step loop failed: this rank takes no more steps")

    def _answer(self, payload: bytearray) -> bytes:
        number = -1
        try:
            order = decode_order(payload)
            number = order.number
            reply = self.run_step(order.chunks, order.commands[self.index], order.wait_s)
            return encode_answer(StepAnswer(number, reply))
        except Exception as exc:  # noqa: BLE001 - rank 0 must hear of it, not wait for a timeout
            logger.exception("step %d failed on this rank", number)
            return encode_answer(StepAnswer(number, ShardReply(), error=f"{type(exc).__name__}: {exc}"))
