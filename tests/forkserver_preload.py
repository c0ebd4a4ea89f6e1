"""Imported last by the fork server of tests/distributed.py, after torch, Dynamo, Inductor and
train: moves everything imported so far out of the garbage collector's reach (`gc.freeze`).
Each rank forks from the server with that heap; without this, each of a rank's collections
walks the millions of objects those imports made (a full collection took 0.16 s), none of
which a rank ever frees."""

import gc

gc.freeze()
