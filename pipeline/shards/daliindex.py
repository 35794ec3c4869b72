"""DALI webdataset index files (`.idx`): written beside each shard, read back to verify.

Format v1.2, as DALI's `wds2idx` writes it: a first line `v1.2 <num_samples>`, then one line
per sample holding, for each member, `<ext> <data offset> <size> <member name>`. With it,
`fn.readers.webdataset` starts without scanning the tar.
"""

from __future__ import annotations

VERSION = "v1.2"
Entry = tuple[str, int, int, str]  # ext, offset of the member's data, size, member name


def format_index(samples: list[list[Entry]]) -> str:
    """The index of `samples`; ValueError for an entry the format cannot hold: its lines are
    split on whitespace, so an empty extension, or whitespace in one or in a member name,
    would shift every field after it and the readers would refuse the whole index."""
    lines = [f"{VERSION} {len(samples)}"]
    for members in samples:
        for ext, _offset, _size, name in members:
            if not ext or has_whitespace(ext) or has_whitespace(name):
                raise ValueError(f"index entry {name!r} (extension {ext!r}): a DALI index "
                                 "cannot hold an empty extension or whitespace in a name")
        lines.append(" ".join(f"{ext} {off} {size} {name}" for ext, off, size, name in members))
    return "\n".join(lines) + "\n"


def has_whitespace(text: str) -> bool:
    """Whether `text` holds a character that parse_index splits a line or the lines on
    (DALI's parser splits on the ASCII ones among them)."""
    return any(c.isspace() for c in text)


def parse_index(text: str) -> list[list[Entry]]:
    """Parse an index written by `format_index`; ValueError says what is malformed."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith(VERSION + " "):
        raise ValueError(f"index does not start with '{VERSION} <count>'")
    count = int(lines[0].split()[1])
    samples = [_parse_line(line) for line in lines[1:] if line.strip()]
    if len(samples) != count:
        raise ValueError(f"index declares {count} samples but lists {len(samples)}")
    return samples


def _parse_line(line: str) -> list[Entry]:
    fields = line.split()
    if len(fields) % 4:
        raise ValueError(f"index line has {len(fields)} fields, not a multiple of 4: {line!r}")
    return [(fields[i], int(fields[i + 1]), int(fields[i + 2]), fields[i + 3])
            for i in range(0, len(fields), 4)]
