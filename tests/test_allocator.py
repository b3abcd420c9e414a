"""glibc's heap in a rank: a block a step frees stays in the heap for the next step, unless the
user chose the allocator's settings. Each case runs in a fresh interpreter, whose heap is
glibc's own until the case sets it, and asks glibc where a 24 MiB block went."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dpt.launch import allocator
from tests.helpers import REPO

pytestmark = pytest.mark.skipif(
    not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"), reason="glibc only"
)

BLOCK = 24 * 2**20  # under the 32 MiB threshold, far over glibc's first one (128 KiB)

# Where glibc put the block: `mapped`, bytes of it in a mapping of its own (given back to the
# system when freed); `kept`, the heap's free bytes once it was freed (held for the next step).
PROBE = f"""
import ctypes, json
names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2()
block = libc.malloc({BLOCK})
ctypes.memset(block, 1, {BLOCK})
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(json.dumps({{"set": SET, "mapped": during.hblkhd - before.hblkhd,
                  "kept": after.fordblks}}))
"""


def probe(prelude: str, **env: str) -> dict[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in allocator.HEAP_ENV}
    out = subprocess.run(
        [sys.executable, "-c", prelude + PROBE],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(60)
def test_glibc_alone_maps_the_block_and_gives_it_back() -> None:
    # The baseline the other cases differ from: the probe sees glibc's defaults.
    seen = probe("SET = None")
    assert seen["set"] is None and seen["mapped"] >= BLOCK and seen["kept"] < BLOCK


@pytest.mark.timeout(60)
def test_the_block_comes_from_the_heap_and_stays_there() -> None:
    seen = probe("from dpt.launch import allocator; SET = allocator.keep_freed_memory()")
    assert seen["set"] is True and seen["mapped"] == 0
    assert seen["kept"] >= BLOCK


@pytest.mark.timeout(60)
def test_glibc_variables_the_user_set_win() -> None:
    seen = probe(
        "from dpt.launch import allocator; SET = allocator.keep_freed_memory()",
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    assert seen["set"] is False and seen["mapped"] >= BLOCK and seen["kept"] < BLOCK


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MALLOC_TRIM_THRESHOLD_", "0"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536"),
        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
        ("LD_PRELOAD", "libtcmalloc_minimal.so.4"),
    ],
)
def test_an_allocator_the_user_chose_is_left_alone(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for other in (*allocator.HEAP_ENV, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(other, raising=False)
    assert not allocator._user_chose()
    monkeypatch.setenv(name, value)
    assert allocator._user_chose()
    assert allocator.keep_freed_memory() is False


@pytest.mark.slow  # a process of its own trains
@pytest.mark.timeout(120)
def test_a_rank_trains_with_the_heap_kept() -> None:
    run = """
import tempfile
from omegaconf import OmegaConf
from dpt.launch import launchers as launch
from tests.helpers import compose
cfg = compose("trainer.max_steps=2", "dataset.num_val_samples=0", "checkpoint.enabled=false")
SET = launch.run_worker(OmegaConf.to_container(cfg, resolve=True), tempfile.mkdtemp())["steps"]
"""
    seen = probe(run)
    assert seen["set"] == 2 and seen["mapped"] == 0 and seen["kept"] >= BLOCK
