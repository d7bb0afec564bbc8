"""Prompt lookup: a draft window copied from the text itself, as OpenVINO GenAI's prompt-lookup decoding and
transformers' `prompt_lookup_num_tokens` propose it.

Summaries, answers over a passage, code edits and multi-turn chats repeat spans of their prompt; where the last few
committed tokens occurred before, the tokens that followed them then are a window that costs no draft forward. The
target verifies it like any other window, so output never depends on it.

Plain arithmetic on token ids (numpy); the scheduler asks before each step of lookup and of greedy sd/mirror, the
batching engine for its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lookup(context: Sequence[int] | np.ndarray, max_ngram: int, max_tokens: int, min_ngram: int = 2
           ) -> tuple[int, ...]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of the context's last n tokens, for the
    longest n in [min_ngram, max_ngram] that occurred before; () where none did.

    The latest occurrence is taken: in a generation that repeats itself, the most recent copy is the one it is
    continuing. A 1-token match is not tried by default: it proposes windows of common tokens the target mostly
    rejects, and a rejected window still costs a wider verification.
    """
    ids = np.asarray(context, np.int64)
    n_ctx = ids.size
    if max_tokens < 1:
        return ()
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        tail = ids[n_ctx - n:]
        # starts of every earlier n-gram equal to the tail (the tail itself excluded: it has no continuation)
        starts = np.flatnonzero(ids[:n_ctx - n] == tail[0])
        starts = starts[starts + n < n_ctx]
        for j in range(1, n):
            if starts.size == 0:
                break
            starts = starts[ids[starts + j] == tail[j]]
        if starts.size:
            begin = int(starts[-1]) + n
            return tuple(int(t) for t in ids[begin:begin + max_tokens])
    return ()


# The schedules of a copied window's length, as transformers' `num_assistant_tokens_schedule` names them for its
# assistant: "constant" copies up to prompt_lookup_num_tokens every time; "heuristic" starts there, grows by 2 after
# a copied window the target accepted whole and shrinks by 1 (to 1 at least) after one it cut short.
COPY_SCHEDULES = ("constant", "heuristic")
# The heuristic's ceiling on the CPU. Each copied token widens the verification a little, so a long window pays
# only while the copy goes on being accepted; summaries and answers over a passage copy runs of 10-20 tokens
# (docs/design.md: The copy gate).
MAX_COPY = 16


def next_copy_length(length: int, proposed: int, accepted: int, schedule: str, base: int, ceiling: int) -> int:
    """The copied window's length for the next lookup, after a copied window of `proposed` tokens of which the
    target accepted `accepted`. A window shorter than `length` (the copy reached the text's end, or the generation's)
    that was accepted whole says nothing about a longer one: the length stays."""
    if schedule == "constant":
        return base
    if accepted == proposed:
        return min(length + 2, ceiling) if proposed >= length else length
    return max(1, length - 1)
