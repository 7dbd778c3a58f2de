"""A stage replica's two neighbours: how activations go down and gradients come back up.

A neighbour in the same site is reached over the site's ``torch.distributed`` world (the
RDMA-class path: gloo on CPU, NCCL on GPU); a neighbour in another site over a direct,
coded TCP connection (:mod:`geopipe.transport.direct`) — Ray only carries the receiver's
address, never the data: an actor-call argument above 100 KiB goes through Ray's object
store, which over a real 40 ms link cost about seven one-way latencies per transfer.
:class:`StageLinks` hides which path a neighbour takes, so the executor only says "send
forward", "send backward" and "wait for this key". The WAN receiver takes only the frames
this stage's plan expects (`planned_frames`), checked before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from geopipe.runtime.actor.probe import BURST_MAX_BYTES
from geopipe.transport.channel import Inbox, P2PReceiver, P2PSender
from geopipe.transport.direct import DirectReceiver, DirectSender
from geopipe.transport.expect import ExpectedFrames, FrameSpec
from geopipe.transport.frames import Admit
from geopipe.transport.link import LinkParams
from geopipe.transport.security import RunCredentials

__all__ = ["PROBE_KINDS", "StageLinks", "WanPeer", "planned_frames"]

# The launch-time link probe's messages (geopipe.runtime.actor.probe): expected until the
# first training step.
PROBE_KINDS = ("probe-ping", "probe-pong", "probe-bulk")


def planned_frames(
    shape: tuple[int, ...], dtype: torch.dtype, tied: torch.Tensor | None = None
) -> ExpectedFrames:
    """The frames a stage replica's WAN receiver takes, refusing the rest before allocation
    (`geopipe.transport.expect`): activations ``("F", step, mb)``, their gradients
    ``("B", step, mb)`` and held-out evaluation's activations ``("E", step, j)``
    (:mod:`.evaluate`) of ``shape`` in the training ``dtype``; the other copy's gradient
    ``("T", step, 0)`` of a tied embedding shaped and typed as this copy ``tied``; another
    stage's gradient norm ``("N", step, stage)``, 3 float32 (:mod:`.gradnorm`); and the link
    probe's float32 vectors (at most its burst). Steps from the consumer's to one ahead (a
    neighbour may start the next step's sends first; a norm's step is not checked). A norm
    or a probe vector holding NaN or inf is refused (a norm travels finite, -1 standing for
    "not finite"); activations and gradients are not checked for it: a non-finite value
    there is the model's (fp16's loss scaling overflows by design), and the NaN guard
    (``training.nan_policy``, `geopipe.runtime.control.guards`) skips that step or stops
    the run naming step, stage and tensor — refusing it here would fail a step the policy
    may skip.
    A new kind of message to this receiver must be added here, or it is refused."""
    name = _dtype_name(dtype)
    act = FrameSpec(
        shapes=frozenset({tuple(shape)}), dtypes=frozenset({name}), key_len=3, step_at=1
    )
    norm = FrameSpec(
        shapes=frozenset({(3,)}),
        dtypes=frozenset({"float32"}),
        codecs=frozenset({"none"}),
        key_len=3,  # its step is the engine's optimizer count: no window on it
        finite=True,  # a stage's non-finite norm travels as the -1 sentinel
    )
    kinds = {"F": act, "B": act, "E": act, "N": norm}
    if tied is not None:
        kinds["T"] = FrameSpec(
            shapes=frozenset({tuple(tied.shape)}),
            dtypes=frozenset({_dtype_name(tied.dtype)}),
            key_len=3,
            step_at=1,
        )
    probe = FrameSpec(
        dtypes=frozenset({"float32"}),
        codecs=frozenset({"none"}),
        key_len=2,
        max_numel=BURST_MAX_BYTES // 4,
        finite=True,
    )
    kinds.update(dict.fromkeys(PROBE_KINDS, probe))
    return ExpectedFrames(kinds, ahead=1, behind=0, finite=False)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class WanPeer:
    """How this replica reaches its neighbour in another site."""

    codec: str
    link: LinkParams | None  # None: no emulation (the WAN is real)


# Tags of the intra-site messages of one iteration: forward of micro-batch mb on 2·mb,
# its gradient on 2·mb + 1 (the state hand-off uses tags far above these).
def forward_tag(mb: int) -> int:
    return 2 * mb


def backward_tag(mb: int) -> int:
    return 2 * mb + 1


class StageLinks:
    """Senders and receivers towards the upstream and downstream neighbour.

    ``up``/``down`` are either intra-site (a p2p sender plus a receiver thread on the
    site's process group) or inter-site (a :class:`DirectSender` to the neighbour's
    :class:`DirectReceiver`; arrivals from either WAN neighbour are filed in :attr:`inbox`
    by this replica's one receiver). Stages at the ends of the pipeline have neither.
    """

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.up_send: P2PSender | DirectSender | None = None
        self.down_send: P2PSender | DirectSender | None = None
        self.up_recv: P2PReceiver | None = None
        self.down_recv: P2PReceiver | None = None
        self.wan_recv: DirectReceiver | None = None
        self.tie_send: DirectSender | None = None  # to the other copy of a tied embedding
        # The data plane's protection (set by the stage from its spec): the run's
        # credentials, listening on every interface or only the node's address, and the
        # largest payload a frame may announce.
        self.creds: RunCredentials | None = None
        self.listen_all = False
        self.max_payload: int | None = None
        # How long a WAN stream may go without the peer acknowledging anything before it
        # fails: longer than the outage the run waits out (health.wan_outage_s).
        self.user_timeout_s = 30.0
        # The rotation seed of this replica's WAN codecs (int4h, int2h): a function of the
        # run's seed and the stage, so a resumed run rotates as the first one did.
        self.codec_seed = 0
        # What the WAN receiver takes (`plan_frames`); None: any well-formed frame.
        self.frames: ExpectedFrames | None = None

    def plan_frames(
        self, shape: tuple[int, ...], dtype: torch.dtype, tied: torch.Tensor | None = None
    ) -> None:
        """Take only the frames of this plan from now on (`planned_frames`), the WAN
        receiver too if it is open."""
        self.frames = planned_frames(shape, dtype, tied)
        if self.wan_recv is not None:
            self.wan_recv.expect = self.frames

    def listen(self, host: str, expect: Admit | None = None) -> tuple[str, int]:
        """Open this replica's WAN receiver; its address goes to the WAN neighbours.
        ``expect`` (default: what `plan_frames` set): the frames the receiver accepts,
        anything else refused before allocation; None with no plan keeps every
        well-formed frame within the payload bound."""
        expect = expect if expect is not None else self.frames
        if self.wan_recv is None:
            self.wan_recv = DirectReceiver(
                self.inbox,
                host="0.0.0.0" if self.listen_all else host,
                advertise_host=host,
                creds=self.creds,
                max_payload=self.max_payload,
                user_timeout_s=self.user_timeout_s,
                expect=expect,
            )
        elif expect is not None:
            self.wan_recv.expect = expect
        return self.wan_recv.address

    def connect_up_p2p(self, rank: int) -> None:
        self.up_send = P2PSender(rank)
        self.up_recv = P2PReceiver(rank, self.inbox)

    def connect_down_p2p(self, rank: int) -> None:
        self.down_send = P2PSender(rank)
        self.down_recv = P2PReceiver(rank, self.inbox)

    def connect_up_wan(self, address: tuple[str, int], peer: WanPeer, topk_ratio: float) -> None:
        self.up_send = DirectSender(
            address,
            peer.codec,
            "backward",
            peer.link,
            topk_ratio,
            user_timeout_s=self.user_timeout_s,
            creds=self.creds,
            seed=2 * self.codec_seed + 1,
        )

    def connect_down_wan(self, address: tuple[str, int], peer: WanPeer, topk_ratio: float) -> None:
        self.down_send = DirectSender(
            address,
            peer.codec,
            "forward",
            peer.link,
            topk_ratio,
            user_timeout_s=self.user_timeout_s,
            creds=self.creds,
            seed=2 * self.codec_seed,
        )

    def connect_tie(self, address: tuple[str, int], peer: WanPeer | None) -> None:
        """The stage holding the other copy of a tied embedding (the first or last stage of
        this pipeline), reached over the direct channel wherever it is: the exchange is one
        exact (codec ``none``) message each way per step."""
        link = peer.link if peer is not None else None
        self.tie_send = DirectSender(
            address,
            "none",
            "backward",
            link,
            0.0,
            user_timeout_s=self.user_timeout_s,
            creds=self.creds,
        )

    def exchange_tied(self, step: int, grad: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Send this copy's gradient of step ``step``; wait for the other copy's."""
        if self.tie_send is None:
            raise RuntimeError("no tied-embedding peer to exchange gradients with")
        key = ("T", step, 0)
        self.tie_send.send(key, grad, stream="tied")
        return self.inbox.get(key, timeout=timeout_s)

    # -- one iteration -------------------------------------------------------------------------
    def expect(
        self,
        recv_forward: list[Hashable],
        recv_backward: list[Hashable],
        shape: tuple,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Start the intra-site receiver threads on this iteration's keys, in program order.

        Keys are ``(direction, step, mb)``; messages are ``shape`` tensors of the training
        ``dtype``. WAN arrivals need no such call (the transport files them in the inbox as
        they come), but the WAN receiver's window moves to this step here, and the link
        probe, over once training runs, is expected no more."""
        keys = [*recv_forward, *recv_backward]
        if self.frames is not None and keys:
            self.frames.drop(*PROBE_KINDS)
            self.frames.at_step(keys[0][1])
        if self.up_recv is not None:
            fwd = [(key, forward_tag(key[2]), shape) for key in recv_forward]
            self.up_recv.start(fwd, dtype)
        if self.down_recv is not None:
            bwd = [(key, backward_tag(key[2]), shape) for key in recv_backward]
            self.down_recv.start(bwd, dtype)

    def send_forward(self, key: tuple, tensor: torch.Tensor) -> int:
        """Queue the activation of ``key``; returns its bytes on the WAN (0 inside a site)."""
        return _send(self.down_send, key, tensor, forward_tag(key[2]))

    def send_backward(self, key: tuple, tensor: torch.Tensor) -> int:
        return _send(self.up_send, key, tensor, backward_tag(key[2]))

    def finish(self) -> None:
        """Wait until this iteration's sends are out and the receiver threads are done."""
        for ch in (self.up_send, self.down_send, self.tie_send):
            if isinstance(ch, P2PSender):
                ch.wait_all()
            elif isinstance(ch, DirectSender):
                ch.flush()
        for r in (self.up_recv, self.down_recv):
            if r is not None:
                r.join()

    def codec_errors(self) -> dict[str, float]:
        """The latest sampled relative error of each lossy WAN codec this replica sends
        with ("forward": activations downstream, "backward": gradients upstream)."""
        out = {}
        for direction, ch in (("forward", self.down_send), ("backward", self.up_send)):
            err = getattr(ch, "codec_error", None)
            if err is not None:
                out[direction] = err
        return out

    def set_codecs(self, up: str | None, down: str | None) -> None:
        """Send with other codecs from the next iteration: ``up`` is the setting of the
        boundary above this stage (its backward codec carries the gradients sent up),
        ``down`` the one below (its forward codec, the activations sent down)."""
        for setting, ch in ((up, self.up_send), (down, self.down_send)):
            if setting is not None and isinstance(ch, DirectSender):
                ch.flush()
                ch.set_codec(setting)

    def encode_s(self) -> float:
        """Seconds the WAN senders have spent encoding, cumulative."""
        return sum(
            ch.encode_s for ch in (self.up_send, self.down_send) if isinstance(ch, DirectSender)
        )

    # -- codec state (top-k error feedback), checkpointed with the stage -----------------------
    def codec_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, ch in (("up", self.up_send), ("down", self.down_send)):
            if isinstance(ch, DirectSender):
                for stream, t in ch.codec_state().items():
                    out[f"codec/{name}/{stream}"] = t.detach().clone()
        return out

    def load_codec_state(self, tensors_of: Callable[[str], dict]) -> None:
        """``tensors_of(prefix)`` returns the checkpoint's tensors under ``prefix``."""
        for name, ch in (("up", self.up_send), ("down", self.down_send)):
            if isinstance(ch, DirectSender):
                ch.load_codec_state(tensors_of(f"codec/{name}/"))

    def clock_skews(self) -> dict[str, tuple[float, float]]:
        """The peer's wall clock minus this one's, ± half the round trip, as each outgoing WAN
        connection's handshake measured it (``up``, ``down``, ``tie``): the launch reports the
        worst, since certificates are checked against the peers' clocks."""
        out = {}
        for name, ch in (("up", self.up_send), ("down", self.down_send), ("tie", self.tie_send)):
            skew = ch.clock_skew if isinstance(ch, DirectSender) else None
            if skew is not None:
                out[name] = (skew.offset_s, skew.error_s)
        return out

    def close(self) -> None:
        """Fail waiting receives fast; drop the WAN connections (a new layout makes new)."""
        self.inbox.close()
        for ch in (self.up_send, self.down_send, self.tie_send):
            if isinstance(ch, DirectSender):
                ch.close()
        self.tie_send = None
        if self.wan_recv is not None:
            self.wan_recv.close()
            self.wan_recv = None


def _send(ch: P2PSender | DirectSender | None, key: tuple, tensor: torch.Tensor, tag: int) -> int:
    if isinstance(ch, P2PSender):
        ch.send(tag, tensor)
        return 0
    if ch is None:
        raise RuntimeError(f"no neighbour to send {key} to")
    return ch.send(key, tensor, stream=f"{key[0]}/mb{key[2]}")
