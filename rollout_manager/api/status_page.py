"""The live status page served at ``GET /``: one self-contained HTML document (inline CSS and JS).

The page polls ``get_instances_status`` every second (and ``metrics`` every few seconds for the
measured per-instance token rates) and renders instances, counts by state (the same states as the
badges), the weight version, tokens/s from the tokens streamed so far (so it moves while sequences
run, not only when they finish), the requests waiting for an instance, the local window and budget,
generation counters, each instance's trust figure (the trainer's log-prob mismatch on its tokens, and
its multiple of the fleet's median: ``instances.mismatch``), recent weight pushes and recent lifecycle events. It
loads nothing from anywhere else. With ``auth_token`` set on the manager, open ``/#token=<token>``:
the page keeps the token in the tab's session storage and sends it as a bearer token.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

# Inline script and style only; nothing may be fetched from another origin.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")

# The page itself is package data (status_page.html), read once at import.
STATUS_PAGE_HTML = resources.files("rollout_manager.api").joinpath("status_page.html").read_text(encoding="utf-8")


def response() -> web.Response:
    """The page, with a policy that forbids loading anything from elsewhere."""
    return web.Response(text=STATUS_PAGE_HTML, content_type="text/html", charset="utf-8",
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store"})
