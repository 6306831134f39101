"""The checkpoint mailbox, as the API uses it (the code lives next to the embedding worker
that mounts it: :mod:`stream_persia.worker.mailbox`; the NN side in
:mod:`stream_persia.nn.checkpoint_poller`)."""

from __future__ import annotations

from stream_persia.nn.checkpoint_poller import NnCheckpointPoller
from stream_persia.worker.mailbox import (
    REPORT_TIMEOUT_S,
    TERMINAL,
    CheckpointMailbox,
    MailboxClient,
)

__all__ = ["CheckpointMailbox", "MailboxClient", "NnCheckpointPoller", "REPORT_TIMEOUT_S",
           "TERMINAL"]
