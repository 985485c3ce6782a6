"""KVCacheManager: vLLM's manager vocabulary over one engine.

manager.py      KVCacheManager: the requests (ids, slots, counts, hashers), input checks, errors
engine.py       the interface both engines implement, and the request counts they share
device_loop.py  the hand-overs to jitted programs: a device loop's rows (`hand_over`) or the whole state
host_engine.py  the host engine (the default): the state in place in host memory, compiled loops
jax_engine.py   the jitted engine (`backend="jax"`): a ManagerState on a device, jitted transitions
"""

from jaxkv.manager.manager import KVCacheManager

__all__ = ["KVCacheManager"]
