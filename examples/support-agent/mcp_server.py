"""Pageturner's tools as a stdio MCP server, for calls no trace recorded.

    python examples/support-agent/mcp_server.py [--seed 0]

A team exposes its agent's tools as an MCP server; Ratchet's replay sandbox sends it the
calls its recorded results cannot answer (the call that a failing trace never made is the
one a better policy makes). This is the shop's server, written with the official ``mcp``
SDK (2.x names the server class ``MCPServer``; 1.x called it ``FastMCP``), over the same
shop as ``traffic.py`` with the same ``--seed``: every answer is byte for byte the result
a trace recorded for the same call.

It serves both versions of the tool API at once, so tasks from before and after the tool
change are both answered: ``track_parcel``'s ``carrier`` is optional here (API v1 had none;
v2 requires it, and the sandbox refuses a v2 call without it by the task's own schema
before any call reaches this server); a carrier that is given must be the parcel's.
``refund_order`` changes the shop, so it is not marked read-only: a deployment allow-lists
it for this staging copy of the shop (refunds are idempotent: one id per order).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bookshop import CARRIERS, TOOLS, Shop

try:  # mcp 2.x
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer  # type: ignore[no-redef]
from mcp.types import ToolAnnotations

# The server answers as API v1 does, which takes an optional carrier (see the docstring).
SERVED_API = "v1"
READ_ONLY = ToolAnnotations(readOnlyHint=True, openWorldHint=False)
CHANGES_THE_SHOP = ToolAnnotations(
    readOnlyHint=False, destructiveHint=False, idempotentHint=True, openWorldHint=False
)


def _description(name: str) -> str:
    return str(next(t for t in TOOLS["v2"] if t["name"] == name)["description"])


def build_server(shop: Shop) -> Any:
    """The MCP server of ``shop``'s four tools."""
    server = MCPServer(
        name="pageturner-books",
        instructions="Pageturner Books' support tools: orders, parcels, refunds, stock.",
    )

    def tool(name: str, annotations: ToolAnnotations) -> Any:
        return server.tool(
            name=name,
            description=_description(name),
            annotations=annotations,
            structured_output=False,
        )

    @tool("find_order", READ_ONLY)
    def find_order(order_id: Annotated[str, Field(description="e.g. PT-10482")]) -> str:
        return shop.call(SERVED_API, "find_order", {"order_id": order_id})

    @tool("track_parcel", READ_ONLY)
    def track_parcel(
        tracking_id: Annotated[str, Field(description="e.g. TR-55012")],
        carrier: Annotated[
            str | None,
            Field(description=f"the carrier find_order names ({', '.join(CARRIERS)})"),
        ] = None,
    ) -> str:
        arguments = {"tracking_id": tracking_id}
        if carrier is not None:
            arguments["carrier"] = carrier
        return shop.call(SERVED_API, "track_parcel", arguments)

    @tool("refund_order", CHANGES_THE_SHOP)
    def refund_order(
        order_id: Annotated[str, Field(description="e.g. PT-10482")],
        reason: Annotated[str, Field(description="damaged or lost")],
    ) -> str:
        return shop.call(SERVED_API, "refund_order", {"order_id": order_id, "reason": reason})

    @tool("check_stock", READ_ONLY)
    def check_stock(title: Annotated[str, Field(description="the book's title")]) -> str:
        return shop.call(SERVED_API, "check_stock", {"title": title})

    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the shop's seed (traffic.py's)")
    args = parser.parse_args(argv)
    build_server(Shop(args.seed)).run("stdio")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
