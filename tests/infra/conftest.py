"""Fixtures of the provisioning tests; they live in tf_support.py (a unique module name that tests
can import helpers from, where `conftest` would be ambiguous across the repository)."""

from tf_support import mock_apply, plugin_dir, terraform, tf_copy

__all__ = ["mock_apply", "plugin_dir", "terraform", "tf_copy"]
