"""lm-evaluation-harness against `mirror-sd serve`, as a user scores a deployed model: its `local-completions` model
(echo + logprobs, one request per choice) on a small multiple-choice task of local data (capitals and sums, 40
questions, 160 log-likelihoods), for each bundle given, with 4 requests at once (the batching engine); the first
bundle also one at a time, and on a generative task (20 sums, greedy, stop strings, the last number of the answer
taken) through `local-completions` and `local-chat-completions`. Checks that every log-likelihood the harness read equals the library's own (prompt_logprobs
summed over the continuation's tokens), that 1 and 4 concurrent requests read the same figures, and that every
generated answer equals the library's greedy answer to the same prompt and stops.

lm-eval lives in an environment of its own (it pulls datasets and transformers):
    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 "lm_eval[api]" transformers
    .venv/bin/python lab/scripts/lm_eval_server.py /tmp/lmeval/bin/lm_eval build/bundles/smollm2-feature \
        build/bundles/smollm2-feature-int8 build/bundles/smollm2-feature-int4 --out results/lm-eval-server.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from mirror_sd.runtime.pipeline import Pipeline

CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
            "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
            "Poland": "Warsaw", "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna", "Ireland": "Dublin",
            "Russia": "Moscow", "China": "Beijing", "India": "New Delhi", "Mexico": "Mexico City", "Chile": "Santiago"}
SUMS_TASK = """task: mirror_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: What is {{{{a}}}} plus {{{{b}}}}?\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0
filter_list:
  - name: number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
TASK = """task: mirror_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(folder: Path) -> None:
    rng = random.Random(0)
    rows, cities = [], list(CAPITALS.values())
    for country, city in CAPITALS.items():
        choices = rng.sample([c for c in cities if c != city], 3) + [city]
        rng.shuffle(choices)
        rows.append({"question": f"The capital of {country} is", "choices": choices, "answer": choices.index(city)})
    for _ in range(20):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        choices = sorted({a + b, a + b + 1, a + b - 1, a + b + 2})
        rows.append({"question": f"{a} plus {b} equals", "choices": [str(c) for c in choices],
                     "answer": choices.index(a + b)})
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tasks").mkdir()
    (folder / "tasks" / "mirror_facts.yaml").write_text(TASK.format(data=data))
    sums = folder / "sums.jsonl"
    pairs = [(rng.randint(2, 40), rng.randint(2, 40)) for _ in range(20)]
    sums.write_text("".join(json.dumps({"a": a, "b": b, "answer": str(a + b)}) + "\n" for a, b in pairs))
    (folder / "tasks" / "mirror_sums.yaml").write_text(SUMS_TASK.format(data=sums))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(bundle: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen([".venv/bin/mirror-sd", "serve", bundle, "--port", str(port), "--model-name", "m"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"the server on {bundle} did not come up")


def run_lm_eval(lm_eval: str, folder: Path, out: Path, task: str, model: str, model_args: str,
                extra: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    subprocess.run([lm_eval, "--model", model, "--model_args", model_args, "--tasks", task, "--include_path",
                    str(folder / "tasks"), "--output_path", str(out), "--log_samples", *extra], check=True,
                   capture_output=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    results = json.loads(Path(glob.glob(f"{out}/*/results_*.json")[0]).read_text())["results"][task]
    return results, [json.loads(line) for line in open(glob.glob(f"{out}/*/samples_*.jsonl")[0])]


def evaluate(lm_eval: str, folder: Path, bundle: str, port: int, concurrent: int, name: str) -> dict:
    started = time.perf_counter()
    results, samples = run_lm_eval(lm_eval, folder, folder / name, "mirror_facts", "local-completions",
                                   f"model=m,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend="
                                   f"huggingface,tokenizer={bundle},num_concurrent={concurrent},max_retries=1")
    wall = time.perf_counter() - started
    logliks = {(s["doc_id"], i): float(r[0]) for s in samples for i, r in enumerate(s["filtered_resps"])}
    docs = {s["doc_id"]: s["doc"] for s in samples}
    return {"acc": results["acc,none"], "acc_norm": results["acc_norm,none"], "wall_s": wall,
            "logliks": logliks, "docs": docs}


def generate(lm_eval: str, folder: Path, bundle: str, port: int) -> dict:
    """The sums task through the completions and the chat endpoints (4 requests at once), each answer against the
    library's greedy answer to the same prompt under the same stops and length."""
    out = {}
    for model, path, extra in (("local-completions", "completions", ()),
                               ("local-chat-completions", "chat/completions", ("--apply_chat_template",))):
        args = f"model=m,base_url=http://127.0.0.1:{port}/v1/{path},num_concurrent=4,max_retries=1"
        if model == "local-completions":
            args += f",tokenizer_backend=huggingface,tokenizer={bundle}"
        results, samples = run_lm_eval(lm_eval, folder, folder / f"sums-{path.replace('/', '-')}", "mirror_sums",
                                       model, args, extra)
        out[model] = {"exact_match": results["exact_match,number"], "samples": samples}
    return out


def library_answers(bundle: str, runs: dict) -> dict:
    """How many of each run's answers equal the library's (greedy, the request's stops and length)."""
    pipe = Pipeline.load(bundle, huge_pages=False)
    counts = {}
    for model, run in runs.items():
        equal = 0
        for s in run["samples"]:
            args = s["arguments"]["gen_args_0"]
            prompt, kwargs = args["arg_0"], args["arg_1"]
            if isinstance(prompt, list):  # the chat model logs its messages as JSON text in a list
                prompt = json.loads(prompt[0])
            # the harness adds the EOS token's text to the stops: a special token, never in an answer's text
            result = pipe.generate(prompt, mode="ar", temperature=0.0, max_new_tokens=kwargs["max_gen_toks"],
                                   stop=kwargs["until"])
            equal += result.text == s["resps"][0][0]
        counts[model] = {"exact_match": run["exact_match"], "answers": len(run["samples"]),
                         "equal_to_library": equal}
    pipe.close()
    return counts


def library_logliks(bundle: str, docs: dict) -> dict:
    """Each choice's log-likelihood from the library: the prompt_logprobs of question + " " + choice, summed over
    the tokens after the question's (as the harness splits them: the context encoded alone)."""
    pipe = Pipeline.load(bundle, huge_pages=False)
    out = {}
    for doc_id, doc in docs.items():
        context = pipe.codec.encode(doc["question"])
        for i, choice in enumerate(doc["choices"]):
            whole = pipe.codec.encode(f"{doc['question']} {choice}")
            result = pipe.generate(whole, mode="ar", max_new_tokens=1, prompt_logprobs=0)
            out[(doc_id, i)] = sum(s.logprob for s in result.prompt_logprobs[len(context):])
    pipe.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lm_eval", help="the lm_eval executable of an environment that has it")
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    doc: dict = {"script": "lab/scripts/lm_eval_server.py", "task": "mirror_facts (40 questions, 4 choices each)",
                 "wall_s": "the lm_eval command's, its own start (about 10 s here) included", "bundles": {}}
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_task(folder)
        for bundle in args.bundles:
            port = free_port()
            server = serve(bundle, port)
            try:
                runs = {"concurrent_4": evaluate(args.lm_eval, folder, bundle, port, 4, Path(bundle).name + "-4")}
                if first is None:
                    runs["serial"] = evaluate(args.lm_eval, folder, bundle, port, 1, Path(bundle).name + "-1")
                    generated = generate(args.lm_eval, folder, bundle, port)
            finally:
                server.terminate()
                server.wait(30)
            run = runs["concurrent_4"]
            mine = library_logliks(bundle, run["docs"])
            entry = {"acc": run["acc"], "acc_norm": run["acc_norm"], "wall_s_4_concurrent": run["wall_s"],
                     "requests": len(run["logliks"]),
                     "max_abs_delta_vs_library": max(abs(v - mine[k]) for k, v in run["logliks"].items())}
            if "serial" in runs:
                entry["wall_s_serial"] = runs["serial"]["wall_s"]
                entry["max_abs_delta_serial_vs_4_concurrent"] = max(
                    abs(v - runs["serial"]["logliks"][k]) for k, v in run["logliks"].items())
                entry["generate_until"] = library_answers(bundle, generated)
                first = run["logliks"]
            else:
                deltas = [abs(v - first[k]) for k, v in run["logliks"].items()]
                entry["mean_abs_delta_vs_first_bundle"] = sum(deltas) / len(deltas)
            doc["bundles"][bundle] = entry
            print(bundle, entry, flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
