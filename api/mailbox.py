"""The checkpoint mailbox, as the API uses it (the code lives next to the embedding worker
that mounts it: :mod:`stream_persia.worker.mailbox`)."""

from __future__ import annotations

from stream_persia.worker.mailbox import (
    REPORT_TIMEOUT_S,
    TERMINAL,
    CheckpointMailbox,
    MailboxClient,
    NnCheckpointPoller,
)

__all__ = ["CheckpointMailbox", "MailboxClient", "NnCheckpointPoller", "REPORT_TIMEOUT_S",
           "TERMINAL"]
