"""On a multi-homed node a chunk server listening on every interface advertises the address
it is given, the node's (as the data plane's receiver does), not the default route's
(issue 33, item 7): here the "node's address" is loopback, which the default route never
picks, and a client reaches the server through what it advertises."""

from __future__ import annotations

import pytest

from geopipe.transport.bulk import ChunkClient, ChunkServer
from geopipe.transport.channel import Inbox
from geopipe.transport.direct import DirectReceiver
from geopipe.transport.security import make_credentials
from geopipe.transport.sockets import advertised_host

pytestmark = pytest.mark.timeout(60)


def test_a_wildcard_chunk_server_advertises_the_nodes_address() -> None:
    creds = make_credentials("run-a", encrypt=False)
    node = "127.0.0.1"
    server = ChunkServer(lambda step, f, off, n: b"x" * n, "0.0.0.0", creds, node)
    inbox = Inbox()
    receiver = DirectReceiver(inbox, host="0.0.0.0", advertise_host=node, creds=creds)
    try:
        assert server.address[0] == receiver.address[0] == node
        if advertised_host("0.0.0.0") != node:  # the old fallback: another address
            fallback = ChunkServer(lambda *a: b"", "0.0.0.0", creds)
            assert fallback.address[0] != node
            fallback.close()
        client = ChunkClient(server.address, 10, creds)
        assert list(client.read_all(1, "f", [(0, 5)])) == [b"xxxxx"]
        client.close()
    finally:
        server.close()
        receiver.close()
        inbox.close()
