"""Byte-level mutations of messages for fuzzing decoders (used with hypothesis)."""


def mutate(data: bytes, edits) -> bytes:
    """``data`` after ``edits``: ``(kind, position, byte)`` triples; kind 0 replaces the byte at
    ``position % len``, 1 inserts ``byte`` there, 2 deletes it, anything else cuts the rest."""
    data = bytearray(data)
    for kind, position, byte in edits:
        if not data:
            break
        i = position % len(data)
        if kind == 0:
            data[i] = byte
        elif kind == 1:
            data.insert(i, byte)
        elif kind == 2:
            del data[i]
        else:
            data = data[:i]
    return bytes(data)
