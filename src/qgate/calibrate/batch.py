"""Accepted requests as columns, and the rejects of the same lines: what the traffic readers hand the sampler.

batch = Batch.from_items(items)      # from read_traffic's Request and Reject records
both = concat(first, second)         # two batches of consecutive lines as one
batch.requests()                     # back to Request records (tests, small callers)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qgate.calibrate.reader import Reject, Request


@dataclass
class Batch:
    """Accepted requests as columns (in line order), and the rejected records of the same lines."""

    lines: np.ndarray  # int64 [n]: line (JSONL) or row (Parquet) number
    routes: list[str]
    tenants: list[str]
    ts: np.ndarray  # float64 [n], NaN where the record has none
    latency: np.ndarray  # float64 [n], NaN where the record has none
    roles: list[str]  # [turns]: each request's chat.request_turns (up to its last user or tool turn), flattened
    contents: object  # pyarrow StringArray [turns]
    starts: np.ndarray  # int64 [n + 1]: request i's turns are [starts[i], starts[i + 1])
    rejects: list[Reject] = field(default_factory=list)

    @property
    def records(self) -> int:
        return len(self.lines) + len(self.rejects)

    @classmethod
    def from_items(cls, items: list[Request | Reject]) -> Batch:
        import pyarrow as pa

        reqs = [x for x in items if isinstance(x, Request)]
        turns = [t for r in reqs for t in r.messages]
        nan = float("nan")
        return cls(
            lines=np.array([r.line for r in reqs], dtype=np.int64),
            routes=[r.route for r in reqs],
            tenants=[r.tenant for r in reqs],
            ts=np.array([nan if r.ts is None else r.ts for r in reqs], dtype=np.float64),
            latency=np.array([nan if r.latency_ms is None else r.latency_ms for r in reqs], dtype=np.float64),
            roles=[role for role, _ in turns],
            contents=pa.array([c for _, c in turns], pa.string()),
            starts=np.cumsum([0] + [len(r.messages) for r in reqs], dtype=np.int64),
            rejects=[x for x in items if isinstance(x, Reject)],
        )

    def requests(self) -> list[Request]:
        """The accepted records as `read_traffic` gives them (for tests and small callers)."""
        contents = self.contents.to_pylist()
        out = []
        for i, line in enumerate(self.lines.tolist()):
            a, b = int(self.starts[i]), int(self.starts[i + 1])
            ts, lat = float(self.ts[i]), float(self.latency[i])
            out.append(
                Request(
                    line=line,
                    messages=tuple(zip(self.roles[a:b], contents[a:b], strict=True)),
                    route=self.routes[i],
                    tenant=self.tenants[i],
                    ts=None if ts != ts else ts,
                    latency_ms=None if lat != lat else lat,
                )
            )
        return out


def concat(a: Batch, b: Batch) -> Batch:
    """Two batches of consecutive lines as one."""
    import pyarrow as pa

    return Batch(
        lines=np.concatenate([a.lines, b.lines]),
        routes=a.routes + b.routes,
        tenants=a.tenants + b.tenants,
        ts=np.concatenate([a.ts, b.ts]),
        latency=np.concatenate([a.latency, b.latency]),
        roles=a.roles + b.roles,
        contents=pa.concat_arrays([a.contents, b.contents]),
        starts=np.concatenate([a.starts, b.starts[1:] + a.starts[-1]]),
        rejects=a.rejects + b.rejects,
    )


def merge(a: Batch, b: Batch) -> Batch:
    """The two batches' requests interleaved in line order (b holds few)."""
    import pyarrow as pa

    both = concat(a, b)
    order = np.argsort(both.lines, kind="stable")
    sizes = np.diff(both.starts)[order]
    take = ranges(both.starts[:-1][order], sizes)
    return Batch(
        lines=both.lines[order],
        routes=[both.routes[i] for i in order.tolist()],
        tenants=[both.tenants[i] for i in order.tolist()],
        ts=both.ts[order],
        latency=both.latency[order],
        roles=[both.roles[i] for i in take.tolist()],
        contents=both.contents.take(pa.array(take, pa.int64())),
        starts=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
        rejects=sorted(both.rejects, key=lambda r: r.line),
    )


def ranges(lo: np.ndarray, size: np.ndarray) -> np.ndarray:
    """The concatenation of arange(lo[i], lo[i] + size[i]) over i, without a Python loop."""
    size = np.asarray(size, dtype=np.int64)
    ends = np.cumsum(size)
    return np.repeat(np.asarray(lo, dtype=np.int64) - (ends - size), size) + np.arange(
        int(ends[-1]) if len(ends) else 0
    )
