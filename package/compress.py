"""Draft weight compression with NNCF (data-free): INT8 symmetric / asymmetric per channel, INT4 symmetric per group.

The target verifies every draft token, so a compressed draft changes only how many tokens a step accepts, never
the output. INT4 keeps NPU-friendly symmetric weights everywhere: the layers NNCF leaves out of 4 bits (the
embedding and the output head) fall back to INT8 *symmetric* instead of its default asymmetric.
fp16 is not NNCF's: the IR is saved with fp16 weights (`ov.save_model(compress_to_fp16=True)`).
"""

from __future__ import annotations

import contextlib
import io
import logging

from mirror_sd.errors import PackageError, first_line

DEFAULT_GROUP_SIZE = 64  # divides the hidden sizes of every draft here (64, 256); NPUs take 64 or 128


def compress_weights(model, weights: str, group_size: int = DEFAULT_GROUP_SIZE):
    """`model` (ov.Model) with its weights compressed as `weights` says (fp32 / fp16: unchanged here)."""
    if weights in ("fp32", "fp16"):
        return model
    import nncf
    from nncf.parameters import BackupMode

    nncf.set_log_level(logging.ERROR)
    if weights == "int8_sym":
        options = dict(mode=nncf.CompressWeightsMode.INT8_SYM)
    elif weights == "int8_asym":
        options = dict(mode=nncf.CompressWeightsMode.INT8_ASYM)
    elif weights == "int4_sym":
        options = dict(mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group_size, ratio=1.0,
                       backup_mode=BackupMode.INT8_SYM)
    else:
        raise PackageError(f"unknown weights {weights!r}")
    quiet = io.StringIO()  # NNCF draws a progress bar and a table on stdout
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            return nncf.compress_weights(model, **options)
    except Exception as e:  # NNCF raises its own and plain errors for shapes it cannot group
        grouped = f" (group size {group_size})" if weights == "int4_sym" else ""
        raise PackageError(f"NNCF could not compress the draft to {weights}{grouped}: {first_line(e)}") from None
