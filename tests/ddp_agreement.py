"""Run by tests/test_training.py under torchrun (2 processes, gloo): one DDP step against one local step."""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from headmix.models import build_model, get_config
from headmix.training.trainer import wrap_distributed

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = build_model(get_config("tiny-moa", task="translation", vocab_size=200).replace(dropout=0.0))
reference = copy.deepcopy(model)
g = torch.Generator().manual_seed(1)
batches = [{k: torch.randint(5, 200, (3, 7), generator=g) for k in ("src", "tgt_in", "tgt_out")} for _ in range(2)]

ddp = wrap_distributed(model, "ddp", torch.device("cpu"))
opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
ddp(**batches[rank]).total_loss.backward()
opt.step()

ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
loss = sum(reference(**b).total_loss for b in batches) / 2
loss.backward()
ref_opt.step()

diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
if rank == 0:
    torch.manual_seed(0)
    init = build_model(get_config("tiny-moa", task="translation", vocab_size=200).replace(dropout=0.0))
    changed = sum(int(not torch.equal(a, b)) for a, b in zip(model.parameters(), init.parameters()))
    Path(sys.argv[1], "ddp_result.json").write_text(json.dumps({"max_abs_diff": diff, "changed": changed}))
dist.destroy_process_group()
