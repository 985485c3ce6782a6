"""Tests of jaxkv.planner (a package: see tests/conftest.py)."""
