"""Run `batchspec serve ...` in this process, logging RSS and glibc's heap figures every second to $MEMLOG."""
import ctypes, os, sys, threading, time

class MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI2

def log():
    with open(os.environ["MEMLOG"], "w") as f:
        while True:
            m = libc.mallinfo2(); rss = int(open("/proc/self/statm").read().split()[1]) * 4096
            f.write(f"{time.time():.1f} rss {rss/1e9:.3f} heap {m.arena/1e9:.3f} mmapped {m.hblkhd/1e9:.3f} used {m.uordblks/1e9:.3f} free {m.fordblks/1e9:.3f}\n"); f.flush()
            time.sleep(1)

threading.Thread(target=log, daemon=True).start()
import batchspec.memory as mem
if os.environ.get("KEEP"):
    mem.KEEP_BYTES = int(os.environ["KEEP"])
from batchspec.cli import app
sys.argv = ["batchspec", *sys.argv[1:]]
app()
