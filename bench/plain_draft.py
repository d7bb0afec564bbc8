"""The streaming draft in its plain form: an ordinary LlamaForCausalLM over the target's full vocabulary.

The external baselines (transformers assisted generation, OpenVINO GenAI speculative decoding) accept only a
draft that is an ordinary causal LM with the target's vocabulary, one token per forward. So what they compare
against the project's Mirror-SD is *the same draft network without its two tricks*:

- same 4 decoder layers, same weights, same main-stream prediction at every position (checked: `agreement`);
- the reduced output vocabulary is spread back over all 49152 target ids: embedding row t is the draft's row for
  t, or its shared "other" row for an id outside the draft vocabulary (exactly how the streaming draft embeds it);
  LM-head row t is the draft's row for t (the draft ties embedding and head) -- the plain form's head is
  therefore 49152 x 256 instead of 6028 x 256, the cost the reduced vocabulary avoids;
- the 3 stream heads are dropped: one token per forward, as `draft_streaming=False` runs it in the runtime.

Out-of-vocabulary head rows. The head has no bias, so a row cannot say "never". A zero row gives logit 0, which
beats the whole draft vocabulary wherever every in-vocabulary logit is negative (`zero_row_wins` measures how
often). Instead every out-of-vocabulary row is a copy of one in-vocabulary row, the one whose logit is lowest on
average over calibration prompts: its logit is then exactly that token's, never above the best in-vocabulary
logit, so greedy never picks an out-of-vocabulary id unless that least likely token itself is the argmax (a
tie; `oov_wins` counts it). Under sampling the ~43k copies carry a little probability mass the streaming draft
gives none (`oov_mass`); that changes only the draft's proposals, never the target's output distribution.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mirror_sd.errors import BadInputError
from mirror_sd.outputs import move_into_place

MARKER = "plain_draft.json"  # written last: a directory without it is an unfinished conversion
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class PlainDraftInfo:
    source: str  # the streaming draft directory
    target_vocab_size: int
    draft_vocab_size: int  # the streaming draft's output vocabulary
    oov_row_token: int  # target id whose head row every out-of-vocabulary id copies
    calibration_positions: int


def _llama_from(streaming, vocab_size: int):
    """A LlamaForCausalLM with the streaming draft's body and the scattered full-vocabulary embedding and head."""
    from transformers import LlamaForCausalLM

    config = streaming.lm.config.__class__.from_dict(streaming.lm.config.to_dict())
    config.vocab_size = vocab_size
    config.tie_word_embeddings = False  # embedding ("other" row for OOV ids) and head (copied row) now differ
    config.architectures = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(config)
    state = {k: v for k, v in streaming.lm.state_dict().items() if not k.startswith(("model.embed_tokens", "lm_head"))}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"model.embed_tokens.weight", "lm_head.weight"}:
        raise BadInputError(f"streaming draft body does not fit a Llama: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    return plain.eval()


@torch.no_grad()
def _least_likely_token(streaming, calibration: list[list[int]]) -> tuple[int, int]:
    """(draft index of the in-vocabulary token with the lowest mean logit over the calibration positions, positions)."""
    total, positions = None, 0
    for ids in calibration:
        logits = streaming.reference(torch.tensor([ids]))["logits"][0]  # [T, Vd]
        total = logits.sum(0) if total is None else total + logits.sum(0)
        positions += logits.shape[0]
    return int(total.argmin()), positions


@torch.no_grad()
def plain_model(streaming, calibration: list[list[int]]):
    """(LlamaForCausalLM over the full vocabulary, PlainDraftInfo) from a loaded
    models.streaming_draft.StreamingDraft."""
    cfg = streaming.config
    if not calibration or not all(calibration):
        raise BadInputError("the plain-draft conversion needs at least one non-empty calibration sequence")
    plain = _llama_from(streaming, cfg.target_vocab_size)
    rows = streaming.lm.model.embed_tokens.weight  # [Vd + 1, H]: draft rows then the shared "other" row
    plain.model.embed_tokens.weight.copy_(rows[streaming.id_map])  # OOV ids -> the "other" row, as the draft embeds
    worst, positions = _least_likely_token(streaming, calibration)
    head = rows[worst].expand(cfg.target_vocab_size, -1).clone()
    head[streaming.vocab_ids] = rows[: cfg.draft_vocab]
    plain.lm_head.weight.copy_(head)
    info = PlainDraftInfo("", cfg.target_vocab_size, cfg.draft_vocab, int(cfg.vocab_ids[worst]), positions)
    return plain, info


def calibration_ids(tokenizer, n: int = 16) -> list[list[int]]:
    """Prompt ids of `n` held-out project prompts through the target's chat template (no generation needed)."""
    from mirror_sd.models.training import prompts

    out = []
    for prompt in prompts.build(n, held_out=True):
        messages = [m for m in prompt.messages if m["content"]]  # multi-turn prompts carry an empty assistant turn
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)))
    return out


def is_converted(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def convert(streaming_dir: str | Path, tokenizer_dir: str | Path, out_dir: str | Path,
            calibration: list[list[int]] | None = None) -> Path:
    """Write the plain form of the streaming draft in `streaming_dir` as an HF directory `out_dir` with the
    tokenizer files of `tokenizer_dir` (the target's). Reuses `out_dir` when its marker is there. Built in a
    sibling temporary directory and moved into place, so a failure leaves nothing half-written."""
    from transformers import AutoTokenizer

    from mirror_sd.models.streaming_draft import StreamingDraft

    out = Path(out_dir)
    if is_converted(out):
        return out
    src = Path(streaming_dir)
    if not StreamingDraft.is_streaming_draft(src):
        raise BadInputError(f"{src} is not a streaming draft directory (no streaming_draft.json)")
    try:
        streaming = StreamingDraft.load(src)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot load the streaming draft {src} or the tokenizer {tokenizer_dir}: {e}") from None
    if len(tokenizer) != streaming.config.target_vocab_size:
        raise BadInputError(f"tokenizer {tokenizer_dir} has {len(tokenizer)} tokens, the draft was built for "
                            f"{streaming.config.target_vocab_size}")
    plain, info = plain_model(streaming, calibration or calibration_ids(tokenizer))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.generation_config.eos_token_id = streaming.config.eos_token_id
    plain.generation_config.bos_token_id = streaming.config.bos_token_id
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name in TOKENIZER_FILES:  # the target's own files win over anything save_pretrained rewrote
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, tmp / name)
    (tmp / MARKER).write_text(json.dumps({**asdict(info), "source": str(src)}, indent=1) + "\n")
    move_into_place(tmp, out)
    return out


@torch.no_grad()
def agreement(streaming, plain, sequences: list[list[int]]) -> dict[str, float]:
    """Teacher-forced on `sequences`: how often the plain form's greedy next token equals the streaming draft's
    main stream's (mapped to target ids), how often an out-of-vocabulary id wins in the plain form, how often a
    zero head row would have won (best in-vocabulary logit < 0), and the mean probability mass the plain form puts
    on out-of-vocabulary ids at T=1."""
    in_vocab = torch.zeros(streaming.config.target_vocab_size, dtype=torch.bool)
    in_vocab[streaming.vocab_ids] = True
    same = oov = zero_wins = positions = 0
    oov_mass = 0.0
    for ids in sequences:
        x = torch.tensor([ids])
        stream_next = streaming.vocab_ids[streaming.reference(x)["logits"][0].argmax(-1)]  # [T] target ids
        logits = plain(x).logits[0]  # [T, V]
        plain_next = logits.argmax(-1)
        same += int((plain_next == stream_next).sum())
        oov += int((~in_vocab[plain_next]).sum())
        zero_wins += int((logits[:, in_vocab].max(-1).values < 0).sum())
        oov_mass += float(logits.softmax(-1)[:, ~in_vocab].sum(-1).sum())
        positions += len(ids)
    return {"positions": positions, "same_next_token": same / positions, "oov_wins": oov / positions,
            "zero_row_wins": zero_wins / positions, "oov_mass": oov_mass / positions}
