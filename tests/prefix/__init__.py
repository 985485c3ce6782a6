"""Tests of jaxkv.prefix (a package: see tests/conftest.py)."""
