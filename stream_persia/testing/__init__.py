"""Test support shipped with the package: the Kafka test broker and pytest fixtures."""
