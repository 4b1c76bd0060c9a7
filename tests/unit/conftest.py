"""Settings every unit-test process shares (the xdist controller sets them before it starts its workers).

RES_OPTIONS: torch's c10d names each socket address in its own bookkeeping with a reverse lookup
(`getnameinfo` without NI_NUMERICHOST), on the client for the store's address and on the store's libuv loop
for each client it accepts. A test store listens on 127.0.0.1 and is reached over a dual-stack socket as
::ffff:127.0.0.1, an address /etc/hosts does not name, so every TCPStore connection asks the DNS server for a
PTR record; where that server drops a query now and then (about one in a hundred on the sandbox hosts), glibc
waits its 5 s timeout before asking again. A dropped query on the store's loop holds up every client of that
store, and a trainer's 5 s connect timeout failed on one. With one 1 s attempt the first dropped query fails
(EAI_AGAIN) after 1 s, and c10d stops looking names up for the rest of the process (it logs IP addresses from
then on). Nothing in tests/unit needs a name from the DNS server; a value set by the caller is kept.

Bytecode: where PYTHONDONTWRITEBYTECODE is set (as on the sandbox hosts), Python caches no compiled module and
pytest no module whose asserts it rewrote, so every process (the controller and each xdist worker) compiled the
project and rewrote every test module again: about 15 s of the fast tier's 69 s on 2 cores. Then compiled modules
are cached outside the checkout, in the system's temporary directory, one tree per user (sys.pycache_prefix, as
PYTHONPYCACHEPREFIX would set it; pytest's rewrite cache follows it); the checkout stays free of __pycache__. A
prefix the caller set is kept, and so is bytecode writing where it was on.

OMP_NUM_THREADS, OPENBLAS_NUM_THREADS: the fast tier runs one xdist worker per core; torch's intra-op pool and
OpenBLAS (numpy, scipy's fits) would each start a thread per core in every worker, and their threads spin while
they wait for the next parallel region, on cores the other worker needs. One thread each (a caller's value kept);
the tests that care about threads set them themselves.
"""
import gc
import os
import sys
import tempfile

import pytest

if sys.dont_write_bytecode and sys.pycache_prefix is None:
    sys.pycache_prefix = os.path.join(tempfile.gettempdir(), f"elastic-slurm-pycache-{os.getuid()}")
    sys.dont_write_bytecode = False
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
for _pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_pool, "1")


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection imports torch, scipy, sklearn and flask (millions of objects) while rewriting the asserts of ~75
    test modules (millions of short-lived AST nodes): each of the ~13 full garbage collections that these
    allocations set off walked the whole heap, 1.7-1.9 s of CPU per process (per xdist worker), a quarter of its
    collection. So the collector is off while collection runs (the AST nodes are freed by reference counting; the
    few cycles the imports leave stay), and what is alive after it (the libraries, the collected tests) is frozen
    out of later collections, which then walk only what the tests allocate (pytest's five at the end included)."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()
