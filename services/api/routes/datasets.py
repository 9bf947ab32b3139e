"""The immutable dataset snapshots of a loop, for operators (``ratchet datasets``).

``GET /v1/loops/{loop}/datasets`` lists them newest first in pages joined by an opaque
cursor; ``GET /v1/datasets/{dataset_id}`` shows one by its row id (counts, files, statistics
and how many traces it came from).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from services.api.deps import AdminDep, SessionDep
from services.api.errors import ApiError
from services.api.routes.loops import loop_or_404
from services.api.routes.trace_listing import decode_id_cursor, encode_id_cursor
from services.api.schemas.tasks import DatasetDetail, DatasetPage, DatasetPublic
from services.db.models import Dataset
from services.db.queries import datasets as q

router = APIRouter(prefix="/v1", tags=["datasets"], dependencies=[AdminDep])


def dataset_public(dataset: Dataset) -> DatasetPublic:
    return DatasetPublic(
        id=dataset.id,
        content_hash=dataset.content_hash,
        train_count=dataset.train_count,
        eval_count=dataset.eval_count,
        regression_count=dataset.regression_count,
        heldout_count=dataset.heldout_count,
        train_uri=dataset.train_uri,
        eval_uri=dataset.eval_uri,
        regression_uri=dataset.regression_uri,
        heldout_uri=dataset.heldout_uri,
        replay_count=dataset.replay_count,
        replay_uri=dataset.replay_uri,
        stats=dataset.stats,
        created_at=dataset.created_at,
    )


@router.get(
    "/loops/{loop}/datasets",
    summary="List a loop's dataset snapshots, newest first",
    responses={
        400: {"description": "A cursor this API did not give out (field: cursor)"},
        404: {"description": "No such loop"},
    },
)
def list_loop_datasets(
    loop: str,
    session: SessionDep,
    cursor: Annotated[str | None, Query(max_length=200, description="next_cursor")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> DatasetPage:
    row = loop_or_404(session, loop)
    rows = q.list_datasets(
        session=session, loop_id=row.id, limit=limit + 1, before_id=decode_id_cursor(cursor)
    )
    page = rows[:limit]
    more = len(rows) > limit
    return DatasetPage(
        datasets=[dataset_public(dataset) for dataset in page],
        next_cursor=encode_id_cursor(page[-1].id) if more else None,
    )


@router.get(
    "/datasets/{dataset_id}",
    summary="One dataset: counts, files, statistics and how many traces it came from",
    responses={404: {"description": "No dataset with this id"}},
)
def show_dataset(
    dataset_id: Annotated[int, Path(ge=1, le=2**63 - 1)], session: SessionDep
) -> DatasetDetail:
    found = q.dataset_with_loop_name(session=session, dataset_id=dataset_id)
    if found is None:
        raise ApiError(404, "dataset_not_found", f"there is no dataset {dataset_id}")
    dataset, loop = found
    return DatasetDetail(
        **dataset_public(dataset).model_dump(),
        loop=loop,
        source_traces=q.dataset_source_trace_count(session=session, dataset_id=dataset.id),
    )
