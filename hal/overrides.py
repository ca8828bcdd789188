"""What a vendor class's op overrides accept, for callers that serve overrides written against an older
signature of `hal.Vendor` (a third-party vendor keeps working when a keyword is added)."""

from __future__ import annotations

import functools
import inspect

#: `grouped_matmul` keywords added after vendors could override it, in the order they came.
OPTIONAL_GEMM_KEYWORDS = ("activation", "row_index")


@functools.lru_cache(maxsize=None)
def grouped_matmul_keywords(vendor_type: type) -> frozenset[str]:
    """Which of `OPTIONAL_GEMM_KEYWORDS` the `grouped_matmul` of `vendor_type` accepts (all of them when it takes
    `**kwargs`). Callers gather the rows, or activate in a second call, for an override that predates a keyword.
    Looked up once per class."""
    params = inspect.signature(vendor_type.grouped_matmul).parameters  # type: ignore[attr-defined]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset(OPTIONAL_GEMM_KEYWORDS)
    return frozenset(k for k in OPTIONAL_GEMM_KEYWORDS if k in params)


@functools.lru_cache(maxsize=None)
def accepts_keyword(vendor_type: type, method: str, keyword: str) -> bool:
    """Whether `vendor_type`'s `method` takes `keyword` (or `**kwargs`): callers compute what a keyword asks for
    themselves for an override that predates it (e.g. `sort_by_expert(..., tokens=True)`). Looked up once."""
    params = inspect.signature(getattr(vendor_type, method)).parameters
    return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
