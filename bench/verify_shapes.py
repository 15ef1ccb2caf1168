"""Does a verify forward's cost depend on the first multi-token length a process met? (issue 33)

The fused decode layers compile with automatic dynamism: the first length is compiled static,
the second one recompiles with the length dynamic, and inductor tunes that graph for the length
it saw then. The acceptance stage meets prompt lookup's short drafts first; DDTree meets 16.

    python3 bench/verify_shapes.py --first 1,3     # then times 16-token verifies
"""

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.eval.sessions import StaticSession
from dflash.model.target import default_layer_ids

p = argparse.ArgumentParser()
p.add_argument("--config", default="config/models/smollm2-135m")
p.add_argument("--first", default="1,16", help="lengths met first, in order")
p.add_argument("--time", default="16,1", help="lengths timed after them")
p.add_argument("--reps", type=int, default=200)
args = p.parse_args()
torch.manual_seed(0)
config = AutoConfig.from_pretrained(args.config)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
session = StaticSession(model, default_layer_ids(config.num_hidden_layers, 5))
session.reset(2048)
prompt = torch.randint(0, config.vocab_size, (1024,)).tolist()
with torch.no_grad():
    session.forward(prompt)
    for n in [int(x) for x in args.first.split(",")]:
        for _ in range(3):
            session.forward(prompt[:n])
            session.crop(1024)
    out = {}
    for n in [int(x) for x in args.time.split(",")]:
        for _ in range(5):
            session.forward(prompt[:n])
            session.crop(1024)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            session.forward(prompt[:n])
            session.crop(1024)
        torch.cuda.synchronize()
        out[n] = round(1000 * (time.perf_counter() - t0) / args.reps, 3)
print(f"first {args.first}: ms per verify forward {out}", flush=True)
