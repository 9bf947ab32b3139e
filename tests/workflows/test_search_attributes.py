"""The worker registers the workflows' search attributes in its namespace, once."""

from __future__ import annotations

import uuid

from google.protobuf.duration_pb2 import Duration
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client
from temporalio.service import RPCError

from tests.support import assert_eventually_async
from workflows.search_attributes import SEARCH_ATTRIBUTES, ensure_search_attributes

NAMES = sorted(key.name for key in SEARCH_ATTRIBUTES)


async def _fresh_namespace(client: Client) -> str:
    namespace = f"sa-{uuid.uuid4().hex[:8]}"
    await client.workflow_service.register_namespace(
        RegisterNamespaceRequest(
            namespace=namespace, workflow_execution_retention_period=Duration(seconds=86400)
        )
    )
    return namespace


async def test_missing_attributes_are_added_and_a_second_call_adds_none(
    temporal_client: Client,
) -> None:
    namespace = await _fresh_namespace(temporal_client)

    async def first_call() -> list[str]:
        try:
            return await ensure_search_attributes(temporal_client, namespace)
        except RPCError as exc:  # the new namespace is not in the server's cache yet
            raise AssertionError(str(exc)) from exc

    assert await assert_eventually_async(first_call) == NAMES
    listed = await temporal_client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace)
    )
    assert set(NAMES) <= set(listed.custom_attributes)
    assert await ensure_search_attributes(temporal_client, namespace) == []


async def test_the_test_server_namespace_already_has_them(temporal_client: Client) -> None:
    assert await ensure_search_attributes(temporal_client, temporal_client.namespace) == []
