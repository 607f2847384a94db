"""Reading JSONL documents with errors that name the file and line."""
from __future__ import annotations

import json
from typing import Dict, Iterator, Optional, Sequence, Tuple

from .errors import DataError


def parse_line(line: str, keys: Sequence[str], path: str, lineno: int) -> Dict[str, str]:
    """One JSONL line -> {key: text}; raises DataError naming `path` line `lineno`."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path} line {lineno} is not valid JSON ({e.msg} at column {e.colno}).") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} line {lineno} is a JSON {type(obj).__name__}, not an object with key(s) {', '.join(keys)}.")
    out = {}
    for k in keys:
        if k not in obj:
            raise DataError(f"{path} line {lineno} has no key {k!r} (its keys are {', '.join(map(repr, obj)) or 'none'}).")
        if not isinstance(obj[k], str):
            raise DataError(f"{path} line {lineno} key {k!r} is a JSON {type(obj[k]).__name__}, not a string.")
        out[k] = obj[k]
    return out


def iter_jsonl(path: str, keys: Sequence[str], skip_bad: bool = False,
               skipped: Optional[list] = None) -> Iterator[Tuple[int, Dict[str, str]]]:
    """Yield (line number, {key: text}) for each non-blank line.

    With skip_bad, bad lines are left out and their DataErrors appended to `skipped`.
    """
    with open(path, encoding="utf-8", errors="strict") as f:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = f.readline()
            except UnicodeDecodeError:
                err = DataError(f"{path} line {lineno} is not valid UTF-8.")
                if not skip_bad:
                    raise err from None
                if skipped is not None:
                    skipped.append(err)
                continue
            if not line:
                return
            if not line.strip():
                continue
            try:
                yield lineno, parse_line(line, keys, path, lineno)
            except DataError as err:
                if not skip_bad:
                    raise
                if skipped is not None:
                    skipped.append(err)
