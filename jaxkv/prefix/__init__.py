"""Prefix caching: hashes of full units on the host, and the on-device index and hit rules the step's
phases (store keys, lookup + claim hits, index filled blocks) use.

hashing.py  chained SHA-256 unit hashes with typed extra keys (host)
index.py    the index: (128-bit hash, group) -> block id, a bucketized hash table of arrays
rules.py    which hits each group's rule accepts, and the hit valid for every group
state.py    per-request hashes and the phases that store, look up, claim and index
tails.py    hits inside a block: partial entries and the block copies they need

Internal: use the names `jaxkv` exports.
"""
