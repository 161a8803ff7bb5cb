"""psframe.memory.malloc: freed tensor buffers are reused, not mapped afresh every step.

This file holds the unit tier's tests of the subject; `tests/cluster/test_allocator.py` holds the
other tiers'.
"""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys

import pytest

from psframe.memory import malloc

# Allocates, fills and frees a 64 MiB tensor (a large MLP's 4096 x 4096 gradient)
# a few times, and counts the page faults once the heap has settled.
_PROBE = r"""
import json, resource, torch
from psframe.memory import malloc
tuned = malloc.tune_malloc()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    x = torch.empty(16 << 20); x.fill_(1.0); del x
before = faults()
for _ in range(5):
    x = torch.empty(16 << 20); x.fill_(1.0); del x
print(json.dumps({"tuned": tuned, "faults": faults() - before}))
"""
# Where a 64 MiB buffer lives, from glibc's own accounting (mallinfo2): in a
# mapping of its own (hblkhd) or in the heap, and whether the heap keeps it
# once it is freed (fordblks: free bytes held for reuse).
_HEAP_PROBE = r"""
import ctypes, json, torch
from psframe.memory import malloc
tuned = malloc.tune_malloc()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
x = torch.empty(16 << 20); x.fill_(1.0)
mapped = libc.mallinfo2().hblkhd
del x
print(json.dumps({"tuned": tuned, "mapped": mapped, "kept": libc.mallinfo2().fordblks}))
"""
BUFFER_BYTES = 64 << 20
PAGES_PER_BUFFER = BUFFER_BYTES // 4096


def _probe(code: str = _PROBE, **env_changes: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD", malloc.OPT_OUT_VARIABLE)
    }
    env.update(env_changes)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_docstring_examples():
    result = doctest.testmod(malloc)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize(
    "environ, reason",
    [
        ({}, None),
        ({"PSFRAME_TUNE_MALLOC": "1"}, None),
        ({"PSFRAME_TUNE_MALLOC": "off"}, "PSFRAME_TUNE_MALLOC=off"),
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_ is set"),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, "GLIBC_TUNABLES sets glibc.malloc"),
        ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2048"}, None),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "LD_PRELOAD loads libtcmalloc_minimal.so.4"),
        ({"LD_PRELOAD": "libfoo.so"}, None),
    ],
)
def test_user_choice_of_allocator_is_respected(environ, reason):
    assert malloc.user_choice(environ) == reason


def test_first_decision_holds_for_the_process(monkeypatch):
    monkeypatch.setattr(malloc, "_result", None)
    assert malloc.tune_malloc({"PSFRAME_TUNE_MALLOC": "0"}) is False
    # A later call (another Server or Trainer in the same process) changes nothing.
    assert malloc.tune_malloc({}) is False


def test_memory_returner_trims_every_so_many_bytes_only_when_enabled():
    trims = []
    returner = malloc.MemoryReturner(enabled=True)
    returner._trim = trims.append  # count the calls instead of trimming
    for _ in range(5):
        returner.handled(malloc.MemoryReturner.EVERY_BYTES // 2)
    assert trims == [0, 0]  # after the 2nd and the 4th message
    off = malloc.MemoryReturner(enabled=False)
    off.handled(10 * malloc.MemoryReturner.EVERY_BYTES)
    assert off._trim is None


_CONSTRUCTORS_PROBE = r"""
import json, torch, psframe
from psframe.memory import malloc
cluster = psframe.ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
psframe.Trainer(torch.nn.Linear(2, 2), cluster, task_index=0)
after_trainer = malloc.malloc_tuned()
server = psframe.Server(cluster, "ps", 0, start=False)
after_server = malloc.malloc_tuned()
print(json.dumps({"trainer": after_trainer, "server": after_server, "explicit": psframe.tune_process()}))
"""
