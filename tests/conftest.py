"""Shared test set-up."""

import torch

# The tests use tiny models, which gain nothing from intra-op threads; on a busy 2-core machine (and
# with one pytest-xdist worker per core) the thread pools' spinning makes them several times slower.
torch.set_num_threads(1)
