"""An append-only JSONL record of every request: what was decoded, how, and whether it is lossless.

One line per request, written when it ends (finished, stopped, cancelled, timed out or rejected)::

    {"request_id": "cmpl-...", "endpoint": "/v1/completions", "status": "finished",
     "finish_reason": "stop", "created": 1735689600.12, "created_iso": "2025-01-01T00:00:00.120Z",
     "started": ..., "first_token": ..., "finished": ..., "queue_s": ..., "ttft_s": ..., "e2e_s": ...,
     "settings": {"model": ..., "temperature": ..., "top_p": ..., "top_k": ..., "max_tokens": ...,
                  "seed": ..., "num_stop_strings": ..., "stream": ..., "speculation_mode": ...},
     "usage": {"prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ...},
     "speculative": {"enabled": ..., "proposer": ..., "num_speculative_tokens": ..., "drafts": ...,
                     "draft_tokens": ..., "accepted_tokens": ..., "mean_acceptance_length": ...,
                     "acceptance_rate": ..., "lossless": true}}

The prompt text (and stop strings) are never written unless the server runs with
``--audit-log-prompts``; then ``"prompt"`` holds the prompt as received (string, token ids or
chat messages). The file is opened in append mode for every line, under a lock, and flushed, so
lines from concurrent requests never interleave and a crash loses at most the line in progress.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def iso(timestamp: float | None) -> str | None:
    """Unix seconds -> ``2025-01-01T00:00:00.120Z`` (UTC), or None."""
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def audit_record(req: Any, reason: str, info: dict[str, Any], error: str | None) -> dict[str, Any]:
    """The line of one request that ended with ``reason`` (its
    :class:`~specdecode.serve.request.ServeRequest`, and the ``usage`` / ``speculative`` /
    ``timings`` summary it was answered with), without the prompt (:meth:`AuditLog.write` adds
    it when allowed)."""
    t = info["timings"]
    return {
        "request_id": req.request_id,
        "endpoint": req.endpoint,
        "status": {"stop": "finished", "length": "finished"}.get(reason, reason),
        "finish_reason": reason,
        "error": error,
        **{key: t.get(key) for key in ("created", "started", "first_token", "finished")},
        "created_iso": iso(t.get("created")),
        "finished_iso": iso(t.get("finished")),
        **{key: t.get(key) for key in ("queue_s", "ttft_s", "e2e_s")},
        "settings": req.audit_settings,
        "usage": info["usage"],
        "speculative": info["speculative"],
    }


class AuditLog:
    """Appends one JSON object per line to ``path`` (created with its folder if missing).

    Args:
        path: the JSONL file.
        include_prompts: write the prompt text (``--audit-log-prompts``).

    Raises:
        OSError: the file cannot be opened for appending (checked at construction).
    """

    def __init__(self, path: str | Path, include_prompts: bool = False) -> None:
        self.path = Path(path).expanduser()
        self.include_prompts = include_prompts
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8"):
            pass

    def write(self, record: dict[str, Any], prompt: Any = None) -> None:
        """Append ``record`` (JSON-ready), with ``prompt`` only if prompts are included."""
        line = dict(record)
        if self.include_prompts and prompt is not None:
            line["prompt"] = prompt
        text = json.dumps(line, ensure_ascii=False, default=str) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
