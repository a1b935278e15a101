"""The app's named endpoints as MCP tools (Gradio's MCP server, on with ``KV_ARENA_MCP=1``): an MCP
client lists ``chat`` and ``compare`` with every parameter described, and asks ``/chat`` a question
through the streamable HTTP transport on an offline model."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from components.history import REREAD
from components.settings import control_names
from tests.app_support import free_port

MODEL = "tiny-qwen2-vl"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mcp_url():
    from app import build_demo, launch_options

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KV_ARENA_MCP", "1")
        options = launch_options()
    demo = build_demo()
    with pytest.warns(UserWarning, match="gr.State input"):  # the tab's Session: see docs/mcp.md
        _, local_url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                                      quiet=True, **options)
    yield f"{local_url}gradio_api/mcp/"
    demo.close()


def with_session(url: str, work):
    """``work(session)`` on an initialised MCP client session to ``url``, run to its end."""
    async def run():
        async with streamable_http_client(url) as (read, write, _), ClientSession(read, write) as session:
            await session.initialize()
            return await work(session)
    return asyncio.run(run())


def test_mcp_is_off_unless_asked(monkeypatch):
    from app import launch_options

    monkeypatch.delenv("KV_ARENA_MCP", raising=False)
    assert launch_options()["mcp_server"] is False


def test_the_tools_are_the_named_endpoints_with_every_parameter_described(mcp_url):
    tools = {tool.name: tool for tool in with_session(mcp_url, lambda s: s.list_tools()).tools}
    assert set(tools) == {"chat", "compare", "blind", "vote", "leaderboard"}
    chat, compare = tools["chat"].inputSchema["properties"], tools["compare"].inputSchema["properties"]
    assert list(chat) == ["message", "history", *control_names()]
    assert list(compare) == ["message", "methods", "follow_up", *control_names()]
    for name, schema in {**chat, **compare}.items():
        assert schema.get("description"), f"{name} has no description"
    assert "KV-cache method" in tools["chat"].description and "Returns:" in tools["chat"].description
    assert "budget of every method compared" in compare["budget"]["description"]
    assert list(tools["blind"].inputSchema["properties"]) == ["message", "model", "method", "budget", "battle"]
    assert list(tools["vote"].inputSchema["properties"]) == ["battle", "choice"]
    for schema in [*tools["blind"].inputSchema["properties"].values(), *tools["vote"].inputSchema["properties"].values()]:
        assert schema.get("description")


def test_chat_through_mcp_answers(mcp_url):
    arguments = {"message": {"text": "What is in the picture?", "files": []}, "history": [], "model": MODEL,
                 "method": "snapkv", "budget": 0.5, "max_new_tokens": 5}
    result = with_session(mcp_url, lambda s: s.call_tool("chat", arguments))
    assert not result.isError, result.content
    (block,) = result.content  # every output in one text block, as Python writes a list (Gradio's bridge)
    (question, answer), _, status, *_ = ast.literal_eval(block.text)
    assert question["content"][0]["text"] == "What is in the picture?"
    assert answer["role"] == "assistant" and answer["content"][-1]["text"].strip()
    assert status.startswith("**SnapKV**") and "saved" in status


def test_each_mcp_call_has_a_session_of_its_own(mcp_url):
    """Every MCP caller reaches the app through Gradio's one bridge client: no call may see what
    another asked, or reset its conversation (security audit, item 8)."""
    def ask(arguments):
        (block,) = with_session(mcp_url, lambda s: s.call_tool("chat", arguments)).content
        return ast.literal_eval(block.text)

    asked = {"message": {"text": "What colour is the sky?", "files": []}, "history": [], "model": MODEL,
             "method": "snapkv", "budget": 0.5, "max_new_tokens": 5}
    chat_a, _, status_a, *_ = ask(asked)  # caller A
    _, _, status_b, *_ = ask(asked)  # caller B, the same question: nothing "(cached)" from A's call
    assert "cached" not in status_a and "cached" not in status_b, status_b
    # A's chat sent back as its history: a call is answered on its own session, which re-reads it, said
    chat, _, status, *_ = ask(asked | {"message": {"text": "And then?", "files": []}, "history": chat_a})
    assert chat[:2] == chat_a and chat[2]["metadata"]["title"] == REREAD, chat
    assert "cached" not in status


def test_the_client_in_docs_mcp_md_runs_as_pasted(mcp_url, capsys):
    page = (ROOT / "docs" / "mcp.md").read_text()
    snippet = page.split("```python\n", 1)[1].split("```")[0]
    exec(compile(snippet.replace("http://127.0.0.1:7860/gradio_api/mcp/", mcp_url), "docs/mcp.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "['chat', 'compare', 'leaderboard', 'blind', 'vote']" and printed[-1].startswith("**SnapKV**")


def test_an_mcp_call_is_its_callers_visitor_and_a_refused_one_reads_one_line(mcp_url, monkeypatch):
    """Issue 68: the bridge re-sends every call from 127.0.0.1, yet each call counts as its caller's
    address (0 hops: its peer, whatever ``X-Forwarded-For`` it forges). Three long calls at once from
    one address with a waiting room of one: one answered, the others refused in our one line (not
    the bridge's HTTP error naming the app's internal URL); a caller at another address is answered."""
    import httpx

    from components.queue_limit import LIMIT_ENV, ROOM_ENV

    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "0")
    monkeypatch.setenv(LIMIT_ENV, "1")
    monkeypatch.setenv(ROOM_ENV, "1")
    long = {"message": {"text": "Tell me a long story.", "files": []}, "history": [], "model": MODEL,
            "method": "snapkv", "budget": 0.5, "max_new_tokens": 200}

    async def call(local: str, forged: str):
        transport = httpx.AsyncHTTPTransport(local_address=local)
        async with httpx.AsyncClient(transport=transport, headers={"x-forwarded-for": forged}, timeout=300,
                                     follow_redirects=True) as http, \
                streamable_http_client(mcp_url, http_client=http) as (read, write, _), \
                ClientSession(read, write) as session:
            await session.initialize()
            return await session.call_tool("chat", long)

    async def run():
        return await asyncio.gather(*(call("127.0.0.1", f"198.51.100.{i}") for i in range(3)),
                                    call("127.0.0.2", "198.51.100.9"))

    *mine, other = asyncio.run(run())
    refused = [r.content[0].text for r in mine if r.isError]
    assert len(refused) == 2 and not other.isError, (refused, other.content)
    for line in refused:
        assert line.startswith("Too many events from your address") and "\n" not in line, line
        assert "127.0.0.1" not in line and "http" not in line, line
