"""``python -m tensorplay_hpc.bench NAME...``: the same as ``tensorplay-hpc bench``."""
import sys

from tensorplay_hpc.__main__ import main

sys.exit(main(["bench", *sys.argv[1:]]))
