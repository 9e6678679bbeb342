"""What a run measures: named OpenAI-compatible base URLs."""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec


class Target(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    url: str  # the OpenAI base URL, as the SDK takes it (http://host:port/v1)
    key: str | None = None
    model: str | None = None  # None: the run's --model
    headers: dict[str, str] = msgspec.field(default_factory=dict)

    def public(self) -> dict[str, object]:
        """For the results file: never the key."""
        return {"name": self.name, "url": self.url, "model": self.model, "auth": bool(self.key)}


def normalise_url(url: str) -> str:
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    # A bare host:port means an OpenAI server at its usual /v1 root.
    return url + "/v1" if parts.path in ("", "/") else url


def parse_target(text: str) -> Target:
    """`NAME=URL[,key=KEY][,model=MODEL]`."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"expected NAME=URL[,key=KEY][,model=MODEL]: {text!r}")
    url, *opts = rest.split(",")
    key: str | None = None
    model: str | None = None
    for opt in opts:
        k, sep, v = opt.partition("=")
        if sep and k.strip() == "key":
            key = v.strip()
        elif sep and k.strip() == "model":
            model = v.strip()
        else:
            raise ValueError(f"unknown target option {opt!r} in {name}= (key=, model=)")
    return Target(name=name.strip(), url=normalise_url(url.strip()), key=key, model=model)


def parse_header(text: str) -> tuple[str, str]:
    """`Name: value` or `Name=value`."""
    for sep in (":", "="):
        k, found, v = text.partition(sep)
        if found and k.strip():
            return k.strip(), v.strip()
    raise ValueError(f"expected 'Name: value': {text!r}")
