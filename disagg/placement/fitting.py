"""Least squares for the latency model, in pure Python (the model has at most five terms).

Fits minimise the relative error by default (each row weighted by 1/y^2): a step of 5 ms off by
1 ms is as wrong as one of 500 ms off by 100 ms, and the model's users (TTFT, TPOT against SLOs)
care about ratios. Used offline by `disagg profile` and online by the router as step reports come in.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.placement.latency_model import Chunk, Coefficients, StepModel


def least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float], relative: bool = True) -> list[float]:
    """w minimising sum_i weight_i (rows_i . w - targets_i)^2, by the normal equations."""
    if not rows or len(rows) != len(targets):
        raise ValueError("least_squares: need as many targets as rows, and at least one")
    n = len(rows[0])
    if len(rows) < n:
        raise ValueError(f"least_squares: {len(rows)} samples cannot determine {n} coefficients")
    # Columns are scaled to unit size first: sum(l^2) is ~1e6 times sum(l), and the normal
    # equations would lose the small coefficients to rounding otherwise.
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    gram = [[0.0] * n for _ in range(n)]
    rhs = [0.0] * n
    for row, y in zip(rows, targets):
        weight = 1.0 / (y * y) if relative and y != 0 else 1.0
        x = [v / s for v, s in zip(row, scale)]
        for i in range(n):
            rhs[i] += weight * x[i] * y
            for j in range(i, n):
                gram[i][j] += weight * x[i] * x[j]
    for i in range(n):
        for j in range(i):
            gram[i][j] = gram[j][i]
        gram[i][i] += 1e-12 * (gram[i][i] or 1.0)  # a column that never varies gets ~0, not a crash
    w = _solve(gram, rhs)
    return [wi / s for wi, s in zip(w, scale)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is small and symmetric positive semi-definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        acc = m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))
        x[r] = acc / m[r][r] if abs(m[r][r]) >= 1e-300 else 0.0
    return x


# ---- samples of each kind of step --------------------------------------------------------------
def fit_prefill(samples: Sequence[tuple[Sequence[int], float]]) -> Coefficients:
    """[(prompt lengths of the batch, step ms)] -> a + b sum(l) + c sum(l^2)."""
    rows = [[1.0, float(sum(lens)), float(sum(n * n for n in lens))] for lens, _ in samples]
    return Coefficients(*least_squares(rows, [ms for _, ms in samples]))


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> Coefficients:
    """[(batch, sum of contexts, step ms)] -> a + b sum(ctx) + c batch."""
    rows = [[1.0, float(ctx), float(batch)] for batch, ctx, _ in samples]
    return Coefficients(*least_squares(rows, [ms for _, _, ms in samples]))


def fit_mixed(samples: Sequence[tuple[Sequence[Chunk], int, int, float]]) -> tuple[float, ...]:
    """[(chunks, decodes, sum of decode contexts, step ms)] -> the five mixed-step coefficients."""
    rows = [
        [
            1.0,
            float(sum(c.num_tokens for c in chunks) + batch),
            float(sum(c.attention for c in chunks)),
            float(ctx),
            float(batch),
        ]
        for chunks, batch, ctx, _ in samples
    ]
    return tuple(least_squares(rows, [s[-1] for s in samples]))


def relative_errors(model: StepModel, samples: Sequence[tuple[Sequence[Chunk], int, int, float]]) -> list[float]:
    """|predicted - measured| / measured for each (chunks, decodes, decode context sum, ms)."""
    return [abs(model.step_ms(chunks, batch, ctx) - ms) / ms for chunks, batch, ctx, ms in samples if ms > 0]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
