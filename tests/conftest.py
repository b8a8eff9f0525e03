"""Shared pytest setup: the skip policy plugin (see ``skip_policy``)."""

pytest_plugins = ["skip_policy"]
