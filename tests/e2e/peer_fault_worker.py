"""A real ``tandem colocated --kv-peer-pull`` worker whose KV data sends are tampered with (the
peer-pull fault tests' only double: everything else is the shipped code path).

``TANDEM_TEST_PEER_FAULT=corrupt``: every block sent to a peer has one byte flipped on the way
(the worker's own cache is untouched). ``TANDEM_TEST_PEER_FAULT=stall:<path>``: a send writes
``<path>`` and then never completes, so the test can kill the worker mid-pull.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import torch

from tandem.cli import main
from tandem.kvtransfer.tcp_transport import TcpSendTransport


def plant() -> None:
    mode, _, arg = os.environ["TANDEM_TEST_PEER_FAULT"].partition(":")
    real = TcpSendTransport.send

    async def send(self, peer, xfer_id, views, timeout, mac):  # noqa: ANN001, ANN202
        if mode == "stall":
            Path(arg).write_text("sending")
            await asyncio.sleep(3600)
        tampered = [v.clone() for v in views]
        flat = tampered[0].reshape(-1).view(torch.uint8)
        flat[len(flat) // 2] ^= 0x10
        return await real(self, peer, xfer_id, tampered, timeout, mac)

    TcpSendTransport.send = send


if __name__ == "__main__":
    plant()
    raise SystemExit(main(sys.argv[1:]))
