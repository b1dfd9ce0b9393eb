"""``python -m tensorplay_hpc.checkpoint info|list|export|import``: the same as
``tensorplay-hpc checkpoint``."""
import sys

from tensorplay_hpc.__main__ import main

sys.exit(main(["checkpoint", *sys.argv[1:]]))
