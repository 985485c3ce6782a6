"""Tests of jaxkv.memory (a package: see tests/conftest.py)."""
