"""OpenVINO GenAI's GenerationConfig read as this project's options, so that GenAI's samples run with their config.

GenAI's samples make `openvino_genai.GenerationConfig()`, set fields on it and pass it to generate. Read here by its
attributes (no import of openvino_genai: the runtime does not need it): every field set away from GenAI's own default
becomes the option of the same meaning, and three are always taken because GenAI's defaults differ from this
project's and decide the text: `do_sample` (greedy unless set), `apply_chat_template` (on) and, sampling, `rng_seed`
(GenAI's 0 is a seed: its samples repeat call after call). As in GenAI, a max_new_tokens set wins over max_length. A
field set that nothing here does (group beam search, tree search, echo, adapters, parsers) is a BadInputError naming
it.
"""

from __future__ import annotations

from typing import Any

from mirror_sd.errors import BadInputError

# GenAI's field -> this project's option (GenerationConfig's name or one of its keywords)
SAME_MEANING = {
    "max_new_tokens": "max_new_tokens", "max_length": "max_length", "ignore_eos": "ignore_eos",
    "min_new_tokens": "min_new_tokens", "stop_strings": "stop_strings", "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output", "num_beams": "num_beams",
    "length_penalty": "length_penalty", "num_return_sequences": "num_return_sequences",
    "no_repeat_ngram_size": "no_repeat_ngram_size", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "rng_seed": "rng_seed",
    "assistant_confidence_threshold": "assistant_confidence_threshold", "num_assistant_tokens": "num_assistant_tokens",
    "max_ngram_size": "max_ngram_size", "logprobs": "logprobs",
}
ALWAYS = ("do_sample", "apply_chat_template")
NOT_HERE = ("diversity_penalty", "num_beam_groups", "echo", "adapters", "parsers", "branching_factor", "tree_depth",
            "pruning_ratio", "relevance_weight", "return_omni_outputs")
GRAMMARS = ("json_schema", "regex", "grammar")  # StructuredOutputConfig's that this project holds a text to
EARLY_STOPPING = {"HEURISTIC": "heuristic", "EARLY": "early", "NEVER": "never"}


def is_genai_config(config: object) -> bool:
    return type(config).__name__ == "GenerationConfig" and type(config).__module__.startswith("openvino_genai")


def genai_options(config: Any) -> dict[str, Any]:
    """The options `config` (an openvino_genai.GenerationConfig) sets, by this project's names."""
    default = type(config)()
    changed = {name for name in (*SAME_MEANING, *NOT_HERE, "eos_token_id", "stop_criteria",
                                 "structured_output_config")
               if hasattr(config, name) and getattr(config, name) != getattr(default, name)}
    refused = sorted(changed & set(NOT_HERE))
    if refused:
        raise BadInputError(f"OpenVINO GenAI's {refused[0]} has no counterpart here: leave it at its default",
                            option=refused[0])
    out = {SAME_MEANING[name]: getattr(config, name) for name in sorted(changed & set(SAME_MEANING))}
    out.update({name: getattr(config, name) for name in ALWAYS if hasattr(config, name)})
    if out.get("do_sample"):
        out["rng_seed"] = config.rng_seed
    if "max_new_tokens" in out:
        out.pop("max_length", None)
    if "eos_token_id" in changed:
        out["eos_token_id"] = config.eos_token_id
    if "stop_criteria" in changed:
        out["early_stopping"] = EARLY_STOPPING[config.stop_criteria.name]
    if "structured_output_config" in changed:
        out.update(_grammar(config.structured_output_config))
    return out


def _grammar(structured: Any) -> dict[str, Any]:
    """A StructuredOutputConfig's one JSON schema, regular expression or grammar, as the option of that name."""
    given = {name: getattr(structured, name) for name in GRAMMARS if getattr(structured, name, None)}
    other = [name for name in ("structural_tags_config", "compound_grammar") if getattr(structured, name, None)]
    if other or len(given) != 1:
        raise BadInputError("OpenVINO GenAI's structured_output_config is taken with one of json_schema, regex or "
                            "grammar set", option="structured_output_config")
    return given
