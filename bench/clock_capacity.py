"""Does a decoding step's cost depend on how large earlier prompts grew the caches? (issue 33)

The evaluation's sessions keep one cache per process, grown (never shrunk) to the longest
prompt so far. The same round cost 5.5 ms in the acceptance stage and 2.7 ms in DDTree's, which
decodes fewer, so shorter, prompts. This times the clock probe's fixed steps (`probe_steps`: a
1-token and a 16-token verify and one drafter round after a 512-token prefix) on sessions whose
caches were first grown to each capacity, reading the whole cache (`--span-rows 0`, the old
steps) or only the rows up to each step's span (`dflash.eval.sessions.SPAN_ROWS`).

    python3 bench/clock_capacity.py --capacities 1024,4096,16384 --out results.json
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import random_target_and_drafter  # noqa: E402

from dflash.eval import sessions  # noqa: E402
from dflash.eval.decode import DrafterProposer  # noqa: E402
from dflash.eval.probe import probe_steps  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--config", default="config/models/smollm2-135m")
p.add_argument("--capacities", default="1024,2048,4096,8192,16384")
p.add_argument("--span-rows", default="0,256", help="0: every step reads the whole cache")
p.add_argument("--drafter-layers", type=int, default=5)
p.add_argument("--out")
args = p.parse_args()

device, config, model, layers, drafter = random_target_and_drafter(args.config, args.drafter_layers)
rows = []
for span_rows in [int(x) for x in args.span_rows.split(",")]:
    sessions.SPAN_ROWS = span_rows or 1 << 30
    for capacity in [int(x) for x in args.capacities.split(",")]:
        target = sessions.StaticSession(model, layers)
        proposer = DrafterProposer(drafter, model.get_input_embeddings(), model.lm_head.weight)
        target.reset(capacity)
        proposer.start([0], target.forward([0])[1], capacity)
        row = {"span_rows": span_rows, "capacity": capacity, **probe_steps(target, proposer, 1000)}
        print(row, flush=True)
        rows.append(row)
if args.out:
    Path(args.out).write_text(json.dumps({"device": str(device), "rows": rows}, indent=1))
