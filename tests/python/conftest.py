import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Inductor compiles in a pool of worker processes by default (one per core),
# which every rank process of every test starts anew: each worker imports
# torch. Two ranks a test already fill this project's 2-core test host, so
# the pool only adds its start-up (measured: a compiled two-rank test 28.7 s
# with the pool, 22.2 s compiling in the rank itself). Set before any test
# imports torch; an explicit setting in the environment wins.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
