"""Tests of jaxkv.core (a package: see tests/conftest.py)."""
