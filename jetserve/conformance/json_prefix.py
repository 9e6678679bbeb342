"""Whether a text is the start of a JSON value: what a grammar-constrained reply
cut off at ``max_tokens`` looks like. The conformance check tells "the engine
ignored ``response_format``" (text that is no JSON at all) from "the engine
applied it, and the model never closed the object" (a random-weight model does
that), which is no silent drop."""

from __future__ import annotations

import re

_NUMBER_PREFIX = re.compile(r"-?(0|[1-9]\d*)?(\.\d*)?([eE][-+]?\d*)?")
_LITERALS = ("true", "false", "null")
_VALUE, _KEY_OR_CLOSE, _KEY, _COLON, _NEXT, _VALUE_OR_CLOSE, _END = range(7)


def _scalar_prefix(run: str) -> bool:
    if run[0].isalpha():
        return any(lit.startswith(run) for lit in _LITERALS)
    return _NUMBER_PREFIX.fullmatch(run) is not None


def is_json_prefix(text: str) -> bool:
    """True when some continuation of ``text`` is valid JSON (a complete value
    counts too). Scans once; strings and escapes are followed, numbers and
    literals checked as prefixes."""
    stack: list[str] = []
    expect = _VALUE
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in " \t\r\n":
            i += 1
            continue
        if expect == _END:
            return False
        if ch == '"':
            if expect not in (_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE):
                return False
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                return True  # cut inside the string
            expect = _COLON if expect in (_KEY, _KEY_OR_CLOSE) else _after(stack)
            i = j + 1
            continue
        if ch in "{[":
            if expect not in (_VALUE, _VALUE_OR_CLOSE):
                return False
            stack.append(ch)
            expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        elif ch in "}]":
            top = "{" if ch == "}" else "["
            closable = _KEY_OR_CLOSE if ch == "}" else _VALUE_OR_CLOSE
            if not stack or stack[-1] != top or expect not in (closable, _NEXT):
                return False
            stack.pop()
            expect = _after(stack)
        elif ch == ":":
            if expect != _COLON:
                return False
            expect = _VALUE
        elif ch == ",":
            if expect != _NEXT:
                return False
            expect = _KEY if stack[-1] == "{" else _VALUE
        else:
            if expect not in (_VALUE, _VALUE_OR_CLOSE):
                return False
            j = i
            while j < n and text[j] not in ' \t\r\n,:]}{["':
                j += 1
            run = text[i:j]
            if j >= n:
                return _scalar_prefix(run)  # cut inside a number or literal
            if run not in _LITERALS and not _complete_number(run):
                return False
            expect = _after(stack)
            i = j
            continue
        i += 1
    return True


def _complete_number(run: str) -> bool:
    return re.fullmatch(r"-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?", run) is not None


def _after(stack: list[str]) -> int:
    """What may follow a complete value: a comma or the close, or nothing at the top."""
    return _NEXT if stack else _END
