"""transformers generate on the CPU, the default (dynamic) KV cache against a static one, at the shape the
self-written pools are answered at (models/self_queries.py: a batch of left-padded conversations of a few hundred
tokens): 32 rows of 300 random tokens (half of them with 100 padding), 96 greedy tokens each, alternating.
A profile of models.task_queries at 64 conversations (py-spy, 30 s) had a quarter of the samples in DynamicLayer.update,
which concatenates every layer's whole cache at every step. Prints each run's seconds.

    python lab/scripts/static_cache_ab.py [rounds]
"""
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("build/models/smollm2-135m-instruct", dtype=torch.float32).eval()
torch.manual_seed(0)
ids = torch.randint(100, 20000, (32, 300))
mask = torch.ones_like(ids)
mask[:16, :100] = 0
for impl in ["dynamic", "static"] * int(sys.argv[1] if len(sys.argv) > 1 else 2):
    kw = {} if impl == "dynamic" else {"cache_implementation": "static"}
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=96, min_new_tokens=96,
                             do_sample=False, pad_token_id=0, **kw)
    print(impl, round(time.perf_counter() - t, 2), tuple(out.shape), flush=True)
