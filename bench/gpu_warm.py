"""`bench/gpu.py` section 5, the warm start: a fresh process (`bench/gpu.py --warm-child`) pointed
at this run's compile cache runs the warmup rule's own code on the last drafter case's shape:
seconds to import what training imports, each graph's first call, dynamo's compile-time split
and the cache hits."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

GPU_PY = Path(__file__).resolve().with_name("gpu.py")  # the entry point runs the child


class WarmSection:
    """Section 5 of `Bench`: the warm start, measured in a child process."""

    def warm_section(self):
        """A fresh process that finds this run's compile cache, as a training process finds the
        warmup rule's: its seconds to import what training imports, then the warmup rule's own
        code (`warm_shapes`) on the last drafter case's shape, each graph's first call, with
        dynamo's compile-time split and the cache hits: what still compiles warm, and for how
        long. With `--before`, also for the whole drafter compiled (`compile.scope: model`)."""
        import subprocess

        results = {}
        for scope in ("model", "layers") if self.args.before else ("layers",):
            spec = {
                "target_config": str(self.cfg_dir),
                "cache": str(self.work / "compile-cache"),
                "layers": self.args.layers,
                "scope": scope,
                "anchors": self.cases[-1][0],  # the last drafter case's graphs are in the cache
                "shapes": [[self.cases[-1][1], self.args.length]],
                "mask_token_id": self.target_cfg.vocab_size - 1,
                "device": str(self.device),
                "profile": str(Path(self.args.out).parent / f"warm-start-{scope}-cprofile.txt"),
            }
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, str(GPU_PY), "--warm-child", json.dumps(spec)],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                results[scope] = {"error": done.stderr[-3000:]}
                continue
            results[scope] = json.loads(done.stdout.strip().splitlines()[-1])
            results[scope]["command_wall_s"] = round(time.perf_counter() - t0, 1)
        # the production scope's numbers at the top level (the goals table reads them there)
        self.save("warm_start", results.pop("layers") | {"other_scopes": results})


def warm_child(spec: dict) -> None:
    """The warm-start measurement (`Bench.warm_section`), in its own process; prints JSON."""
    from dflash.host import process_age_s

    marks = {"interpreter_and_torch": process_age_s()}
    import dflash.train.loop  # noqa: F401  (everything a training process imports)

    marks["training_imports"] = process_age_s()
    from warmup_gpu import warm_config

    from dflash.model.drafter import Drafter, DrafterConfig
    from dflash.train.warmup import use_cache, warm_shapes

    use_cache(Path(spec["cache"]))
    config = warm_config(
        spec["layers"], spec["anchors"], spec["mask_token_id"], spec["device"], spec["scope"]
    )
    shapes = [tuple(x) for x in spec["shapes"]]
    import cProfile
    import io
    import pstats

    t0 = time.perf_counter()
    with cProfile.Profile() as prof:  # where a warm start's seconds go, by Python function
        records, setup = warm_shapes(Path(spec["target_config"]), config, shapes, steps=1)
    warm_s = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    Path(spec["profile"]).write_text(text.getvalue())
    marks["warm_shapes"] = process_age_s()
    # the drafter's construction alone (part of warm_shapes above): fp32 init on the host
    from transformers import AutoConfig

    cfg = DrafterConfig.for_target(
        AutoConfig.from_pretrained(spec["target_config"]), spec["layers"], 16, 0
    )
    t1 = time.perf_counter()
    Drafter(cfg)
    init_s = time.perf_counter() - t1  # the host, as training drew it before
    counters = torch._dynamo.utils.counters
    hits = {
        f"{group}.{name}": n
        for group in ("inductor", "aot_autograd")
        for name, n in counters[group].items()
        if "cache" in name
    }
    print(
        json.dumps(
            {
                "process_age_s": marks,
                "warm_shapes_s": round(warm_s, 2),
                "drafter_host_init_s": round(init_s, 2),
                "shapes": records,
                **setup,
                "cache_counters": hits,
                "compile_times": torch._dynamo.utils.compile_times(repr="str"),
            }
        )
    )
