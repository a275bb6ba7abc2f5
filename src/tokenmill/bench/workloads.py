"""Benchmark workloads: JSON-lines files of fixed prompts (as token ids) and output lengths.

One request a line: {"id", "prompt_token_ids", "prompt", "prompt_len", "max_tokens"}. Every engine
is fed `prompt_token_ids`, so all of them see exactly the same lengths, and generates exactly
`max_tokens` tokens (EOS ignored).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(slots=True)
class WorkloadRequest:
    id: int | str
    prompt_token_ids: list[int]
    max_tokens: int
    prompt: Optional[str] = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def load_workload(path: str | Path, limit: Optional[int] = None) -> list[WorkloadRequest]:
    """Read a JSON-lines workload; `limit` keeps the first N requests. ValueError on a bad line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file not found: {path}")
    requests: list[WorkloadRequest] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            requests.append(_parse_line(line, f"{path}:{line_no}"))
    if not requests:
        raise ValueError(f"workload {path} holds no requests")
    return requests


def _parse_line(line: str, where: str) -> WorkloadRequest:
    try:
        item = json.loads(line)
        ids = [int(t) for t in item["prompt_token_ids"]]
        max_tokens = int(item["max_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a workload request ({exc})") from None
    if not ids or max_tokens < 1:
        raise ValueError(f"{where}: needs a non-empty prompt_token_ids and max_tokens >= 1")
    if "prompt_len" in item and int(item["prompt_len"]) != len(ids):
        raise ValueError(f"{where}: prompt_len {item['prompt_len']} != len(prompt_token_ids) {len(ids)}")
    return WorkloadRequest(id=item.get("id", where), prompt_token_ids=ids, max_tokens=max_tokens,
                           prompt=item.get("prompt"))


def workload_summary(requests: list[WorkloadRequest]) -> dict:
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
    }
