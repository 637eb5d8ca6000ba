"""Transport over torch.distributed: one 2-rank process group per pair of workers, built lazily.

Each worker hosts its own rendezvous store (disagg.kv_transfer.rendezvous: only a peer of the same
deployment, for a pair that includes this worker, can use it). The pair (a, b), a < b, meets on a's
store (a is rank 0), in a table of its own named by both workers and both addresses, under a
prefix that holds a generation number kept in that table. A
side that discards a broken pair bumps the generation (compare-and-set, so two sides that both saw
the failure bump it once), and closes its connection, so the other side's pair breaks at once
(torch_dist_pair); the next `connect` of either side meets under the new prefix: a rebuilt pair
never reuses the keys of a broken one. The addresses in the prefix do the same for a worker that
restarted under its old id. `connect` on a live pair returns at once, with no store round trip: it
is called before every message.

Every message is a fixed-size header (dtype and shape) and a tag, then the payload as raw bytes: in
the same gloo message when it is small, else in a second one. Between workers on different hosts
the tag is an HMAC of the header and payload, in order per direction, with keys of the pair made
from the deployment key and nonces both sides put in the authenticated store (disagg.auth): a
message changed, replayed or reordered on the wire fails the transfer and breaks the pair. On one
host (where the KV moves by reference anyway) and over NCCL (whose payload is on the GPU) the tag
is zeros: NCCL's connections carry no integrity check (docs/security.md). The receiver checks the header against
`out` before it posts a recv for a large payload: gloo aborts the whole process when a message is
larger than the buffer posted for it (so the first recv posts a buffer that fits any first message).
Headers, payloads and the two directions use different tags.

A dead peer fails an operation under way at once, not at its timeout: see torch_dist_pair.

Backend: gloo for CPU tensors, NCCL for CUDA tensors, unless one is given: "gloo" also carries CUDA
tensors, staged through host memory. The gloo group exists for every pair (rendezvous, watcher);
NCCL groups are made on first use, one per direction: NCCL runs a group's operations in one stream
order, so a send and a recv issued at once from two threads could each wait for the other.
NCCL's `wait(timeout)` blocks the caller and raises on timeout only with TORCH_NCCL_BLOCKING_WAIT=1,
so that is set (unless already set) before the first NCCL group of the process is made.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from disagg.auth import TAG_BYTES, AuthenticationError, Seals, new_nonce
from disagg.config import env, set_env_default
from disagg.errors import KVTransferError
from disagg.kv_transfer.paths import DeviceView, KVPath, choose_path, local_view
from disagg.kv_transfer.rendezvous import PairStore, Rendezvous, RendezvousClosed, connect_pair_store
from disagg.kv_transfer.torch_dist_pair import Pair, first_line, remaining
from disagg.kv_transfer.transport import Transport

logger = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl")
# gloo's (and NCCL's) own bound on any operation of a pair, the idle watcher's recv included (so an idle
# pair is never closed by it); every call waits only until its own deadline.
PAIR_OP_TIMEOUT = timedelta(days=7)

_MAGIC = 0x4B56_0001
_MAX_DIMS = 8
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_HEADER_BYTES = (3 + _MAX_DIMS) * 8
_FIRST_BYTES = _HEADER_BYTES + TAG_BYTES  # the header and its tag: the start of every first message
_NO_TAG = bytes(TAG_BYTES)
SEAL_MODES = ("cross-host", "always")
# A payload this small travels in the header's message (gloo only): one round of gloo's
# ready/ready/data messages instead of two, for the price of a copy.
_INLINE_MAX_BYTES = 64 * 1024
_INBOX_BYTES = _FIRST_BYTES + _INLINE_MAX_BYTES
_HEADER, _PAYLOAD = 0, 1  # tag = 2 * sender rank + kind
_GENERATION_KEY = "gen"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# A gloo or NCCL failure (timeout, closed connection, store error) surfaces as RuntimeError;
# reaching a peer's store that is gone, as OSError.
_TRANSPORT_ERRORS = (RuntimeError, OSError)


class TorchDistTransport(Transport):
    def __init__(
        self,
        worker_id: str,
        key: bytes,
        host: str = "127.0.0.1",
        backend: str | None = None,
        seal: str | None = None,
        device: torch.device = torch.device("cpu"),
        view: DeviceView | None = None,
    ):
        """`key`: the deployment's (disagg.auth): a peer must hold it to meet this worker.
        `seal`: which pairs tag their gloo messages: those across hosts, or always (tests, and
        measuring the cost on one host); None: $DISAGG_KV_SEAL, else cross-host.
        `device`: where this worker's KV cache is; `view`: what this process sees of the devices
        (default: read from the process), from which each pair's path is chosen (kv_transfer.paths)."""
        seal = seal or env("DISAGG_KV_SEAL")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
        if seal not in SEAL_MODES:
            raise ValueError(f"seal: expected one of {SEAL_MODES}, got {seal!r}")
        self.seal = seal
        self.worker_id = worker_id
        self.view = view if view is not None else local_view(device)
        self.backend = backend
        self._key = key
        self._rendezvous: Rendezvous | None = Rendezvous(worker_id, key, host)
        self._address = self._rendezvous.own_address = _format_address(host, self._rendezvous.port)
        self._gloo_device = _gloo_device(host)
        self._pairs: dict[str, Pair] = {}
        self._connect_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()  # guards the two dicts above
        # Close the pairs at interpreter exit too: a watcher thread still inside gloo while
        # Python tears down aborts the process ("terminate called without an active exception").
        self._close_pairs = weakref.finalize(self, _close_pairs, self._pairs, self._lock)

    # ---- Transport ------------------------------------------------------------------------------
    def address(self) -> str:
        return self._address

    def connect(self, peer_id: str, peer_address: str, timeout: float) -> None:
        if peer_id == self.worker_id:
            raise ValueError(f"peer_id: a worker cannot connect to itself ({peer_id!r})")
        _split_address(peer_address)
        self._check_open(peer_id)
        deadline = time.monotonic() + timeout
        with self._connect_lock(peer_id):
            pair = self._pairs.get(peer_id)
            if pair is not None and not pair.broken.done() and pair.peer_address == peer_address:
                return  # live: a peer that retires a pair closes its connection, which breaks ours at once
            if pair is not None:
                self._discard(pair, bump=pair.broken.done())  # a new address is a new pair name
            try:
                store = self._pair_store(peer_id, peer_address, deadline)
                generation = int(store.add(_GENERATION_KEY, 0))
            except RendezvousClosed as exc:
                raise self._error(peer_id, "the peer has closed its transport") from exc
            except AuthenticationError as exc:
                raise self._error(peer_id, "the peer's rendezvous is not of this deployment", exc) from exc
            except _TRANSPORT_ERRORS as exc:
                raise self._error(
                    peer_id, f"cannot reach the rendezvous store at {self._owner_address(peer_id, peer_address)}", exc
                ) from exc
            pair = self._build_pair(peer_id, peer_address, store, _GENERATION_KEY, generation, deadline)
            with self._lock:
                self._pairs[peer_id] = pair

    def send(self, peer_id: str, tensor: torch.Tensor, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        header = _header(tensor)
        pair = self._live_pair(peer_id)
        with pair.send_lock:
            try:
                group, device = self._group_for(pair, tensor.device, pair.rank)
                payload = _as_bytes(tensor.to(device).contiguous()) if tensor.numel() else None
                tag = _tag_of(pair, group, header, payload)
                first = torch.cat([_as_bytes(header), torch.frombuffer(bytearray(tag), dtype=torch.uint8)]).to(device)
                if payload is not None and group is pair.gloo and payload.numel() <= _INLINE_MAX_BYTES:
                    first, payload = torch.cat([first, payload]), None  # one round of messages, not two
                pair.wait(group.send([first], pair.peer_rank, _tag(pair.rank, _HEADER)), deadline)
                if payload is not None:
                    pair.wait(group.send([payload], pair.peer_rank, _tag(pair.rank, _PAYLOAD)), deadline)
            except _TRANSPORT_ERRORS as exc:
                raise self._fail(pair, f"send of {_describe(header.tolist())} failed", exc) from exc

    def recv(self, peer_id: str, out: torch.Tensor, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        expected = _header(out).tolist()
        nbytes = out.numel() * out.element_size()
        pair = self._live_pair(peer_id)
        with pair.recv_lock:
            try:
                group, device = self._group_for(pair, out.device, pair.peer_rank)
                inline = group is pair.gloo  # gloo may deliver fewer bytes than posted; NCCL may not
                first = pair.inbox if inline else torch.empty(_FIRST_BYTES, dtype=torch.uint8, device=device)
                pair.wait(group.recv([first], pair.peer_rank, _tag(pair.peer_rank, _HEADER)), deadline)
                head = first[:_FIRST_BYTES].cpu()
                got = head[:_HEADER_BYTES].view(torch.int64).tolist()
                payload = None
                if got == expected and nbytes and inline and nbytes <= _INLINE_MAX_BYTES:
                    payload = first[_FIRST_BYTES : _FIRST_BYTES + nbytes]
                    out.copy_(payload.view(out.dtype).view(out.shape))
                elif got == expected and nbytes:
                    direct = out.is_contiguous() and out.device == device
                    target = out if direct else torch.empty(out.shape, dtype=out.dtype, device=device)
                    pair.wait(group.recv([_as_bytes(target)], pair.peer_rank, _tag(pair.peer_rank, _PAYLOAD)), deadline)
                    payload = _as_bytes(target)
                    if not direct:
                        out.copy_(target)
            except _TRANSPORT_ERRORS as exc:
                raise self._fail(pair, f"recv into {_describe(expected)} failed", exc) from exc
            if got != expected:
                # The payload is not received: the pair goes, so nothing of it is left to misread.
                raise self._fail(pair, f"message mismatch: expected {_describe(expected)}, got {_describe(got)}")
            if _tag_of(pair, group, head[:_HEADER_BYTES], payload, incoming=True) != bytes(
                head[_HEADER_BYTES:].numpy()
            ):
                raise self._fail(pair, f"{_describe(got)} failed its integrity check (changed, replayed or reordered)")

    def path_to(self, peer_id: str) -> KVPath | None:
        with self._lock:
            pair = self._pairs.get(peer_id)
        return pair.path_out if pair is not None and not pair.broken.done() else None

    def paths(self) -> dict[str, str]:
        with self._lock:
            pairs = list(self._pairs.values())
        return {pair.peer_id: pair.path_out.value for pair in pairs if not pair.broken.done()}

    def disconnect(self, peer_id: str) -> None:
        with self._lock:
            pair = self._pairs.get(peer_id)
        if pair is not None:
            self._discard(pair, bump=True)

    def close(self) -> None:
        with self._lock:
            rendezvous, self._rendezvous = self._rendezvous, None
        if rendezvous is None:
            return
        rendezvous.close()  # peers that connect meanwhile learn that nobody is coming
        self._close_pairs()

    # ---- pairs ----------------------------------------------------------------------------------
    def _connect_lock(self, peer_id: str) -> threading.Lock:
        with self._lock:
            return self._connect_locks.setdefault(peer_id, threading.Lock())

    def _check_open(self, peer_id: str) -> None:
        if self._rendezvous is None:
            raise KVTransferError(f"kv transfer {self.worker_id} <-> {peer_id}: this transport is closed")

    def _live_pair(self, peer_id: str) -> Pair:
        self._check_open(peer_id)
        with self._lock:
            pair = self._pairs.get(peer_id)
        if pair is None:
            raise KVTransferError(
                f"kv transfer {self.worker_id} <-> {peer_id}: not connected (connect first, and again after a failure)"
            )
        if pair.broken.done():
            raise self._fail(pair, f"connection lost: {pair.broken.result()}")
        return pair

    def _pair_name(self, peer_id: str, peer_address: str) -> str:
        (a, a_addr), (b, b_addr) = sorted([(self.worker_id, self.address()), (peer_id, peer_address)])
        return f"{a}@{a_addr}/{b}@{b_addr}"

    def _owner_address(self, peer_id: str, peer_address: str) -> str:
        return self.address() if self.worker_id < peer_id else peer_address

    def _pair_store(self, peer_id: str, peer_address: str, deadline: float) -> PairStore:
        """The pair's table: in our own rendezvous when we are rank 0, else over a connection to the peer's."""
        pair_name = self._pair_name(peer_id, peer_address)
        rendezvous = self._rendezvous
        if rendezvous is None:
            raise RendezvousClosed("this transport is closed")
        if self.worker_id < peer_id:
            return rendezvous.pair_store(pair_name, remaining(deadline))
        host, port = _split_address(peer_address)
        return connect_pair_store(host, port, pair_name, self._key, remaining(deadline))

    def _build_pair(self, peer_id, peer_address, store, generation_key, generation, deadline) -> Pair:
        rank = 0 if self.worker_id < peer_id else 1
        prefix = f"pair/{generation}"
        # The group's timeout is also gloo's timeout for every later operation, so it must not be
        # what is left of this connect call: meet through the store first, bounded by the connect
        # deadline, then build the group with the fixed operation timeout (each call still waits
        # only until its own deadline).
        pair_store = dist.PrefixStore(prefix, store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = PAIR_OP_TIMEOUT
        options._devices = [self._gloo_device]
        options._threads = 1  # only point-to-point ops, which do not use the worker threads
        try:
            pair_store.set(f"nonce/{rank}", new_nonce())  # the pair's seal keys are fresh for each generation
            # Each side learns whether the other is on its host, and what of its devices it can reach.
            pair_store.set(f"joined/{rank}", self.view.to_json())
            pair_store.wait([f"joined/{1 - rank}"], timedelta(seconds=remaining(deadline)))
            peer_view = DeviceView.from_json(pair_store.get(f"joined/{1 - rank}").decode())
            same_host = bool(self.view.host) and peer_view.host == self.view.host
            nonces = (pair_store.get("nonce/0"), pair_store.get("nonce/1"))
            gloo = dist.ProcessGroupGloo(pair_store, rank, 2, options)
        except _TRANSPORT_ERRORS as exc:
            _bump(store, generation_key, generation)  # never meet under a half-used prefix again
            raise self._error(peer_id, "peer did not join in time", exc) from exc
        inbox = torch.empty(_INBOX_BYTES, dtype=torch.uint8)
        pair = Pair(
            peer_id,
            peer_address,
            rank,
            generation,
            generation_key,
            prefix,
            store,
            PAIR_OP_TIMEOUT,
            gloo,
            inbox,
            same_host,
            path_out=choose_path(self.view, peer_view),
            path_in=choose_path(peer_view, self.view),
        )
        logger.info(
            "kv pair %s <-> %s: KV goes by %s, comes by %s",
            self.worker_id,
            peer_id,
            pair.path_out.value,
            pair.path_in.value,
        )
        if self.seal == "always" or not same_host:
            purpose = f"kv {self._pair_name(peer_id, peer_address)} {prefix}"
            pair.seals = Seals.of(self._key, *nonces, purpose, "caller" if rank == 0 else "listener")
        pair.watch()
        return pair

    def _group_for(self, pair: Pair, device: torch.device, sender_rank: int):
        """The group that carries tensors on `device` from `sender_rank`, and the device the wire
        tensors live on: NCCL for CUDA tensors where the pair's path is NCCL (not on one GPU, which
        NCCL refuses, nor beside a CPU cache), gloo otherwise."""
        path = pair.path_out if sender_rank == pair.rank else pair.path_in
        backend = self.backend or ("nccl" if device.type == "cuda" and path is KVPath.NCCL else "gloo")
        if backend == "gloo":
            return pair.gloo, torch.device("cpu")
        if device.type != "cuda":
            raise ValueError(f"tensor: the nccl backend carries CUDA tensors only, got {device}")
        with pair.nccl_lock:
            if sender_rank not in pair.nccl:
                pair.nccl[sender_rank] = _nccl_group(pair, sender_rank)
        return pair.nccl[sender_rank], device

    def _discard(self, pair: Pair, bump: bool) -> None:
        with self._lock:
            if self._pairs.get(pair.peer_id) is pair:
                del self._pairs[pair.peer_id]
        # Bump before closing: a peer that sees the connection drop and reconnects must read the new generation.
        if bump:
            _bump(pair.store, pair.generation_key, pair.generation)
        pair.close()

    def _fail(self, pair: Pair, what: str, exc: BaseException | None = None) -> KVTransferError:
        self._discard(pair, bump=True)
        return self._error(pair.peer_id, what, exc)

    def _error(self, peer_id: str, what: str, exc: BaseException | None = None) -> KVTransferError:
        cause = f": {first_line(exc)}" if exc is not None else ""
        return KVTransferError(f"kv transfer {self.worker_id} <-> {peer_id}: {what}{cause}")


# ---- helpers ------------------------------------------------------------------------------------
def _format_address(host: str, port: int) -> str:
    if host in _WILDCARD_HOSTS:
        host = socket.gethostbyname(socket.gethostname())
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _gloo_device(host: str):
    if host in _WILDCARD_HOSTS:
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=host)


def _nccl_group(pair: Pair, sender_rank: int) -> dist.ProcessGroupNCCL:
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("tensor: CUDA tensors need CUDA and a torch built with NCCL (or backend='gloo')")
    set_env_default("TORCH_NCCL_BLOCKING_WAIT")  # read when the group is made (module docstring)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = pair.timeout
    store = dist.PrefixStore(f"{pair.prefix}/nccl/{sender_rank}", pair.store)
    return dist.ProcessGroupNCCL(store, pair.rank, 2, options)


def _close_pairs(pairs: dict[str, Pair], lock: threading.Lock) -> None:
    with lock:
        closing = list(pairs.values())
        pairs.clear()
    for pair in closing:
        pair.close()
    for pair in closing:
        pair.watcher.join(timeout=1.0)  # it holds the group, which holds the owner's store


def _bump(store: dist.Store, key: str, generation: int) -> None:
    try:
        store.compare_set(key, str(generation), str(generation + 1))
    except _TRANSPORT_ERRORS:
        pass  # the owner's store is gone with the owner: nobody will meet under that name again


def _tag_of(pair: Pair, group, header: torch.Tensor, payload: torch.Tensor | None, incoming: bool = False) -> bytes:
    """The next message's integrity tag in its direction: an HMAC of its header and payload on a
    sealed pair's gloo group, zeros otherwise (one host, or NCCL: module docstring)."""
    if pair.seals is None or group is not pair.gloo:
        return _NO_TAG
    seal = pair.seals.incoming if incoming else pair.seals.outgoing
    parts = [_as_bytes(header).numpy()] + ([payload.numpy()] if payload is not None else [])
    return seal.tag(*parts)


def _tag(sender_rank: int, kind: int) -> int:
    return 2 * sender_rank + kind


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"tensor: dtype {tensor.dtype} is not supported by the transport")
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"tensor: at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    return torch.tensor([_MAGIC, _DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64)


def _describe(header: list[int]) -> str:
    magic, code, ndim, *shape = header
    if magic != _MAGIC or not 0 <= code < len(_DTYPES) or not 0 <= ndim <= _MAX_DIMS:
        return "an unknown message"
    return f"{str(_DTYPES[code]).removeprefix('torch.')}{list(shape[:ndim])}"


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (what goes on the wire, whatever the dtype)."""
    return tensor.reshape(-1).view(torch.uint8)


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"peer_address: expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)
