"""What the manager says when an instance's stream breaks: the instance failed, not the caller (issue 16)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rollout_manager.sglang.client import CallBounds, EngineFailed, stream_generate
from rollout_manager.sglang.generate_request import SequenceBody


async def test_a_stream_cut_mid_answer_says_the_instance_broke_off():
    """An engine that dies mid-stream leaves a truncated chunked body: the message says the instance
    broke off, with what came before (aiohttp called this ``TransferEncodingError: 400``)."""
    async def dying_engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        event = b'data: {"text": "a", "output_ids": [1], "meta_info": {}}\n\n'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + f"{len(event) + 100:x}\r\n".encode() + event)  # promises more than it sends
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(dying_engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(EngineFailed) as failed:
                async for _ in stream_generate(session, f"http://127.0.0.1:{port}", SequenceBody.of({"input_ids": [1]}),
                                               CallBounds(connect_timeout_s=5, stall_timeout_s=5)):
                    pass
    finally:
        server.close()
        await server.wait_closed()
    message = str(failed.value)
    assert message.startswith("the instance's stream broke off mid-answer (the engine died"), message
    assert "closed after " in message and "byte(s) of its answer" in message  # the detail, for whoever digs further
