"""Per-request metrics as polars expressions (docs/analysis.md, "Per-request metrics").

Every metric is a column expression over the record columns, so a million records are one
vectorized pass and no Python loop ever touches a row. Times in `chunk_times_s` are seconds
after the request's `sent_s`; every recorded chunk carries content (`chunk_tokens` >= 1), and
reasoning chunks, when the server marks them, are the first `reasoning_chunks` of them.

Definitions (i is one request, all times from its send time):
- TTFT = first content chunk (reasoning chunks count); TTFO = first non-reasoning chunk.
- E2E = last content chunk; decode duration = E2E - TTFT.
- OSL = server `completion_tokens` when reported, else the counted chunk tokens.
- ITL = (t_last - t_first) / (OSL - 1), undefined when OSL < 2, and also when the whole output
  arrived in one chunk (t_last == t_first says nothing about the pace between tokens).
- interactivity = 1 / ITL (tokens/s per user).
- dispatch lateness = sent - planned (how far the client fell behind the replay schedule).
"""

from __future__ import annotations

import polars as pl

_chunks = pl.col("chunk_times_s")
_n_chunks = _chunks.list.len()
_t_first = _chunks.list.first()
_t_last = _chunks.list.last()
_served = pl.col("completion_tokens").cast(pl.Int64)
_counted = pl.col("chunk_tokens").list.sum().cast(pl.Int64)

OK = pl.col("error_class").is_null()
PROFILING = pl.col("phase") == "profiling"


def _itl(osl: pl.Expr) -> pl.Expr:
    return pl.when((osl >= 2) & (_n_chunks >= 2)).then((_t_last - _t_first) / (osl - 1))


OSL = pl.coalesce(_served, _counted)
TTFT = _t_first
TTFO = pl.when(pl.col("reasoning_chunks").is_not_null()).then(
    _chunks.list.get(pl.col("reasoning_chunks"), null_on_oob=True)
)
E2E = _t_last
DECODE = _t_last - _t_first
ITL = _itl(OSL)
LATENESS = pl.col("sent_s") - pl.col("planned_s")

# The columns every later stage reads; list columns are dropped here so the per-request table of a
# million requests stays a few tens of megabytes.
REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id",
    "session_id",
    "lane",
    "pass",
    "agent_id",
    "turn",
    "phase",
    "ok",
    "error_class",
    "error_message",
    "sent_s",
    "end_s",
    "first_s",
    "ttft_s",
    "ttfo_s",
    "e2e_s",
    "decode_s",
    "itl_s",
    "interactivity_tok_s",
    "osl",
    "prompt_tokens",
    "cached_tokens",
    "lateness_s",
)


def _osl(records: pl.LazyFrame) -> pl.Expr:
    """OSL as `OSL` defines it, reading the chunk-token lists only if some record needs them.

    After the chunk times, the chunk-token lists are a run's largest column (a million
    AgentX-sized records hold ~2 GB of them), and a coalesce reads the whole column even when
    no row uses it. Most runs carry the server's count on every record, so one pass over that
    scalar column decides first; the values are the same either way.
    """
    missing = records.select(pl.col("completion_tokens").is_null().any()).collect().item()
    return OSL if missing else _served


def request_table(records: pl.LazyFrame) -> pl.LazyFrame:
    """One row per request with every per-request metric; nothing is filtered here."""
    osl = _osl(records)
    return (
        records.with_columns(
            ok=OK,
            osl=osl,
            ttft_s=TTFT,
            ttfo_s=TTFO,
            e2e_s=E2E,
            decode_s=DECODE,
            itl_s=_itl(osl),
            lateness_s=LATENESS,
            first_s=pl.col("sent_s") + _t_first,
            # A request without chunks (an error before the first token) ends when it was sent.
            end_s=pl.col("sent_s") + pl.coalesce(_t_last, pl.lit(0.0)),
        )
        .with_columns(
            interactivity_tok_s=pl.when(pl.col("itl_s") > 0).then(1.0 / pl.col("itl_s")),
        )
        .select(REQUEST_COLUMNS)
    )


def chunk_table(records: pl.LazyFrame) -> pl.LazyFrame:
    """One row per streamed chunk (absolute time, tokens) of successful profiling requests.

    Only the report's over-time plots need this; it explodes the chunk lists, so it is never
    part of the summary path.
    """
    times = pl.col("chunk_times_s")
    reported = pl.col("chunk_tokens")
    # Servers that do not report tokens per chunk (vLLM streams) leave chunk_tokens null: spread
    # the request's completion tokens evenly over its chunks, which keeps per-request totals exact.
    spread = times.list.eval(pl.element() * 0.0 + 1.0) * (
        pl.col("completion_tokens") / times.list.len()
    )
    return (
        records.filter(OK & PROFILING)
        .select(
            t_s=pl.col("sent_s") + times,
            tokens=pl.when(reported.list.len() == times.list.len())
            .then(reported.cast(pl.List(pl.Float64)))
            .otherwise(spread),
        )
        .explode("t_s", "tokens")
        .drop_nulls()
    )
