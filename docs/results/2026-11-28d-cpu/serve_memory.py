"""``batchspec serve ...`` in this process, its resident set and glibc's heap figures (``mallinfo2``: the arenas'
heap, the blocks mapped on their own, the bytes in use and free) written every second to ``$MEMLOG``; ``$KEEP``, when
set, replaces ``batchspec.memory.KEEP_BYTES`` (how much freed memory the heap keeps).

    MEMLOG=server_memory.log python serve_memory.py serve --preset qwen2.5-coder --max-batch-size 8 --port 8011
"""

import ctypes
import os
import sys
import threading
import time

import batchspec.memory as memory
from batchspec.cli import app


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def log(path: str) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    with open(path, "w") as out:
        while True:
            info = libc.mallinfo2()
            with open("/proc/self/statm") as statm:
                rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            out.write(f"{time.time():.1f} rss {rss / 1e9:.3f} heap {info.arena / 1e9:.3f} mmapped "
                      f"{info.hblkhd / 1e9:.3f} used {info.uordblks / 1e9:.3f} free {info.fordblks / 1e9:.3f}\n")
            out.flush()
            time.sleep(1)


if __name__ == "__main__":
    threading.Thread(target=log, args=(os.environ["MEMLOG"],), daemon=True).start()
    if os.environ.get("KEEP"):
        memory.KEEP_BYTES = int(os.environ["KEEP"])
    sys.argv = ["batchspec", *sys.argv[1:]]
    app()
