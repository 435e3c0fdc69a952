"""The files of `batchmaker generate`: prompts in, one JSON line per finished prompt out.

Input, one JSON object a line: {"id": str or int, "tokens": [ids] or "prompt": text,
"max_new_tokens": n (optional)}; ids unique. Output: {"id", "tokens", "finish_reason"} (+ "text"
for a text prompt), appended and flushed one line at a time, so that a run killed at any moment
leaves whole lines (and at most one torn last line, dropped on the next run) and a re-run skips
the ids already written.
"""
import json
from dataclasses import dataclass
from pathlib import Path


class PromptFileError(ValueError):
    """A line of the input (or a previous output) that is not what the command expects; names the line."""


@dataclass(frozen=True)
class PromptRecord:
    id: str | int
    tokens: list[int] | None  # None: a text prompt
    prompt: str | None
    max_new_tokens: int


def read_prompts(path: Path, default_max_new_tokens: int) -> list[PromptRecord]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise PromptFileError(f"--input {path}: {e.strerror}") from None
    records, seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _record(json.loads(line) if _is_json(line) else None, default_max_new_tokens, f"{path}:{number}")
        if record.id in seen:
            raise PromptFileError(f"{path}:{number}: id {record.id!r} appears twice")
        seen.add(record.id)
        records.append(record)
    return records


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def _record(obj, default_max_new_tokens: int, where: str) -> PromptRecord:
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: expected a JSON object per line")
    unknown = set(obj) - {"id", "tokens", "prompt", "max_new_tokens"}
    if unknown:
        raise PromptFileError(f"{where}: unknown keys {sorted(unknown)} (id, tokens or prompt, max_new_tokens)")
    rid, tokens, prompt = obj.get("id"), obj.get("tokens"), obj.get("prompt")
    if type(rid) not in (str, int):
        raise PromptFileError(f"{where}: id must be a string or an integer, got {rid!r}")
    if (tokens is None) == (prompt is None):
        raise PromptFileError(f"{where}: exactly one of tokens and prompt is needed")
    if tokens is not None and (not isinstance(tokens, list) or not tokens or any(type(t) is not int for t in tokens)):
        raise PromptFileError(f"{where}: tokens must be a non-empty list of integers")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise PromptFileError(f"{where}: prompt must be a non-empty string")
    n = obj.get("max_new_tokens", default_max_new_tokens)
    if type(n) is not int or n < 1:
        raise PromptFileError(f"{where}: max_new_tokens must be an integer >= 1, got {n!r}")
    return PromptRecord(rid, tokens, prompt, n)


def finished_ids(path: Path) -> set:
    """The ids an earlier run wrote to `path` (none if it does not exist); a torn last line (the
    run was killed while writing it) is cut off the file."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]
        path.write_bytes(data)
    ids = set()
    for number, line in enumerate(data.decode().splitlines(), 1):
        if line.strip():
            obj = json.loads(line) if _is_json(line) else None
            if not isinstance(obj, dict) or "id" not in obj:
                raise PromptFileError(f"--output {path}:{number}: not a line this command writes")
            ids.add(obj["id"])
    return ids


class OutputFile:
    """Appends one JSON line per finished prompt, flushed at once."""

    def __init__(self, path: Path):
        self.file = open(path, "a")

    def write(self, record: PromptRecord, tokens: list[int], finish_reason: str, text: str | None = None) -> None:
        line = {"id": record.id, "tokens": tokens, "finish_reason": finish_reason}
        if text is not None:
            line["text"] = text
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
