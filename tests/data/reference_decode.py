"""Decode with the DFlash authors' reference package (`dflash` 0.1.0 on PyPI), never ours.

tests/test_reference_client.py runs this file in a subprocess whose PYTHONPATH is the folder the
reference was installed into (`pip install --no-deps --target`), so `import dflash` is theirs.
Usage: reference_decode.py JOB.json OUT.json. The job names the target, our exported drafter, the
prompts (token ids), max_new_tokens and the stop tokens; the output holds, per prompt, the tokens
and the reference's acceptance lengths (its own way of counting), for two drafters:

- "reference_class": our weights in the reference's `DFlashDraftModel`;
- "our_class": our export's own modeling file (`AutoModel`, trust_remote_code), driven by the
  reference's `dflash_generate` on the first `our_class_prompts` prompts: the drop-in check from
  the other side.
"""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM

import dflash.model as reference  # the reference's, from PYTHONPATH: not ours


def decode(drafter, target, job, prompts: int | None = None) -> list[dict]:
    out = []
    for prompt in job["prompts"][:prompts]:
        stats = reference.dflash_generate(
            drafter.eval(),
            target,
            torch.tensor([prompt]),
            max_new_tokens=job["max_new_tokens"],
            stop_token_ids=job["stop_token_ids"],
            temperature=0.0,
            return_stats=True,
        )
        tokens = stats.output_ids[0, len(prompt) :].tolist()
        out.append({"tokens": tokens, "acceptance_lengths": stats.acceptance_lengths})
    return out


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    # return_stats times rounds with torch.cuda.synchronize, which a CPU-only torch refuses
    reference._cuda_time = time.perf_counter
    target = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
    theirs, info = reference.DFlashDraftModel.from_pretrained(
        job["drafter"], dtype=torch.float32, output_loading_info=True
    )
    ours = AutoModel.from_pretrained(job["drafter"], dtype=torch.float32, trust_remote_code=True)
    result = {
        "module": reference.__file__,
        "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
        "our_class_name": f"{type(ours).__module__}.{type(ours).__name__}",
        "reference_class": decode(theirs, target, job),
        "our_class": decode(ours, target, job, job["our_class_prompts"]),
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
