"""The vectorized checks of a parsed block or row group: which rows are accepted outright, as a Batch.

    ok, batch = accepted_columns(table)     # None where a column's type is one the checks do not cover

The checks only have to be sufficient for acceptance, never exact: a row they do not accept outright goes to
`reader.parse_record` (or `parse_line`), whose verdict stands. tests/calibrate/test_batches.py holds the two equal.
"""

from __future__ import annotations

import numpy as np

from qgate.calibrate.batch import Batch, ranges
from qgate.calibrate.reader import MAX_LABEL_CHARS, ROLES
from qgate.chat import TOOL_FIELDS

# Python's whitespace (str.isspace, what str.strip() removes), as an RE2 class; the tests check it code point by point
PY_SPACE = r"\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}"
MAX_DEPTH = 64  # a field nested deeper may be one orjson refuses (1,024 levels): such a block goes line by line


def nonfinite(arr) -> bool:
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_floating(t):
        return not pc.all(pc.is_finite(arr)).as_py() if arr.null_count < len(arr) else False
    if pa.types.is_struct(t):
        return any(nonfinite(arr.field(i)) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return nonfinite(arr.flatten())
    return False


def depth(t) -> int:
    import pyarrow as pa

    if pa.types.is_struct(t):
        return 1 + max((depth(t.field(i).type) for i in range(t.num_fields)), default=0)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return 1 + depth(t.value_type)
    return 0


def _string_or_null(col) -> bool:
    import pyarrow as pa

    return col is None or pa.types.is_string(col.type) or pa.types.is_null(col.type)


def _number_or_null(col) -> bool:
    import pyarrow as pa

    return col is None or pa.types.is_floating(col.type) or pa.types.is_integer(col.type) or pa.types.is_null(col.type)


_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000}


def _epoch_seconds(col):
    """A Parquet timestamp column with a time zone as float epoch seconds (what datetime.timestamp() gives for each
    value, exactly: integer microseconds at most, divided once). A naive one is local time to `parse_record`: it and
    other types stay as they are (and go the row path unless numeric)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if col is None or not pa.types.is_timestamp(col.type) or col.type.tz is None or col.type.unit not in _PER_SECOND:
        return col
    return pc.divide(col.cast(pa.int64()).cast(pa.float64(), safe=False), float(_PER_SECOND[col.type.unit]))


def accepted_columns(table) -> tuple[np.ndarray, Batch] | None:
    """(rows accepted outright, the batch of those rows) from a parsed block; None when a column's type is one the
    vectorized checks do not cover."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = set(table.column_names)
    col = lambda name: table.column(name).combine_chunks() if name in names else None  # noqa: E731
    messages, prompt = col("messages"), col("prompt")
    route, tenant, ts, latency = col("route"), col("tenant"), _epoch_seconds(col("ts")), col("latency_ms")
    if not all(_string_or_null(c) for c in (prompt, route, tenant)) or not all(
        _number_or_null(c) for c in (ts, latency)
    ):
        return None
    n = table.num_rows
    if messages is not None and not pa.types.is_null(messages.type):
        t = messages.type
        if not (
            pa.types.is_list(t)
            and pa.types.is_struct(t.value_type)
            and all(
                t.value_type.get_field_index(k) >= 0 and pa.types.is_string(t.value_type.field(k).type)
                for k in ("role", "content")
            )
        ):
            return None
        has_msgs = messages.is_valid().to_numpy(zero_copy_only=False)
    else:
        messages, has_msgs = None, np.zeros(n, dtype=bool)
    has_prompt = (
        prompt.is_valid().to_numpy(zero_copy_only=False)
        if prompt is not None and not pa.types.is_null(prompt.type)
        else np.zeros(n, bool)
    )
    use_prompt = ~has_msgs & has_prompt
    ok = has_msgs | use_prompt
    if (tools := col("tools")) is not None:
        ok &= ~tools.is_valid().to_numpy(zero_copy_only=False)

    # turns: each row's messages, or its prompt as one user turn
    if messages is not None:
        msg_off = messages.offsets.to_numpy().astype(np.int64)
        flat = messages.values
        flat_valid = flat.is_valid().to_numpy(zero_copy_only=False)
        m_role, m_content = flat.field("role"), flat.field("content")
        m_ok = (
            flat_valid
            & m_role.is_valid().to_numpy(zero_copy_only=False)
            & m_content.is_valid().to_numpy(zero_copy_only=False)
        )
        m_ok &= pc.is_in(m_role, value_set=pa.array(ROLES)).fill_null(False).to_numpy(zero_copy_only=False)
        # tool use (a tool turn, a tool field, the legacy function_call) is parse_record's to read
        m_ok &= ~pc.equal(m_role, "tool").fill_null(False).to_numpy(zero_copy_only=False)
        for k in (*TOOL_FIELDS, "function_call"):
            if flat.type.get_field_index(k) >= 0:
                m_ok &= ~flat.field(k).is_valid().to_numpy(zero_copy_only=False)
        lo, hi = msg_off[:-1], msg_off[1:]
        per_row_len = np.where(has_msgs, hi - lo, 0)
        ok &= ~has_msgs | (per_row_len > 0)
        bad_before = (
            np.concatenate(([0], np.cumsum(~m_ok[msg_off[0] : msg_off[-1]]))) if len(flat) else np.zeros(1, np.int64)
        )
        base = msg_off[0]
        ok &= ~has_msgs | (bad_before[hi - base] == bad_before[lo - base])
        # a NUL in any turn rejects the record, kept turn or not
        m_nul = (
            pc.match_substring(m_content, "\x00").fill_null(False).to_numpy(zero_copy_only=False)
            if len(flat)
            else np.zeros(0, bool)
        )
        nul_before = np.concatenate(([0], np.cumsum(m_nul[base : msg_off[-1]])))
        ok &= ~has_msgs | (nul_before[hi - base] == nul_before[lo - base])
        is_user = pc.equal(m_role, "user").fill_null(False).to_numpy(zero_copy_only=False)[: msg_off[-1]]
        user_pos = np.where(is_user, np.arange(len(is_user), dtype=np.int64), -1)
        last_user = np.full(n, -1, dtype=np.int64)
        nz = has_msgs & (per_row_len > 0)
        if nz.any():  # segments [lo, next lo) of the non-empty rows are exactly their own turns
            last_user[nz] = np.maximum.reduceat(user_pos, lo[nz])
        ok &= ~has_msgs | (last_user >= 0)
    # the turns kept: a row's messages up to its last user turn, or its prompt
    rows = np.flatnonzero(ok)
    if messages is not None:
        keep_lo = np.where(use_prompt, 0, msg_off[:-1])
        keep_n = np.where(use_prompt, 1, last_user - msg_off[:-1] + 1)
    else:
        keep_lo, keep_n = np.zeros(n, np.int64), np.ones(n, np.int64)
    keep_n = keep_n[rows]
    starts = np.concatenate(([0], np.cumsum(keep_n))).astype(np.int64)
    prompt_rows = use_prompt[rows]
    if messages is not None and (~prompt_rows).any():
        msg_rows = rows[~prompt_rows]
        turn_idx = ranges(keep_lo[msg_rows], keep_n[~prompt_rows])
    else:
        turn_idx = np.zeros(0, np.int64)
    # gather contents and roles in row order: prompt rows from `prompt`, message rows from the flattened messages
    pieces, roles = [], []
    if prompt_rows.all():
        contents = prompt.take(pa.array(rows)) if len(rows) else pa.array([], pa.string())
        roles = ["user"] * len(rows)
    else:
        m_texts = m_content.take(pa.array(turn_idx))
        m_roles = m_role.take(pa.array(turn_idx)).to_pylist()
        if not prompt_rows.any():
            contents, roles = m_texts, m_roles
        else:  # interleave (rare: a block mixing prompt and messages rows)
            p_texts = prompt.take(pa.array(rows[prompt_rows])).to_pylist()
            mt, pt, mr = m_texts.to_pylist(), iter(p_texts), iter(m_roles)
            pos = 0
            for is_p, k in zip(prompt_rows.tolist(), keep_n.tolist()):
                if is_p:
                    pieces.append(next(pt))
                    roles.append("user")
                else:
                    pieces += mt[pos : pos + k]
                    roles += [next(mr) for _ in range(k)]
                    pos += k
            contents = pa.array(pieces, pa.string())
    # per row: its last kept turn (the last user turn, or the prompt) is not blank by Python's strip(); a prompt has
    # no NUL (messages rows were checked above, over all their turns)
    good = np.ones(len(rows), bool)
    if len(contents):
        good &= pc.match_substring_regex(contents, f"[^{PY_SPACE}]").to_numpy(zero_copy_only=False)[starts[1:] - 1]
        good &= ~(pc.match_substring(contents, "\x00").to_numpy(zero_copy_only=False)[starts[1:] - 1] & prompt_rows)
    labels = {}
    for name, c in (("route", route), ("tenant", tenant)):
        if c is None or pa.types.is_null(c.type):
            labels[name] = ["default"] * len(rows)
            continue
        sub = c.take(pa.array(rows))
        good &= ~pc.fill_null(pc.greater(pc.utf8_length(sub), MAX_LABEL_CHARS), False).to_numpy(zero_copy_only=False)
        labels[name] = [v or "default" for v in sub.to_pylist()]
    nums = {}
    for name, c in (("ts", ts), ("latency_ms", latency)):
        if c is None or pa.types.is_null(c.type):
            nums[name] = np.full(len(rows), np.nan)
            continue
        sub = c.take(pa.array(rows))
        # an integer beyond 2**53 rounds to the nearest float, as float(int) does in parse_record
        v = sub.cast(pa.float64(), safe=False).fill_null(np.nan).to_numpy(zero_copy_only=False)
        present = sub.is_valid().to_numpy(zero_copy_only=False)
        good &= ~present | np.isfinite(v)
        if name == "latency_ms":
            good &= ~present | (v >= 0)
        nums[name] = v
    if not good.all():  # those rows go line by line: drop them here
        keep = np.flatnonzero(good)
        ok[rows[~good]] = False
        take = ranges(starts[keep], keep_n[keep])
        contents = contents.take(pa.array(take, pa.int64()))
        roles = [roles[i] for i in take.tolist()]
        starts = np.concatenate(([0], np.cumsum(keep_n[keep]))).astype(np.int64)
        rows = rows[keep]
        labels = {k: [v[i] for i in keep.tolist()] for k, v in labels.items()}
        nums = {k: v[keep] for k, v in nums.items()}
    return ok, Batch(
        lines=rows.astype(np.int64),
        routes=labels["route"],
        tenants=labels["tenant"],
        ts=nums["ts"],
        latency=nums["latency_ms"],
        roles=roles,
        contents=contents,
        starts=starts,
    )
