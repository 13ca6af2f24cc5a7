"""The raw bytes a vocabulary token stands for: byte-level BPE ('Ġday') and SentencePiece ('▁day', '<0x0A>')."""

from __future__ import annotations

import re

SP_SPACE = "\u2581"  # SentencePiece's "▁"
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


CHAR_OF_BYTE = bytes_to_unicode()
_BYTE_OF_CHAR = {c: b for b, c in CHAR_OF_BYTE.items()}


def byte_level_token_bytes(token: str) -> bytes:
    """Raw bytes of a byte-level BPE token ('Ġday' -> b' day'); text outside the byte alphabet is UTF-8."""
    if all(c in _BYTE_OF_CHAR for c in token):
        return bytes(_BYTE_OF_CHAR[c] for c in token)
    return token.encode("utf-8")


def sentencepiece_token_bytes(token: str) -> bytes:
    """Raw bytes of a SentencePiece token ('▁day' -> b' day', '<0x0A>' -> b'\\n')."""
    m = _SP_BYTE.fullmatch(token)
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace(SP_SPACE, " ").encode("utf-8")
