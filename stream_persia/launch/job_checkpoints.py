"""Checkpoints ``stream-persia run`` asks its job's control API for.

Two of them: the serving replica's first (``bootstrap``, asked for as soon as training runs)
and the one taken on Ctrl-C before every role stops. The second must cut the training where
it stops, so a checkpoint in progress when it is asked for (the first one, or one a user
asked for over the API) is waited out, then it is asked for again.
"""

from __future__ import annotations

import sys
import time

__all__ = ["checkpoint_and_wait", "request_checkpoint"]


def request_checkpoint(api_address: str, token: str, ident: str) -> bool:
    """Ask the job's control API for checkpoint ``ident`` (the replica's first); a refusal
    is printed, not raised: the replica then has nothing to start from and says so."""
    import httpx

    try:
        r = httpx.post(f"http://{api_address}/v1/checkpoints", json={"id": ident},
                       headers={"Authorization": f"Bearer {token}"}, timeout=10)
    except Exception as e:  # best effort: the run goes on without a replica
        print(f"stream-persia run: cannot request the replica's checkpoint: {e!r}",
              file=sys.stderr)
        return False
    if r.status_code != 202:
        print(f"stream-persia run: the replica's first checkpoint was refused: HTTP "
              f"{r.status_code} {r.text[:200]}", file=sys.stderr)
    return r.status_code == 202


def checkpoint_and_wait(api_address: str, token: str, budget_s: float) -> str | None:
    """Take a checkpoint over the API (``POST /v1/checkpoints``) and wait for it, at most
    ``budget_s`` in all; its id when done, None (said on stderr) otherwise.

    A 409 while another checkpoint is in progress waits for that one, then asks again."""
    import httpx

    base = f"http://{api_address}"
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + budget_s
    try:
        idle_conflicts = 0
        while True:
            left = max(0.1, deadline - time.monotonic())
            r = httpx.post(f"{base}/v1/checkpoints", headers=headers, json={},
                           timeout=min(10.0, left))
            # 409 while another checkpoint is being taken (the serving replica's first, or
            # one a user asked for): wait for it to end, then ask for ours, which must cut
            # the training where it stops. The other one may end between our POST and the
            # look at the list: then ask again at once (a 409 that persists with nothing
            # being taken is a real refusal, said with its body below).
            if r.status_code != 409 or time.monotonic() + 0.5 >= deadline:
                break
            if _checkpoint_busy(base, headers, min(10.0, left)):
                idle_conflicts = 0
                time.sleep(0.5)
            else:
                idle_conflicts += 1
                if idle_conflicts >= 3:
                    break
                time.sleep(0.1)
        if r.status_code != 202:
            print(f"stream-persia run: checkpoint on interrupt refused: HTTP "
                  f"{r.status_code} {r.text[:300]}", file=sys.stderr)
            return None
        ckpt_id = r.json()["id"]
        while time.monotonic() < deadline:
            left = max(0.1, deadline - time.monotonic())
            s = httpx.get(f"{base}/v1/checkpoints/{ckpt_id}", headers=headers,
                          timeout=min(10.0, left))
            state = s.json().get("state") if s.status_code == 200 else None
            if state in ("done", "failed"):
                return ckpt_id if state == "done" else None
            time.sleep(min(0.5, left))
        print(f"stream-persia run: the checkpoint was not done within {budget_s:g} s "
              "(--stop-checkpoint-s)", file=sys.stderr)
    except Exception as e:  # best effort: stopping must not hang on a broken API
        print(f"stream-persia run: checkpoint on interrupt failed: {e!r}", file=sys.stderr)
    return None


def _checkpoint_busy(base: str, headers: dict[str, str], timeout_s: float) -> bool:
    """Whether the job's API is taking a checkpoint now (one not yet done or failed)."""
    import httpx

    r = httpx.get(f"{base}/v1/checkpoints", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return any(c.get("state") not in ("done", "failed")
               for c in r.json().get("checkpoints", []))
