"""Least squares for the latency model, in pure Python (the model has at most six terms).

Fits minimise the relative error by default (each row weighted by 1/y^2): a step of 5 ms off by
1 ms is as wrong as one of 500 ms off by 100 ms, and the model's users (TTFT, TPOT against SLOs)
care about ratios. Used offline by `disagg profile` and online by the router as step reports come in.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.placement.latency_model import Coefficients, StepModel
from disagg.step_work import MeasuredStep, StepWork


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


# ---- steps of each kind -------------------------------------------------------------------------
def fit_prefill(steps: Sequence[MeasuredStep]) -> Coefficients:
    """Steps of prompt chunks -> a + b * tokens + c * attention (sum(l), sum(l^2) for whole prompts)."""
    rows = [[1.0, float(s.work.prefill_tokens), float(s.work.prefill_attention)] for s in steps]
    return Coefficients(*least_squares(rows, [s.ms for s in steps]))


def fit_decode(steps: Sequence[MeasuredStep]) -> Coefficients:
    """Decode steps -> a + b * sum(ctx) + c * batch."""
    rows = [[1.0, float(s.work.decode_context_sum), float(s.work.num_decodes)] for s in steps]
    return Coefficients(*least_squares(rows, [s.ms for s in steps]))


def fit_mixed(steps: Sequence[MeasuredStep]) -> tuple[float, ...]:
    """Mixed steps -> the five coefficients of the "fit" mixed form (latency_model.StepModel)."""
    rows = [
        [
            1.0,
            float(s.work.prefill_tokens + s.work.num_decodes),
            float(s.work.prefill_attention),
            float(s.work.decode_context_sum),
            float(s.work.num_decodes),
        ]
        for s in steps
    ]
    return tuple(least_squares(rows, [s.ms for s in steps]))


def relative_errors(model: StepModel, steps: Sequence[MeasuredStep]) -> list[float]:
    """|predicted - measured| / measured of each step."""
    return [abs(model.step_ms(s.work) - s.ms) / s.ms for s in steps if s.ms > 0]


# ---- every kind at once ---------------------------------------------------------------------------
# The "sum" form of StepModel.step_ms is linear in these six terms, for every kind of step: a
# prefill step a_p + b tokens + c attention, a decode step a_d + d context + e decodes, a mixed
# step a_p + b tokens + c attention + d context + e decodes.
JOINT_TERMS = ("prefill step", "decode-only step", "prefill tokens", "prefill attention", "decode context", "decodes")
JOINT_INTERCEPTS = (0, 1)


def joint_row(work: StepWork) -> list[float]:
    """The step's value of each of JOINT_TERMS."""
    has_chunks = bool(work.chunks)
    return [
        float(has_chunks),
        float(not has_chunks),
        float(work.prefill_tokens),
        float(work.prefill_attention),
        float(work.decode_context_sum),
        float(work.num_decodes),
    ]


def joint_coefficients(w: Sequence[float]) -> tuple[Coefficients, Coefficients]:
    """(prefill, decode) coefficients from the six of JOINT_TERMS."""
    return Coefficients(w[0], w[2], w[3]), Coefficients(w[1], w[4], w[5])


def nonnegative_least_squares(
    rows: Sequence[Sequence[float]], targets: Sequence[float], free: Sequence[int] = (0,)
) -> list[float]:
    """Least squares whose coefficients are not negative, except those of the columns in `free`
    (the intercepts). A window of a few similar steps can fit "more requests, faster steps", and
    the policy would then crowd every request onto the busiest instance. A negative term is
    dropped (held at 0) and the rest refitted."""
    kept = list(range(len(rows[0])))
    while True:
        solution = least_squares([[r[j] for j in kept] for r in rows], targets)
        w = dict(zip(kept, solution))
        negative = [j for j in kept if j not in free and w[j] < 0]
        if not negative:
            return [w.get(j, 0.0) for j in range(len(rows[0]))]
        kept.remove(min(negative, key=lambda j: w[j]))


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
