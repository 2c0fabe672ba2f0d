import os
import sys

# Before torch is imported (c10/core/impl/alloc_cpu.cpp reads it once, at the first allocation): CPU tensors of 2 MiB
# and more are allocated 2 MiB-aligned with madvise(MADV_HUGEPAGE), so a fresh batch of floats (38 MB at 64 x 224 px,
# above glibc's 32 MiB mmap limit: new pages every step) takes a few huge-page faults instead of ~9,400 small ones.
# Where the kernel's transparent huge pages are "never" it changes nothing. THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .cli import main  # noqa: E402

sys.exit(main())
