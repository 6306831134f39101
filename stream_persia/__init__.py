"""stream-persia: PERSIA-style hybrid training of huge recommendation models from Kafka.

The public API mirrors PERSIA's (``persia.ctx`` → ``stream_persia.ctx`` and so on), so a
PERSIA job ports by changing the import root.
"""

__version__ = "0.1.0"
