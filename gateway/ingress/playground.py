"""``GET /playground``: one static page that streams a chat from a browser, over
SSE (fetch + ReadableStream) and over the WebSocket bridge.

The page embeds no credential: the user types the key, or passes it in the URL
fragment (``#key=...``), which browsers never send to the server. It is served
under a strict Content-Security-Policy: its one inline script and one inline
style are allowed by their SHA-256 hashes, computed here from the shipped file,
so nothing else (no injected script, no inline handler) can run.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response

PAGE = files("gateway.ingress").joinpath("static", "playground.html").read_bytes()
_HOST = re.compile(r"[A-Za-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


def _hashes(tag: bytes) -> str:
    blocks = re.findall(rb"<" + tag + rb">(.*?)</" + tag + rb">", PAGE, re.S)
    if not blocks:
        raise RuntimeError(f"playground.html has no <{tag.decode()}> block")
    return " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in blocks
    )


_SCRIPT_SRC = _hashes(b"script")
_STYLE_SRC = _hashes(b"style")


def content_security_policy(host: str | None) -> str:
    # 'self' covers same-origin ws:/wss: in CSP3; the explicit origin serves older browsers.
    connect = "'self'"
    if host and _HOST.fullmatch(host):
        connect += f" ws://{host} wss://{host}"
    return "; ".join(
        [
            "default-src 'none'",
            f"script-src {_SCRIPT_SRC}",
            f"style-src {_STYLE_SRC}",
            f"connect-src {connect}",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


async def page(request: Request) -> Response:
    headers = {
        "Content-Security-Policy": content_security_policy(request.headers.get("host")),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cross-Origin-Opener-Policy": "same-origin",
        "Cache-Control": "no-cache",
    }
    return Response(PAGE, headers=headers, media_type="text/html")
