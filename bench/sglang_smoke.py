"""SGLang's DFLASH worker on the GPU box, before eval_sglang relies on it: a random Qwen3-shaped
target made here and an untrained drafter written by our `save_drafter`, driven through
`sglang.Engine` exactly as `dflash.eval.sglang_serve` drives it. It prints what `generate`
returns (keys and meta_info, alone and batched, greedy and at temperature 1 with a seed), the
server arguments SGLang resolved, whether it verifies sampled requests by speculative sampling,
and our `counts` of each answer. Random weights: the acceptance itself means nothing here.

    PYTHONPATH=/tmp/sglang-site:$PWD python3 bench/sglang_smoke.py OUT_DIR [ATTENTION_BACKEND]
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path


def make_models(folder: Path) -> tuple[Path, Path]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.model.drafter import Drafter, DrafterConfig, save_drafter

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    target = folder / "target"
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(target)
    drafter_config = DrafterConfig.for_target(config, num_layers=1, block_size=16,
                                              mask_token_id=config.vocab_size - 1)  # fmt: skip
    drafter = folder / "drafter"
    save_drafter(Drafter(drafter_config), drafter)
    return target, drafter


def main(out: Path, backend: str | None) -> None:
    from dflash.eval.serve_loop import Sampling
    from dflash.eval.sglang_serve import RESOLVED, counts, engine_args, sampling_params

    report: dict = {"backend": backend}
    target, drafter = make_models(out)
    request = {"target": str(target), "drafter": str(drafter), "block_size": 16,
               "dtype": "bfloat16", "context_length": 2048, "mem_fraction_static": 0.5,
               "max_new_tokens": 64, "eos_ids": [0]}  # fmt: skip
    args = engine_args(request) | {"skip_tokenizer_init": True}
    if backend:
        args |= {"attention_backend": backend, "speculative_draft_attention_backend": backend}
    report["engine_args"] = args
    import sglang

    report["sglang"] = sglang.__version__
    started = time.perf_counter()
    engine = sglang.Engine(**args)
    report["startup_s"] = round(time.perf_counter() - started, 1)
    report["server_args"] = {k: str(getattr(engine.server_args, k, None)) for k in RESOLVED}
    prompt = list(range(5, 69))
    greedy = sampling_params(Sampling(0.0, 64, (0,)))
    steps = {
        "greedy_alone": lambda: engine.generate(input_ids=prompt, sampling_params=greedy),
        "greedy_batch_of_one": lambda: engine.generate(input_ids=[prompt], sampling_params=[greedy]),
        "greedy_batched": lambda: engine.generate(
            input_ids=[prompt, prompt[:32]], sampling_params=[greedy] * 2
        ),
        "t1_seeded": lambda: engine.generate(
            input_ids=[prompt, prompt], sampling_params=[
                {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 64,
                 "stop_token_ids": [0], "sampling_seed": seed} for seed in (1, 2)],
        ),
    }  # fmt: skip
    for name, call in steps.items():
        try:
            t0 = time.perf_counter()
            result = call()
            outs = result if isinstance(result, list) else [result]
            report[name] = {
                "seconds": round(time.perf_counter() - t0, 3),
                "keys": sorted(outs[0]),
                "meta_info": [o.get("meta_info") for o in outs],
                "n_output_ids": [len(o.get("output_ids") or []) for o in outs],
                "counts": [counts(o["meta_info"]) for o in outs],
            }
        except Exception:
            report[name] = {"error": traceback.format_exc()[-3000:]}
        print(name, json.dumps(report[name], default=str)[:1500], flush=True)
    try:
        from sglang.srt.speculative.dflash_utils import is_dflash_sampling_verify_available

        report["sampling_verify"] = bool(is_dflash_sampling_verify_available())
    except Exception:
        report["sampling_verify"] = traceback.format_exc()[-1000:]
    engine.shutdown()
    (out / "sglang-smoke.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: report[k] for k in ("sglang", "startup_s", "server_args",
                                             "sampling_verify")}, default=str))  # fmt: skip


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out, sys.argv[2] if len(sys.argv) > 2 else None)
